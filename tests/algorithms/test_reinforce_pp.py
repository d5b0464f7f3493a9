"""REINFORCE++'s advantages and loss pinned to values worked out by hand (hpcrl/algorithms/reinforce_pp.py)."""

from __future__ import annotations

import pytest
import torch

from hpcrl.algorithms import load_algorithm
from hpcrl.algorithms.base import Rollout
from hpcrl.algorithms.reinforce_pp import ReinforcePPOptions, returns_to_go
from hpcrl.algorithms.terms import Normaliser
from hpcrl.errors import ConfigError

RPP = load_algorithm("reinforce_pp")
ROOT2, HALF_ROOT2 = 1.4142136, 0.7071068


def rollout(generated: int, reward: float) -> Rollout:
    return Rollout.single_turn([1], [2] * generated, [-1.0] * generated, reward=reward)


GROUPS = [[rollout(2, 1.0), rollout(1, 0.0)], [rollout(2, 0.0), rollout(1, 0.0)]]


def test_advantages_are_the_returns_normalised_over_every_generated_token_of_the_batch_not_per_group():
    selection = RPP.select(GROUPS, ReinforcePPOptions(), wanted=2)
    # Returns (gamma 1): the reward on each generated token: [1, 1], [0], [0, 0], [0]. Over those six tokens
    # mean 1/3, population std sqrt(2/9) = 0.4714045: 1 -> (2/3) / 0.4714045 = sqrt(2), 0 -> -sqrt(2)/2.
    # Group 1's rewards are all 0, yet its tokens get -sqrt(2)/2: the baseline is the batch's, not the group's.
    assert selection.kept == [0, 1] and selection.dropped_zero_variance == 0
    assert selection.advantages[0][0] == pytest.approx([0.0, ROOT2, ROOT2], abs=1e-6)   # the prompt token gets 0
    assert selection.advantages[0][1] == pytest.approx([0.0, -HALF_ROOT2], abs=1e-6)
    assert selection.advantages[1][0] == pytest.approx([0.0, -HALF_ROOT2, -HALF_ROOT2], abs=1e-6)
    assert selection.advantages[1][1] == pytest.approx([0.0, -HALF_ROOT2], abs=1e-6)


def test_gamma_discounts_the_reward_towards_the_first_generated_token():
    selection = RPP.select(GROUPS, ReinforcePPOptions(gamma=0.5), wanted=2)
    # Returns: [0.5, 1], [0], [0, 0], [0]: mean 0.25, variance (0.25^2 + 0.75^2 + 4 x 0.25^2) / 6 = 0.1458333,
    # std 0.3818813: 0.5 -> 0.6546537, 1 -> 1.9639610, 0 -> -0.6546537.
    assert selection.advantages[0][0] == pytest.approx([0.0, 0.6546537, 1.9639610], abs=1e-6)
    assert selection.advantages[1][0] == pytest.approx([0.0, -0.6546537, -0.6546537], abs=1e-6)


def test_filtering_leaves_out_equal_reward_groups_before_the_batch_statistics():
    selection = RPP.select(GROUPS, ReinforcePPOptions(filter_zero_variance=True), wanted=2)
    # Left: [1, 1], [0]: mean 2/3, std sqrt(2/9): 1 -> sqrt(2)/2, 0 -> -sqrt(2).
    assert selection.kept == [0] and selection.dropped_zero_variance == 1
    assert selection.advantages[0] == [pytest.approx([0.0, HALF_ROOT2, HALF_ROOT2], abs=1e-6),
                                       pytest.approx([0.0, -ROOT2], abs=1e-6)]


def test_the_kl_to_the_reference_is_folded_into_the_advantages_as_a_return_to_go_not_added_to_the_loss():
    # One sequence: prompt, two generated tokens; ratio 1 (logprobs = old). k1 KL = old - ref = 0.5, 0.25;
    # its returns-to-go 0.75, 0.25; kl_coef 0.1: advantages 1 - 0.075 = 0.925 and 1 - 0.025 = 0.975.
    old = torch.tensor([[0.0, -1.0, -2.0]])
    logp = old.clone().requires_grad_(True)
    mask = torch.tensor([[0, 1, 1]], dtype=torch.bool)
    share = RPP.loss(logprobs=logp, old_logprobs=old, advantages=torch.tensor([[0.0, 1.0, 1.0]]), mask=mask,
                     settings=ReinforcePPOptions(name="reinforce_pp", kl_coef=0.1, kl_estimator="k1"),
                     norm=Normaliser(tokens=2, sequences=1), ref_logprobs=torch.tensor([[0.0, -1.5, -2.25]]))
    assert share.loss.item() == pytest.approx(-(0.925 + 0.975) / 2, abs=1e-6)   # -r A, token mean
    share.loss.backward()
    # d(-r A)/d logp = -A at r = 1, over 2 tokens: no gradient from a KL term (there is none in the loss).
    assert logp.grad[0].tolist() == pytest.approx([0.0, -0.4625, -0.4875], abs=1e-6)
    assert share.kl.item() == pytest.approx(0.375)                                 # reported: the token mean of KL
    with pytest.raises(Exception, match="no reference logprobs"):
        RPP.loss(logprobs=logp, old_logprobs=old, advantages=torch.zeros(1, 3), mask=mask,
                 settings=ReinforcePPOptions(name="reinforce_pp", kl_coef=0.1), norm=Normaliser(tokens=2, sequences=1))


def test_returns_to_go_discount_per_generated_token_skipping_tool_tokens():
    values = torch.tensor([[9.0, 1.0, 7.0, 2.0]])
    mask = torch.tensor([[False, True, False, True]])      # a tool token between two policy turns
    out = returns_to_go(values, mask, 0.5)
    assert (out[0, 1].item(), out[0, 3].item()) == (1.0 + 0.5 * 2.0, 2.0)
    assert returns_to_go(values, mask, 1.0)[0, 1].item() == 3.0


def test_reinforce_pp_declares_its_discount_with_its_bounds_and_defaults_to_the_k1_estimator():
    assert RPP.defaults["kl_estimator"] == "k1"
    with pytest.raises(ConfigError, match=r"must be in \[0, 1\], got 1.5") as caught:
        ReinforcePPOptions(name="reinforce_pp", gamma=1.5)
    assert caught.value.key == "gamma"
