"""The transfer schedule (hpcrl.plan.transfer.rounds): properties every transport relies on, for every
shipped config and for random plans (hypothesis)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcrl.config import load_config
from hpcrl.config.model_shapes import PRESETS
from hpcrl.plan.for_config import plan_for_config
from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
from hpcrl.plan.transfer.plan import TransferPlan
from hpcrl.plan.transfer.planner import plan as make_plan
from hpcrl.plan.transfer.rounds import messages, receiver_rank, rounds

REPO = Path(__file__).resolve().parents[2]


def check_schedule(plan: TransferPlan, round_bytes: int) -> list[list]:
    """Assert every property of the schedule of `plan`; return it."""
    schedule = rounds(plan, round_bytes)
    every = messages(plan)
    # every message in exactly one round, rounds in plan order: the order of every (sender, receiver)
    # pair is kept (rounds are contiguous runs of plan order)
    assert [m for batch in schedule for m in batch] == every
    assert all(batch for batch in schedule)
    # both ends derive the same rounds: a pure function of the plan (here: of an equal plan)
    again = dataclasses.replace(plan, blocks={k: v.copy() for k, v in plan.blocks.items()})
    assert rounds(again, round_bytes) == schedule
    for batch in schedule:
        staged: dict[int, list[int]] = defaultdict(list)
        for m in batch:
            for rank in (m.src_rank, receiver_rank(plan, m)):
                staged[rank].append(m.numel * plan.itemsize)
        for sizes in staged.values():
            # within round_bytes, unless one message alone is larger, and then it is alone for that rank
            assert sum(sizes) <= round_bytes or len(sizes) == 1, (sizes, round_bytes)
    return schedule


CONFIGS = sorted((REPO / "configs").glob("*.toml"))
#: Above this many messages a plan's schedule is checked at its config's own round size only: Kimi-K2's
#: 742,656 messages (configs/kimi-k2_grpo.toml) take about 20 s a check on 2 cores, and the schedule's
#: code is the same at every size (the 70B's 34,560 messages and the random plans below try the rest).
LARGE_PLAN_MESSAGES = 100_000


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_the_schedule_of_every_shipped_config_keeps_every_property(path: Path):
    config = load_config(path)
    plan = plan_for_config(config)
    assert plan.round_bytes == config.inference.transfer_round_mib << 20
    sizes = [plan.round_bytes] if len(messages(plan)) > LARGE_PLAN_MESSAGES else [1 << 20, 64 << 20, 256 << 20]
    for round_bytes in sizes:
        schedule = check_schedule(plan, round_bytes)
        if round_bytes == 1 << 20 and len(messages(plan)) > 1:  # the GPU configs' 16 MiB messages: many rounds
            assert len(schedule) > len(messages(plan)) // 2


@pytest.mark.parametrize("round_mib", [1, 64, 256])
def test_the_round_size_a_config_sets_is_the_plans(round_mib: int):
    config = load_config(REPO / "configs" / "tiny_grpo.toml", overrides=[f"inference.transfer_round_mib={round_mib}"])
    assert plan_for_config(config).round_bytes == round_mib << 20


@settings(max_examples=60, deadline=None)
@given(preset=st.sampled_from(["tiny-llama", "tiny-qwen2"]), shard=st.integers(1, 4), replicate=st.integers(1, 2),
       replicas=st.integers(1, 3), tp=st.sampled_from([1, 2]), bucket=st.integers(64, 1 << 16),
       round_bytes=st.integers(1, 1 << 18))
def test_the_schedule_of_a_random_plan_keeps_every_property(preset, shard, replicate, replicas, tp, bucket,
                                                            round_bytes):
    plan = make_plan(TrainerLayout(dp_replicate=replicate, dp_shard=shard),
                     InferenceLayout(replicas=replicas, tensor_parallel=tp), PRESETS[preset], bucket_bytes=bucket)
    check_schedule(plan, round_bytes)


def test_a_message_larger_than_a_round_goes_alone_for_its_ranks_and_the_next_starts_a_new_round():
    plan = make_plan(TrainerLayout(dp_replicate=1, dp_shard=1), InferenceLayout(replicas=1,
                     tensor_parallel=1), PRESETS["tiny-llama"], bucket_bytes=1 << 30)
    (only,) = messages(plan)  # one rank to one rank, one big message
    assert rounds(plan, 1) == [[only]]
    small = make_plan(TrainerLayout(dp_replicate=1, dp_shard=1), InferenceLayout(replicas=1,
                      tensor_parallel=1), PRESETS["tiny-llama"], bucket_bytes=1 << 12)
    assert len(rounds(small, 1)) == len(messages(small))  # every message over 1 byte: one round each


def test_a_round_size_below_one_byte_is_refused():
    with pytest.raises(ValueError, match="round_bytes must be at least 1"):
        rounds(plan_for_config(load_config(REPO / "configs" / "tiny_grpo.toml")), 0)
