"""DAPO: overlong shaping, dynamic sampling's refill decisions, clip-higher, against hand-worked values."""

from __future__ import annotations

import math

import pytest
import torch

from hpcrl.algorithms import load_algorithm
from hpcrl.algorithms.base import Options, Rollout
from hpcrl.algorithms.dapo import DapoOptions, overlong_penalty
from hpcrl.algorithms.terms import Normaliser

DAPO = load_algorithm("dapo")


def rollout(reward: float, generated: int = 1) -> Rollout:
    return Rollout.single_turn([1], [2] * generated, [-1.0] * generated, reward=reward)


def test_dapo_defaults_turn_on_dynamic_sampling_clip_higher_and_token_level_loss():
    assert DAPO.defaults["clip_eps_high"] == 0.28 and DAPO.defaults["loss_aggregation"] == "token_mean"
    assert DAPO.defaults["dynamic_sampling"] and DAPO.defaults["filter_zero_variance"]


@pytest.mark.parametrize("generated, expected", [(3, 0.0), (6, 0.0), (7, -0.25), (8, -0.5), (10, -1.0), (12, -1.0)])
def test_overlong_penalty_ramps_over_the_last_buffer_tokens_of_the_budget(generated, expected):
    # max_tokens 10, buffer 4: no penalty up to 6 tokens, then (6 - |y|) / 4, and -1 at 10 and beyond.
    assert overlong_penalty(generated, max_tokens=10, buffer=4, penalty=1.0) == expected


def test_overlong_shaping_gives_a_group_of_equal_rewards_a_signal_and_its_advantages():
    settings = DapoOptions(filter_zero_variance=True, dynamic_sampling=True, overlong_buffer_fraction=0.4, max_tokens=10)
    # Both right (reward 1); 5 tokens is before the buffer (starts at 6), 8 tokens gets -0.5: shaped 1 and 0.5.
    selection = DAPO.select([[rollout(1.0, 5), rollout(1.0, 8)], [rollout(0.0, 2), rollout(0.0, 3)]], settings,
                            wanted=2)
    # Group 0: mean 0.75, unbiased std sqrt(2 * 0.25^2) = 0.3535534; 0.25 / (0.3535534 + 1e-6) = 0.7071048.
    assert selection.kept == [0] and selection.dropped_zero_variance == 1
    assert selection.advantages[0] == pytest.approx([0.7071048, -0.7071048], abs=1e-7)


def test_dynamic_sampling_asks_for_prompts_until_enough_groups_have_a_signal_or_the_rounds_run_out():
    settings = DapoOptions(filter_zero_variance=True, dynamic_sampling=True, max_sampling_rounds=3)
    flat, mixed = [rollout(1.0), rollout(1.0)], [rollout(1.0), rollout(0.0)]
    # 1 group of 4 with a signal, 4 wanted: 3 missing at a rate of 1/4 -> 12 prompts, capped at a batch (4).
    assert DAPO.more_prompts([mixed, flat, flat, flat], settings, wanted=4, rounds_done=1) == 4
    # 3 of 6 with a signal: 1 missing at a rate of 1/2 -> 2 prompts.
    assert DAPO.more_prompts([mixed, mixed, mixed, flat, flat, flat], settings, wanted=4, rounds_done=2) == 2
    # No signal yet: a whole batch.
    assert DAPO.more_prompts([flat, flat], settings, wanted=4, rounds_done=1) == 4
    # Enough, or the rounds are spent: none.
    assert DAPO.more_prompts([mixed] * 4, settings, wanted=4, rounds_done=1) == 0
    assert DAPO.more_prompts([flat] * 4, settings, wanted=4, rounds_done=3) == 0
    # And the batch trains the first 4 groups with a signal, in generation order.
    selection = DAPO.select([flat, mixed, mixed, flat, mixed, mixed, mixed], settings, wanted=4)
    assert selection.kept == [1, 2, 4, 5] and selection.dropped_zero_variance == 2


def test_dapo_loss_clips_higher_above_than_below_and_averages_over_every_token():
    # Old logprobs 0: ratios exp(logp). Sequence 0 (A = +1): ratio 1.25, inside 1 + 0.28 (GRPO's 1.2 would clip
    # it), and 1.5, clipped to 1.28. Sequence 1 (A = -1): ratio 0.75, clipped to 0.8.
    logp = torch.tensor([[0.0, math.log(1.25), math.log(1.5)], [0.0, math.log(0.75), 0.0]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.bool)
    share = DAPO.loss(logprobs=logp, old_logprobs=torch.zeros(2, 3), advantages=torch.tensor([1.0, -1.0]), mask=mask,
                      settings=Options(name="dapo", clip_eps_low=0.2, clip_eps_high=0.28),
                      norm=Normaliser(tokens=3, sequences=2))
    # token_mean: (-1.25 - 1.28 + 0.8) / 3 = -0.5766667
    assert share.loss.item() == pytest.approx(-0.5766667, abs=1e-6)
    (grad,) = torch.autograd.grad(share.loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1.25 / 3, 0.0], [0.0, 0.0, 0.0]]))
