"""Without HSDP every replica reads the same trainer ranks, so the planner plans one replica and copies
its blocks (`planner._replicate`): the copies must be that replica's blocks, in the route order and
message numbering the general path gives, and still fill every rank of every replica exactly."""

from __future__ import annotations

import numpy as np
import pytest

from hpcrl.config.model_shapes import PRESETS
from hpcrl.plan.transfer.check import check_plan, verify_elements
from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
from hpcrl.plan.transfer.plan import COLUMNS
from hpcrl.plan.transfer.planner import plan


@pytest.mark.parametrize("preset, shard, tp, ep", [("tiny-llama", 3, 2, False), ("tiny-qwen3-moe", 2, 2, True),
                                                   ("tiny-deepseek-v3", 3, 2, False)])
def test_each_replica_gets_the_one_replica_plan_in_route_order_with_its_own_messages(preset, shard, tp, ep):
    shape = PRESETS[preset]
    trainer = TrainerLayout(dp_shard=shard, grouped_experts=ep)
    one = plan(trainer, InferenceLayout(replicas=1, tensor_parallel=tp, expert_parallel=ep), shape, bucket_bytes=1 << 12)
    three = plan(trainer, InferenceLayout(replicas=3, tensor_parallel=tp, expert_parallel=ep), shape, bucket_bytes=1 << 12)
    check_plan(three)
    verify_elements(three, shape)
    b = three.blocks
    for r in range(3):
        mine = b["replica"] == r
        for name in COLUMNS:
            if name not in ("replica", "message"):
                assert np.array_equal(b[name][mine], one.blocks[name]), (r, name)
        # The same cuts: message boundaries fall where the one replica's do.
        first = np.r_[True, b["message"][mine][1:] != b["message"][mine][:-1]]
        assert np.array_equal(first, np.r_[True, one.blocks["message"][1:] != one.blocks["message"][:-1]])
    # Sorted by route (source rank, then replica, then TP rank), messages numbered 0.. in that order.
    route = (b["src_rank"] << 24) | (b["replica"] << 12) | b["tp_rank"]
    assert np.all(np.diff(route) >= 0)
    assert b["message"][0] == 0 and np.all(np.diff(b["message"]) >= 0) and np.all(np.diff(b["message"]) <= 1)
    assert three.num_blocks == 3 * one.num_blocks and three.digest != one.digest
