"""reward.functions in the loop: each function's mean is a per-step metric (reward_mean/NAME)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)
def test_each_functions_mean_is_reported_per_step_beside_the_weighted_mean(monkeypatch, tmp_path):
    """The real controller and loop over the in-memory groups of tests/rl (fake_ports.py)."""
    monkeypatch.syspath_prepend(str(REPO / "tests" / "rl"))
    from fake_config import fake_config
    from fake_ports import FakePorts, FakeReward

    from hpcrl.rl.loop import run_loop
    from hpcrl.rl.metrics import read_metrics

    class TwoParts(FakeReward):
        """exact_match weighted 2 plus a constant 1 weighted 0.5, as a combined pool reports them."""

        def score(self, samples):
            return [dataclasses.replace(r, reward=2 * r.reward + 0.5, parts={"exact": r.reward, "always": 1.0})
                    for r in super().score(samples)]

    config = fake_config(tmp_path, run_name="parts", seed=3, steps=3, prompts_per_step=3, group_size=4, interval=0,
                         replicas=1, trainer_nodes=1, max_policy_lag=1)
    asyncio.run(run_loop(config, FakePorts(reward=TwoParts())))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["reward_mean/always"] == 1.0
        assert row["reward_mean"] == pytest.approx(2 * row["reward_mean/exact"] + 0.5)
