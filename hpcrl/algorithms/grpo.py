"""GRPO (Shao et al. 2024, DeepSeekMath): group-normalised advantages and a per-token clipped ratio.

    samples     group_size completions of each prompt, one generate round per batch; with
                filter_zero_variance the groups whose rewards are all equal are left out
    advantages  per sequence, A_i = (r_i - mean(r)) / (std(r) + 1e-6) within the group (unbiased std;
                advantage_norm = "mean" drops the division)
    loss        -min(r_t A_i, clip(r_t, 1 - eps_low, 1 + eps_high) A_i), r_t = exp(logp_t - logp_old_t),
                aggregated by loss_aggregation (token_mean by default), + kl_coef * KL_t

The shared defaults of hpcrl.algorithms.base.Options are GRPO's: it sets no defaults of its own, and
declares one key (GrpoOptions), which the group-advantage algorithms built on it (dapo, gspo, dr_grpo) share.
Run the tests: `python -m pytest tests/algorithms/test_grpo.py -q`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpcrl.algorithms.base import AdvantageNorm, Algorithm, Groups, LossShare, Options, Selection, option

if TYPE_CHECKING:
    from torch import Tensor

    from hpcrl.algorithms.terms import Normaliser


@dataclass(frozen=True, kw_only=True)
class GrpoOptions(Options):
    """[algorithm] of the group-advantage algorithms: the shared keys and how a group's rewards are normalised."""

    advantage_norm: AdvantageNorm = option("mean_std", "Group advantage: (r - mean) / std, or r - mean (Dr. GRPO).")


def select(groups: Groups, settings: GrpoOptions, *, wanted: int | None = None) -> Selection:
    """Every group of the batch (or those with a signal, when filtering), with group advantages."""
    from hpcrl.algorithms.terms import group_selection

    return group_selection([[r.reward for r in group] for group in groups], norm=settings.advantage_norm,
                           filter_zero_variance=settings.filter_zero_variance)


def loss(*, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, settings: Options,
         norm: Normaliser, ref_logprobs: Tensor | None = None) -> LossShare:
    """This micro-batch's share of the step's GRPO loss (hpcrl.algorithms.terms.token_ratio_loss)."""
    from hpcrl.algorithms.terms import token_ratio_loss

    return token_ratio_loss(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
                            settings=settings, norm=norm, ref_logprobs=ref_logprobs)


ALGORITHM = Algorithm(name="grpo", options=GrpoOptions, select=select, loss=loss)
