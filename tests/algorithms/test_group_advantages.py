"""Group advantages against values worked out by hand (hpcrl/algorithms/terms.py)."""

from __future__ import annotations

import pytest
import torch

from hpcrl.algorithms.terms import group_advantages
from hpcrl.errors import HpcrlError


def test_mean_std_advantages_are_standardised_within_each_group_and_flag_equal_groups():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    out = group_advantages(rewards, group_size=4, norm="mean_std", eps=0.0)
    # Group 1: mean 0.5, unbiased std sqrt(1/3): +-0.5 * sqrt(3) = +-0.8660254.
    expected = torch.tensor([0.8660254, -0.8660254, -0.8660254, 0.8660254, 0, 0, 0, 0])
    torch.testing.assert_close(out.advantages, expected, atol=1e-6, rtol=0)
    assert out.zero_variance.tolist() == [False, True]


def test_mean_only_advantages_subtract_the_group_mean_and_flag_zero_variance_groups():
    rewards = torch.tensor([3.0, 1.0, 5.0, 5.0])
    out = group_advantages(rewards, group_size=2, norm="mean")
    assert out.advantages.tolist() == [1.0, -1.0, 0.0, 0.0]
    assert out.zero_variance.tolist() == [False, True]


def test_rewards_that_do_not_fill_whole_groups_are_an_error():
    with pytest.raises(HpcrlError, match="groups of 4"):
        group_advantages(torch.zeros(6), group_size=4)
