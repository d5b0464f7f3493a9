"""DAPO's dynamic sampling in the real controller over the in-memory groups (fake_ports.py): rounds of
more prompts refill the filtered groups, with seeds fixed by (batch, round), and a resume repeats them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch  # noqa: F401  the algorithm's advantages need it: imported at collection, not in a test
from fake_config import fake_config
from fake_ports import FakePorts

from hpcrl.config.schema import Config
from hpcrl.rl.controller import ROUND_SEED_STRIDE
from hpcrl.rl.loop import run_loop
from hpcrl.rl.metrics import read_metrics

STEPS, PROMPTS_PER_STEP, GROUP_SIZE, SEED, ROUNDS = 5, 4, 4, 3, 3


def config_for(run_dir: Path) -> Config:
    return fake_config(run_dir, run_name="fake-dapo", seed=SEED, steps=STEPS, prompts_per_step=PROMPTS_PER_STEP,
                       group_size=GROUP_SIZE, **{"name": "dapo", "max_policy_lag": 1, "filter_zero_variance": True,
                          "dynamic_sampling": True, "max_sampling_rounds": ROUNDS})


def loop_once(config: Config, ports: FakePorts, **kwargs) -> None:
    asyncio.run(asyncio.wait_for(run_loop(config, ports, **kwargs), 10.0))


def outcome(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not (k.startswith(("time_", "startup_")) or k.endswith("_per_s"))}
            for row in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> tuple[FakePorts, Path]:
    run_dir = tmp_path_factory.mktemp("dapo-whole")
    ports = FakePorts()
    loop_once(config_for(run_dir), ports)
    return ports, run_dir


def test_each_batch_is_refilled_with_more_prompts_until_enough_groups_have_a_signal(whole):
    ports, run_dir = whole
    rows = read_metrics(run_dir)
    assert any(r["sampling_rounds"] > 1 for r in rows), "the fake policy gave every batch enough signal at once"
    for row in rows:
        trained_groups = len(ports.trainer.trained.get(row["step"] - 1, [])) // GROUP_SIZE
        with_signal = row["groups"] - row["groups_dropped_zero_variance"]
        # The first PROMPTS_PER_STEP groups with a signal train; fewer only once the rounds ran out.
        assert trained_groups == min(with_signal, PROMPTS_PER_STEP)
        assert row["sampling_rounds"] == ROUNDS or with_signal >= PROMPTS_PER_STEP


def test_round_r_of_batch_b_samples_with_the_seed_of_b_plus_r_strides(whole):
    ports, run_dir = whole
    seeds = [event[1] for event in ports.events if event[0] == "generate"]
    expected = [SEED * 1_000_003 + batch + r * ROUND_SEED_STRIDE
                for batch, row in enumerate(read_metrics(run_dir)) for r in range(row["sampling_rounds"])]
    assert seeds == expected


def test_a_resumed_dynamic_sampling_run_equals_an_uninterrupted_one(whole, tmp_path: Path):
    ports, run_dir = whole
    config = config_for(tmp_path)
    loop_once(config, FakePorts(), steps=2)
    second = FakePorts()
    loop_once(config, second)
    assert outcome(tmp_path) == outcome(run_dir)
    assert second.trainer.weights == ports.trainer.weights
