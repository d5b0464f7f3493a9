"""The loop with partial rollouts on (algorithm.partial_rollouts), over the in-memory groups of fake_ports.py: each
rollout spans several batches' generations, every token trained on within max_policy_lag of the trainer, and a run
resumed from a checkpoint taken while sequences were half made equals an uninterrupted one."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
from fake_config import fake_config
from fake_ports import FakePorts

from hpcrl.rl.loop import run_loop
from hpcrl.rl.metrics import read_metrics

STEPS, LAG, TOKENS = 8, 3, 3


def config_for(run_dir: Path, *, interval: int = 0):
    config = fake_config(run_dir, run_name="partial", seed=5, steps=STEPS, prompts_per_step=2, group_size=4,
                         interval=interval, max_policy_lag=LAG, partial_rollouts=True, partial_tokens=1)
    # every completion is TOKENS digits (the fake model never stops on its own): TOKENS windows of one token each
    return dataclasses.replace(config, inference=dataclasses.replace(config.inference, max_tokens=TOKENS))


def loop(config, ports, **kwargs) -> None:
    asyncio.run(asyncio.wait_for(run_loop(config, ports, **kwargs), 20.0))


def outcome(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not (k.startswith(("time_", "startup_")) or k.endswith("_per_s"))}
            for row in read_metrics(run_dir)]


@pytest.mark.timeout(60)
def test_partial_rollouts_span_windows_train_within_the_lag_and_resume_from_a_checkpoint_unchanged(tmp_path):
    whole = FakePorts()
    loop(config_for(tmp_path / "whole"), whole)
    rows = read_metrics(tmp_path / "whole")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # a group's members finish in its third window (one token each): the first batches are empty, then 2 groups a
    # window, each group's oldest token TOKENS versions behind the step that trains it (the bound is LAG = 3)
    assert [r["partial_groups_finished"] for r in rows] == [0] * (TOKENS - 1) + [2] * (STEPS - TOKENS + 1)
    assert [r["partial_carried"] for r in rows] == [8 * min(k + 1, TOKENS - 1) for k in range(STEPS)]
    assert all(r["token_lag_max"] in (None, TOKENS - 1, TOKENS) and r["partial_groups_dropped_stale"] == 0
               for r in rows)
    assert [r["partial_idle_share"] for r in rows] == [0.0] * STEPS  # every sequence makes its one token a window
    trained = whole.trainer.batches[STEPS - 1]
    for ids, mask, logprobs in zip(trained["input_ids"], trained["policy_mask"], trained["logprobs"]):
        assert len(ids) == len(mask) and sum(mask) == TOKENS and all(lp < 0 for lp, m in zip(logprobs, mask) if m)

    # the same run stopped after step 4 (sequences half made are in the checkpoint) and resumed by a new job
    config = config_for(tmp_path / "resumed", interval=2)
    loop(config, FakePorts(), steps=4)
    second = FakePorts()
    loop(config, second)
    assert outcome(tmp_path / "resumed") == outcome(tmp_path / "whole")
    assert (second.trainer.version, second.trainer.weights) == (whole.trainer.version, whole.trainer.weights)


@pytest.mark.timeout(60)
def test_with_partial_rollouts_off_the_loop_is_the_default_one(tmp_path):
    """The key's default: no partial_* metric, and the same figures as a config that never heard of it."""
    on = config_for(tmp_path / "x")
    off = dataclasses.replace(on, algorithm=dataclasses.replace(on.algorithm, partial_rollouts=False),
                              run=dataclasses.replace(on.run, run_dir=str(tmp_path / "off")))
    default = fake_config(tmp_path / "default", run_name="partial", seed=5, steps=STEPS, prompts_per_step=2,
                          group_size=4, max_policy_lag=LAG)
    default = dataclasses.replace(default, inference=dataclasses.replace(default.inference, max_tokens=TOKENS))
    loop(off, FakePorts())
    loop(default, FakePorts())
    assert outcome(tmp_path / "off") == outcome(tmp_path / "default")
    assert not any(k.startswith("partial_") or k == "token_lag_max" for r in read_metrics(tmp_path / "off") for k in r)
