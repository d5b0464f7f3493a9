"""GSPO (Zheng et al. 2025, Group Sequence Policy Optimization): a sequence-level importance ratio.

A per-token ratio is one noisy sample per token, and on Mixture-of-Experts models the experts a
token is routed to change between the sampler and the trainer; GSPO clips and weights whole
sequences instead:

    samples     as GRPO
    advantages  per sequence, as GRPO
    ratio       s_i = exp(mean over the sequence's generated tokens of (logp_t - logp_old_t))
    loss        -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i) for each sequence; with
                seq_mean_token_mean its gradient is s_i A_i mean_t grad logp_t, the paper's
                (computed in GSPO-token form: each token carries the value sg[s_i] exp(logp_t -
                sg[logp_t]), which equals s_i in value and gives the gradient above)
    clips       small, since s_i is a mean: the paper's 3e-4 below and 4e-4 above

Run the tests: `python -m pytest tests/algorithms/test_gspo.py -q`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpcrl.algorithms.base import Algorithm, LossShare, Options
from hpcrl.algorithms.grpo import GrpoOptions, select  # samples and advantages as GRPO

if TYPE_CHECKING:
    from torch import Tensor

    from hpcrl.algorithms.terms import Normaliser

DEFAULTS = {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4, "loss_aggregation": "seq_mean_token_mean"}


def sequence_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """[B, T]: each token carries its sequence's ratio s_i in value, with gradient s_i grad logp_t."""
    import torch

    weights = mask.to(logprobs.dtype)
    mean_log_ratio = ((logprobs - old_logprobs) * weights).sum(dim=-1) / weights.sum(dim=-1).clamp(min=1.0)
    return torch.exp(logprobs - logprobs.detach() + mean_log_ratio.detach().unsqueeze(-1))


def loss(*, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, settings: Options,
         norm: Normaliser, ref_logprobs: Tensor | None = None) -> LossShare:
    """This micro-batch's share of the step's GSPO loss (module docstring); a clipped sequence counts
    all its tokens in the clip fractions."""
    import torch

    from hpcrl.algorithms.terms import clipped_surrogate, finite_where_masked, policy_share

    mask = mask.bool()
    old_logprobs = finite_where_masked(mask, logprobs, old_logprobs)
    if ref_logprobs is not None:
        ref_logprobs = finite_where_masked(mask, logprobs, ref_logprobs)
    if settings.behavior_weight_cap > 0:  # decoupled (terms.clipped_policy_loss): the sequence ratio's form of it
        proximal = logprobs.detach()
        ratio = sequence_ratio(logprobs, proximal, mask)
        # each token carries its sequence's behaviour ratio (the geometric mean over its tokens), truncated
        weight = sequence_ratio(proximal, old_logprobs, mask).clamp(max=settings.behavior_weight_cap).detach()
    else:
        ratio, weight = sequence_ratio(logprobs, old_logprobs, mask), torch.ones(())
    per_token, low, high = clipped_surrogate(ratio, advantages, clip_eps_low=settings.clip_eps_low,
                                             clip_eps_high=settings.clip_eps_high)
    per_token = per_token * weight
    return policy_share(per_token, low, high, logprobs=logprobs, mask=mask, settings=settings, norm=norm,
                        ref_logprobs=ref_logprobs)


ALGORITHM = Algorithm(name="gspo", options=GrpoOptions, defaults=DEFAULTS, select=select, loss=loss)
