"""The resharding planner on meta shapes: element-exact against vLLM's loader rules, byte-minimal,
fast at 70B, and a checker that catches corrupted plans."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from hpcrl.config.model_shapes import PRESETS, ModelShape
from hpcrl.errors import PlanError
from hpcrl.plan.transfer.check import check_plan, verify_elements
from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout, chunk_rows, chunk_source_rows, pad_vocab_size
from hpcrl.plan.transfer.planner import plan

LLAMA, QWEN2 = PRESETS["tiny-llama"], PRESETS["tiny-qwen2"]


def make(shape: ModelShape, *, shard=1, replicate=1, replicas=1, tp=1, bucket=1 << 20):
    p = plan(TrainerLayout(dp_replicate=replicate, dp_shard=shard),
             InferenceLayout(replicas=replicas, tensor_parallel=tp), shape, bucket_bytes=bucket)
    check_plan(p)
    verify_elements(p, shape)
    return p


def test_chunk_rows_follows_torch_chunk_with_short_and_empty_tail_chunks():
    torch = pytest.importorskip("torch")
    for rows, parts in ((3, 2), (10, 3), (5, 4), (128, 100), (7, 7), (1, 3)):
        want = [c.shape[0] for c in torch.arange(rows).chunk(parts)]
        want += [0] * (parts - len(want))
        assert [e - a for a, e in chunk_rows(rows, parts)] == want


@pytest.mark.parametrize("shape", [LLAMA, QWEN2], ids=["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("shard", [1, 2, 3])
@pytest.mark.parametrize("tp", [1, 2])
def test_plan_fills_every_vllm_rank_exactly_as_vllm_weight_loaders_do(shape, shard, tp):
    p = make(shape, shard=shard, tp=tp)
    assert p.stats().ratio() == 1.0


def test_kv_heads_are_replicated_when_tensor_parallel_exceeds_kv_heads():
    p = make(LLAMA, shard=3, tp=4)  # 2 KV heads, TP 4: each KV head on two ranks
    qkv = next(d for d in p.dests if d.name.endswith("0.self_attn.qkv_proj.weight"))
    assert qkv.local_shape == ((1 + 2 * 1) * 32, 128)  # 1 q head, 1 k head, 1 v head per rank
    assert p.stats().ratio() == 1.0


def test_vocab_not_a_multiple_of_tp_times_64_leaves_padding_unwritten():
    shape = dataclasses.replace(LLAMA, vocab_size=200)  # padded to 256; TP 4: 64 rows each, last 8 real
    p = make(shape, shard=3, tp=4)
    embed = p.dests[0]
    assert pad_vocab_size(200) == 256 and embed.real_rows == (64, 64, 64, 8)
    assert p.stats().minimum_per_tp_rank[3] < p.stats().minimum_per_tp_rank[0]


def test_fsdp_size_not_dividing_dim0_and_empty_chunks_are_planned():
    p = make(LLAMA, shard=100)  # norms of 128 rows: chunks of 2, ranks 64..99 hold nothing of them
    norm = next(s for s in p.sources if s.name == "model.norm.weight")
    held = [end - start for start, end in chunk_source_rows(norm.shape[0], 100, norm.shard_rows)]  # as FSDP2 holds it
    assert held[99] == 0 and held[0] == 2
    assert p.stats().ratio() == 1.0


def test_hsdp_feeds_replicas_from_different_trainer_ranks_each_sending_its_share():
    p = make(QWEN2, replicate=2, shard=3, replicas=4, tp=2)
    b = p.blocks
    for replica in range(4):
        for tp_rank in range(2):
            groups = set(b["src_rank"][(b["replica"] == replica) & (b["tp_rank"] == tp_rank)] // 3)
            assert groups == {(replica + tp_rank) % 2}
    sent = p.stats().sent_per_trainer_rank
    assert sent[:3] == sent[3:]  # both replicate groups carry the same load


def test_tied_embeddings_have_one_destination_and_one_source():
    p = make(QWEN2, shard=2, tp=2)
    assert not any(d.name == "lm_head.weight" for d in p.dests)
    assert not any(s.name == "lm_head.weight" for s in p.sources)


def test_messages_hold_at_most_bucket_bytes_plus_one_row():
    p = make(LLAMA, shard=2, tp=2, bucket=4096)
    b = p.blocks
    sizes = np.bincount(b["message"], weights=b["length"] * b["count"] * p.itemsize)
    row = np.bincount(b["message"], weights=np.where(b["count"] > 1, b["length"], 1) * p.itemsize)
    assert sizes.max() <= 4096 + row.max() and p.stats().messages == len(sizes)


def test_digest_is_stable_and_changes_with_any_layout():
    a, b = make(LLAMA, shard=2, tp=2), make(LLAMA, shard=2, tp=2)
    assert a.digest == b.digest
    assert a.digest != make(LLAMA, shard=3, tp=2).digest
    assert a.digest != make(LLAMA, shard=2, tp=2, bucket=4096).digest


def corrupted(p, **columns):
    blocks = {k: v.copy() for k, v in p.blocks.items()}
    for name, fn in columns.items():
        blocks[name] = fn(blocks[name])
    return dataclasses.replace(p, blocks=blocks)


@pytest.mark.parametrize("how, message", [
    ("drop", "unwritten"), ("duplicate", "twice"), ("shift_dst", "twice|unwritten"),
    ("src_past_shard", "outside the sender's local shard"), ("into_padding", "padding"),
])
def test_checker_rejects_a_deliberately_corrupted_plan(how, message):
    p = make(QWEN2, shard=3, tp=2)
    b = p.blocks
    if how == "drop":
        bad = dataclasses.replace(p, blocks={k: np.delete(v, 5) for k, v in b.items()})
    elif how == "duplicate":
        bad = dataclasses.replace(p, blocks={k: np.insert(v, 5, v[5]) for k, v in b.items()})
    elif how == "shift_dst":
        bad = corrupted(p, dst_offset=lambda x: x + (np.arange(len(x)) == 7))
    elif how == "src_past_shard":
        bad = corrupted(p, src_offset=lambda x: x + 10**6 * (np.arange(len(x)) == 3))
    else:  # the last embedding block of TP rank 1 grows into vLLM's zero padding
        p = make(QWEN2, shard=1, tp=2)
        b = p.blocks
        i = int(np.nonzero((b["dest"] == 0) & (b["tp_rank"] == 1))[0][-1])
        bad = corrupted(p, length=lambda x: x + 128 * (np.arange(len(x)) == i),
                        src_offset=lambda x: x - 128 * (np.arange(len(x)) == i),
                        src_stride=lambda x: x + 128 * (np.arange(len(x)) == i),
                        dst_stride=lambda x: x + 128 * (np.arange(len(x)) == i))
    with pytest.raises(PlanError, match=message):
        check_plan(bad)


def test_verification_catches_a_plan_that_writes_the_wrong_elements():
    p = make(LLAMA, shard=2, tp=2)
    b = p.blocks
    i = int(np.nonzero(b["src_offset"] > 0)[0][0])  # read one element early: in bounds, but wrong
    swapped = corrupted(p, src_offset=lambda x: x - 1 * (np.arange(len(x)) == i))
    with pytest.raises(PlanError, match="expected id"):
        verify_elements(swapped, LLAMA)


def test_a_tensor_parallel_size_vllm_cannot_use_is_a_plan_error():
    with pytest.raises(PlanError, match="num_heads"):
        plan(TrainerLayout(), InferenceLayout(tensor_parallel=3), LLAMA)


def test_llama3_70b_fsdp64_to_4_replicas_tp8_plans_and_checks_under_one_second_at_one_x():
    shape = PRESETS["llama3-70b"]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        p = plan(TrainerLayout(dp_shard=64), InferenceLayout(replicas=4, tensor_parallel=8), shape)
        best = min(best, time.perf_counter() - t0)
    assert best < 1.0, f"planning took {best:.2f} s"
    check_plan(p)
    stats = p.stats()
    assert stats.ratio() == 1.0
    assert sum(stats.received_per_inference_rank) == 4 * sum(stats.minimum_per_tp_rank)
