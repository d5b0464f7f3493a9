"""GRPO's advantages and loss pinned to values worked out by hand (hpcrl/algorithms/grpo.py)."""

from __future__ import annotations

import math

import pytest
import torch

from hpcrl.algorithms import load_algorithm
from hpcrl.algorithms.base import Options, Rollout
from hpcrl.algorithms.grpo import GrpoOptions
from hpcrl.algorithms.terms import Normaliser

GRPO = load_algorithm("grpo")


def group(rewards: list[float]) -> list[Rollout]:
    return [Rollout.single_turn([1], [2, 3], [-1.0, -1.0], reward=r) for r in rewards]


def test_grpo_advantages_are_the_rewards_standardised_within_each_group_with_every_group_kept():
    selection = GRPO.select([group([1.0, 0.0, 0.0, 1.0]), group([1.0, 1.0, 1.0, 1.0])], GrpoOptions(), wanted=2)
    # Group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.5773503; 0.5 / (0.5773503 + 1e-6) = 0.8660239.
    # Group 1: equal rewards, zero advantages, kept (no filtering by default).
    assert selection.kept == [0, 1] and selection.dropped_zero_variance == 0
    assert selection.advantages[0] == pytest.approx([0.8660239, -0.8660239, -0.8660239, 0.8660239], abs=1e-7)
    assert selection.advantages[1] == [0.0, 0.0, 0.0, 0.0]
    filtered = GRPO.select([group([1.0, 0.0, 0.0, 1.0]), group([1.0, 1.0, 1.0, 1.0])],
                           GrpoOptions(filter_zero_variance=True), wanted=2)
    assert filtered.kept == [0] and filtered.dropped_zero_variance == 1


def test_grpo_loss_is_the_token_mean_of_the_per_token_clipped_ratio_times_the_advantage():
    a = 0.8660239
    # Old logprobs 0: each ratio is exp(logp). Sequence 0 (A = +a): ratios 1.5, 1.1; sequence 1 (A = -a):
    # ratios 0.5, 0.9; position 0 is the prompt token (mask 0).
    logp = torch.tensor([[0.0, math.log(1.5), math.log(1.1)], [0.0, math.log(0.5), math.log(0.9)]],
                        requires_grad=True)
    mask = torch.tensor([[0, 1, 1], [0, 1, 1]], dtype=torch.bool)
    share = GRPO.loss(logprobs=logp, old_logprobs=torch.zeros(2, 3), advantages=torch.tensor([a, -a]), mask=mask,
                      settings=Options(clip_eps_low=0.2, clip_eps_high=0.28), norm=Normaliser(tokens=4, sequences=2))
    # Token losses: -min(1.5a, 1.28a) = -1.28a (clipped high); -1.1a; -min(-0.5a, -0.8a) = 0.8a (clipped low); 0.9a.
    # token_mean: (-1.28 - 1.1 + 0.8 + 0.9) a / 4 = -0.17 a = -0.1472241.
    assert share.loss.item() == pytest.approx(-0.1472241, abs=1e-6)
    assert (share.clipped_low.item(), share.clipped_high.item()) == (1, 1)
    (grad,) = torch.autograd.grad(share.loss, logp)
    # d/dlogp of -r A / 4 is -r A / 4 on unclipped tokens: -1.1a/4 = -0.2381566, 0.9a/4 = 0.1948554; clipped: 0.
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, -0.2381566], [0.0, 0.0, 0.1948554]]),
                               atol=1e-6, rtol=0)
