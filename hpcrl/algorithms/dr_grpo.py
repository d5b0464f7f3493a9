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

from hpcrl.algorithms.base import Algorithm

# Samples, advantages and the per-token loss as GRPO: what differs is DEFAULTS (advantage_norm, aggregation).
from hpcrl.algorithms.grpo import GrpoOptions, loss, select

DEFAULTS = {"advantage_norm": "mean", "loss_aggregation": "seq_mean_token_sum_norm"}

ALGORITHM = Algorithm(name="dr_grpo", options=GrpoOptions, defaults=DEFAULTS, select=select, loss=loss)
