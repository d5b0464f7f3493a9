"""Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): GRPO without its two biases.

GRPO divides each advantage by the group's reward std (favouring prompts that are too easy or too
hard) and each sequence's loss by its length (favouring long wrong answers). Dr. GRPO removes both:

    samples     as GRPO
    advantages  per sequence, A_i = r_i - mean(r) within the group (advantage_norm = "mean")
    loss        GRPO's per-token clipped ratio, summed over every generated token of the step and
                divided by a constant, max_tokens x sequences (loss_aggregation = "seq_mean_token_sum_norm",
                with max_tokens = inference.max_tokens), not by each sequence's own length

Run the tests: `python -m pytest tests/algorithms/test_dr_grpo.py -q`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpcrl.algorithms.base import Algorithm, Groups, LossSettings, LossShare, Selection, Settings

if TYPE_CHECKING:
    from torch import Tensor

    from hpcrl.algorithms.terms import Normaliser

DEFAULTS = {"advantage_norm": "mean", "loss_aggregation": "seq_mean_token_sum_norm"}


def select(groups: Groups, settings: Settings, *, wanted: int | None = None) -> Selection:
    """Every group of the batch (or those with a signal, when filtering), with mean-centred advantages."""
    from hpcrl.algorithms.terms import group_selection

    return group_selection([[r.reward for r in group] for group in groups], norm=settings.advantage_norm,
                           filter_zero_variance=settings.filter_zero_variance)


def loss(*, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, settings: LossSettings,
         norm: Normaliser, ref_logprobs: Tensor | None = None) -> LossShare:
    """This micro-batch's share of the step's Dr. GRPO loss: token_ratio_loss with the constant-length
    aggregation of `settings` (DEFAULTS)."""
    from hpcrl.algorithms.terms import token_ratio_loss

    return token_ratio_loss(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
                            settings=settings, norm=norm, ref_logprobs=ref_logprobs)


ALGORITHM = Algorithm(name="dr_grpo", defaults=DEFAULTS, select=select, loss=loss)
