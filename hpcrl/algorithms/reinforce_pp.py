"""REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs"): PPO's
tricks without a critic, with advantages normalised over the whole batch instead of per group.

    rewards     per token: r_t = -kl_coef x KL_t on every generated token t, plus the sequence's reward
                at its last generated token; KL_t = log pi_old(y_t) - log pi_ref(y_t) (kl_estimator,
                k1 by default as in the paper), pi_old the sampler's logprobs
    returns     G_t = sum over the generated tokens k >= t of gamma^(k - t) r_k (gamma = 1 by default)
    advantages  A_t = (G_t - mean G) / std G, mean and (population) std over every generated token of
                the batch (OpenRLHF's "reinforce" advantage estimator, the paper's reference code), not
                per group: no group baseline
    loss        PPO's per-token clipped surrogate of A_t, aggregated by loss_aggregation; no KL term in
                the loss (the KL is in the reward)

Where each part is computed. The head has the rewards and the sampler's logprobs but no reference
model (the trainer holds it, built when kl_coef > 0), so the return splits in two:

    G_t = gamma^(n_t) R  -  kl_coef x sum_k>=t gamma^(k - t) KL_k        (n_t generated tokens after t)
          head: `select`       trainer: `loss`, from ref_logprobs

`select` computes the reward's return per token and normalises it over the batch's generated tokens
(exactly REINFORCE++ when kl_coef = 0, the embedded default's setting: batch-normalised REINFORCE with
PPO clipping). With kl_coef > 0, `loss` subtracts kl_coef x the KL's return-to-go from those
advantages, per micro-batch, with the reference logprobs the trainer computed for it. That KL part is
not divided by the batch's std: normalising the sum exactly would need every micro-batch's reference
forward before the step's first backward; the KL part is small next to the normalised reward part
(KL_t ~ 1e-3 .. 1e-2 per token, kl_coef ~ 0.01), so it acts as the paper's per-token penalty unscaled.

`filter_zero_variance` (shared) still leaves out groups whose rewards are all equal before the batch
statistics are taken. Multi-turn rollouts: only generated tokens carry rewards and returns; gamma
discounts per generated token (tool tokens between turns do not count).
Run the tests: `python -m pytest tests/algorithms/test_reinforce_pp.py -q`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hpcrl.algorithms.base import Algorithm, Groups, LossShare, Options, Rollout, Selection, option

if TYPE_CHECKING:
    from torch import Tensor

    from hpcrl.algorithms.terms import Normaliser

DEFAULTS = {"kl_estimator": "k1"}


@dataclass(frozen=True, kw_only=True)
class ReinforcePPOptions(Options):
    """[algorithm] of REINFORCE++: the shared keys (kl_coef weighs the KL in the reward) and the discount."""

    gamma: float = option(1.0, "Discount of the per-token returns-to-go (1 = every token gets the sequence's "
                               "reward).", at_least=0, at_most=1)


def reward_returns(rollout: Rollout, gamma: float) -> list[float]:
    """Per token of the rollout: the return of its reward, gamma^(generated tokens after t) x reward on
    generated tokens, 0 elsewhere."""
    returns = [0.0] * len(rollout.tokens)
    after = 0
    for t in range(len(rollout.tokens) - 1, -1, -1):
        if rollout.policy_mask[t]:
            returns[t] = rollout.reward * gamma ** after
            after += 1
    return returns


def select(groups: Groups, settings: ReinforcePPOptions, *, wanted: int | None = None) -> Selection:
    """Every group (those whose rewards differ, when filtering), with per-token advantages: the reward's
    returns normalised over all generated tokens of the kept groups (module docstring)."""
    signal = [i for i, group in enumerate(groups)
              if not (settings.filter_zero_variance and all(r.reward == group[0].reward for r in group))]
    returns = [[reward_returns(r, settings.gamma) for r in groups[i]] for i in signal]
    values = [g for i, group in zip(signal, returns, strict=True) for r, ret in zip(groups[i], group, strict=True)
              for g, m in zip(ret, r.policy_mask, strict=True) if m]
    mean = math.fsum(values) / max(len(values), 1)
    var = math.fsum((g - mean) ** 2 for g in values) / max(len(values), 1)
    scale = 1.0 / math.sqrt(max(var, 1e-8))
    advantages = [[[(g - mean) * scale if m else 0.0 for g, m in zip(ret, r.policy_mask, strict=True)]
                   for r, ret in zip(groups[i], group, strict=True)] for i, group in zip(signal, returns, strict=True)]
    return Selection(kept=signal, advantages=advantages, dropped_zero_variance=len(groups) - len(signal))


def returns_to_go(values: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """[B, T]: sum over the masked positions k >= t of gamma^(masked positions between) x values_k."""
    import torch

    values = torch.where(mask, values, torch.zeros_like(values))
    if gamma == 1.0:
        return values.flip(-1).cumsum(-1).flip(-1)
    out, running = torch.zeros_like(values), torch.zeros_like(values[:, 0])
    for t in range(values.shape[-1] - 1, -1, -1):
        running = torch.where(mask[:, t], values[:, t] + gamma * running, running)
        out[:, t] = running
    return out


def loss(*, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, settings: ReinforcePPOptions,
         norm: Normaliser, ref_logprobs: Tensor | None = None) -> LossShare:
    """This micro-batch's share of the step's REINFORCE++ loss: the head's advantages less kl_coef x the
    KL's returns-to-go (with kl_coef > 0), in PPO's per-token clipped surrogate; no KL term in the loss."""
    import torch

    from hpcrl.algorithms.terms import aggregate, clipped_policy_loss, finite_where_masked, kl_per_token, policy_share
    from hpcrl.errors import HpcrlError

    mask = mask.bool()
    old_logprobs = finite_where_masked(mask, logprobs, old_logprobs)
    kl_share = torch.zeros((), dtype=torch.float64, device=logprobs.device)
    if settings.kl_coef > 0:
        if ref_logprobs is None:
            raise HpcrlError("kl_coef > 0 but no reference logprobs were given; compute them with the reference "
                             "model (TrainerEngine does) or set algorithm.kl_coef = 0")
        ref_logprobs = finite_where_masked(mask, logprobs, ref_logprobs)
        kl = kl_per_token(old_logprobs, ref_logprobs, estimator=settings.kl_estimator).detach()
        advantages = advantages - settings.kl_coef * returns_to_go(kl, mask, settings.gamma)
        kl_share = aggregate(torch.where(mask, kl, torch.zeros_like(kl)), mask, aggregation="token_mean",
                             norm=norm).double()
    per_token, low, high = clipped_policy_loss(logprobs, old_logprobs, advantages, clip_eps_low=settings.clip_eps_low,
                                               clip_eps_high=settings.clip_eps_high,
                                               behavior_cap=settings.behavior_weight_cap)
    share = policy_share(per_token, low, high, logprobs=logprobs, mask=mask, settings=replace(settings, kl_coef=0.0),
                         norm=norm, ref_logprobs=None)
    return replace(share, kl=kl_share)


ALGORITHM = Algorithm(name="reinforce_pp", options=ReinforcePPOptions, defaults=DEFAULTS, select=select, loss=loss)
