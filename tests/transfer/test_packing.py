"""Packing a round in a number of torch ops that does not grow with its blocks (hpcrl.transfer.packing),
bit-identical to the block-by-block copy every transport's wire format is defined by."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import procs
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hpcrl.errors import TransferError
from hpcrl.transfer import execute, packing

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SPEC = {"preset": "tiny-qwen2", "trainer": {"dp_shard": 3}, "inference": {"replicas": 2, "tensor_parallel": 2},
        "bucket": 8192, "round_bytes": 20000, "wire_dtype": "bfloat16"}


def sender_rounds(p, rank: int) -> list:
    return [b for b in ([m for m in batch if m.src_rank == rank] for batch in execute.schedule(p)) if b]


def receiver_rounds(p, replica: int, tp_rank: int) -> list:
    return [b for b in ([m for m in batch if m.replica == replica and m.tp_rank == tp_rank]
                        for batch in execute.schedule(p)) if b]


def packed(p, shape, rank: int, path: str, device: str = "cpu", **kw) -> list[torch.Tensor]:
    """Every round of trainer `rank`'s staging, packed by `path` from element-id shards."""
    wire = execute.TORCH_DTYPES[p.wire_dtype]
    mine = sender_rounds(p, rank)
    packer = packing.Packer(p, mine, "pack", torch.device(device), path=path, **kw)
    shards = {n: v.to(device, copy=True) for n, v in procs.id_shards(p, shape, rank).items()}  # torch's alignment
    packer.bind(execute.check_sources(p, rank, shards))
    out = []
    for k, batch in enumerate(mine):
        staging = torch.full((sum(m.numel for m in batch) + 3,), -7.0, dtype=wire, device=device)  # + 3: no overrun
        packer.run(k, staging)
        out.append(staging)
    return out


def unpacked(p, replica: int, tp_rank: int, path: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Destinations filled from seeded random staging buffers, unpacked by `path`."""
    wire = execute.TORCH_DTYPES[p.wire_dtype]
    mine = receiver_rounds(p, replica, tp_rank)
    gen = torch.Generator().manual_seed(replica * 10 + tp_rank)
    dests = {d.name: torch.full(d.local_shape, -1.0, dtype=wire, device=device) for d in p.dests}
    packer = packing.Packer(p, mine, "unpack", torch.device(device), path=path)
    packer.bind(execute.check_dests(p, replica, tp_rank, dests))
    for k, batch in enumerate(mine):
        packer.run(k, torch.randn(sum(m.numel for m in batch), generator=gen).to(device=device, dtype=wire))
    return dests


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("wire", ["bfloat16", "float32"])
def test_the_gather_path_packs_and_unpacks_every_round_bit_for_bit_as_the_block_loop(wire):
    p, shape = procs._plan(dict(SPEC, wire_dtype=wire))
    for rank in range(3):
        loop, gather = packed(p, shape, rank, "loop"), packed(p, shape, rank, "gather")
        assert len(loop) > 10 and all(same_bits(a, b) for a, b in zip(loop, gather)), rank
    for replica in range(2):
        for tp_rank in range(2):
            loop, gather = unpacked(p, replica, tp_rank, "loop"), unpacked(p, replica, tp_rank, "gather")
            assert all(same_bits(loop[n], gather[n]) for n in loop), (replica, tp_rank)
            assert all((loop[n] != -1).any() for n in loop)


def count_ops(run) -> list[str]:
    """The aten operations `run()` dispatches (views and copies alike)."""
    ops: list[str] = []

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Counting():
        run()
    return ops


def one_round_packers(bucket: int, path: str) -> tuple:
    """A trainer rank's and a receiver's packer of a one-round plan whose blocks are cut at `bucket` bytes."""
    p, shape = procs._plan(dict(SPEC, bucket=bucket, round_bytes=1 << 30))
    wire = execute.TORCH_DTYPES[p.wire_dtype]
    (send,), (recv,) = sender_rounds(p, 0), receiver_rounds(p, 0, 1)
    pack = packing.Packer(p, [send], "pack", torch.device("cpu"), path=path)
    pack.bind(execute.check_sources(p, 0, procs.id_shards(p, shape, 0)))
    unpack = packing.Packer(p, [recv], "unpack", torch.device("cpu"), path=path)
    dests = {d.name: torch.zeros(d.local_shape, dtype=wire) for d in p.dests}
    unpack.bind(execute.check_dests(p, 0, 1, dests))
    staging = torch.zeros(max(sum(m.numel for m in b) for b in (send, recv)), dtype=wire)
    blocks = (sum(m.stop - m.start for m in send), sum(m.stop - m.start for m in recv))
    for packer in (pack, unpack):
        packer.run(0, staging)  # the first sync makes the index tensors
    return blocks, (lambda: pack.run(0, staging)), (lambda: unpack.run(0, staging))


def test_torch_ops_per_packed_and_unpacked_round_do_not_grow_with_the_number_of_blocks():
    few_blocks, few_pack, few_unpack = one_round_packers(1 << 20, "gather")
    many_blocks, many_pack, many_unpack = one_round_packers(256, "gather")
    assert all(m >= 8 * f for m, f in zip(many_blocks, few_blocks)), (few_blocks, many_blocks)
    pack_ops, unpack_ops = count_ops(few_pack), count_ops(few_unpack)
    assert count_ops(many_pack) == pack_ops and count_ops(many_unpack) == unpack_ops
    # per distinct tensor: a gather, a cast to the wire dtype and a scatter (pack), a gather and a scatter (unpack)
    assert pack_ops.count("aten.index_select.default") == pack_ops.count("aten.index_put_.default") < few_blocks[0]
    assert len(unpack_ops) < 3 * few_blocks[1]
    # the block loop, by contrast: its ops grow with the blocks
    _, loop_pack, _ = one_round_packers(256, "loop")
    assert len(count_ops(loop_pack)) >= many_blocks[0]


def test_gather_indices_are_int32_at_8_bytes_per_element_and_made_once_per_plan(monkeypatch):
    monkeypatch.setenv("HPCRL_PACKING", "gather")
    p, shape = procs._plan(SPEC)
    execute._PACKERS.clear()
    mine = sender_rounds(p, 1)
    first = execute.packer(p, mine, "pack", ("trainer", 1), torch.device("cpu"))
    assert execute.packer(p, mine, "pack", ("trainer", 1), torch.device("cpu")) is first
    first.bind(execute.check_sources(p, 1, procs.id_shards(p, shape, 1)))
    staging = torch.empty(max(sum(m.numel for m in b) for b in mine), dtype=torch.bfloat16)
    for k in range(len(mine)):
        first.run(k, staging)
    elements = sum(m.numel for b in mine for m in b)
    assert {first.path_of(k) for k in range(len(mine))} == {"gather"}
    assert first.index_bytes == 8 * elements
    other, _ = procs._plan(dict(SPEC, bucket=4096))
    execute.packer(other, sender_rounds(other, 1), "pack", ("trainer", 1), torch.device("cpu"))
    assert len(execute._PACKERS) == 1  # a new plan drops the old plan's indices


def test_rounds_past_the_index_budget_copy_block_by_block_and_say_so(caplog):
    p, shape = procs._plan(SPEC)
    mine = sender_rounds(p, 0)
    budget = 8 * sum(m.numel for m in mine[0]) + 1  # room for the first round only
    with caplog.at_level(logging.INFO, logger="hpcrl.transfer.packing"):
        got = packed(p, shape, 0, "gather", index_budget_bytes=budget)
    said = [r.getMessage() for r in caplog.records if "index budget" in r.getMessage()]
    assert len(said) == 1 and "round 1's gather indices" in said[0], said
    assert all(same_bits(a, b) for a, b in zip(got, packed(p, shape, 0, "loop")))
    packer = packing.Packer(p, mine, "pack", torch.device("cpu"), path="gather", index_budget_bytes=budget)
    assert [packer.path_of(k) for k in range(3)] == ["gather", "loop", "loop"]


def test_the_cpu_packs_block_by_block_unless_told_and_a_wrong_hpcrl_packing_is_named(monkeypatch):
    """On CPU a strided copy per block costs microseconds and index ops cost more (BENCHMARKS.md)."""
    p, _ = procs._plan(SPEC)
    mine = sender_rounds(p, 0)
    assert packing.Packer(p, mine, "pack", torch.device("cpu")).path_of(0) == "loop"
    monkeypatch.setenv("HPCRL_PACKING", "fastest")
    with pytest.raises(TransferError, match="HPCRL_PACKING='fastest' is not a packing path; set one of loop, gather"):
        execute.packer(p, mine, "pack", ("trainer", 0), torch.device("cpu"))


def test_an_unknown_path_or_triton_without_cuda_is_refused_naming_the_choices():
    p, _ = procs._plan(SPEC)
    with pytest.raises(ValueError, match="choose one of loop, gather, triton"):
        packing.Packer(p, [], "pack", torch.device("cpu"), path="fast")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="needs Triton and CUDA tensors"):
            packing.Packer(p, [], "pack", torch.device("cpu"), path="triton")


TRITON_CHECK = """
import sys, torch
sys.path.insert(0, {tests!r})
import test_packing as t, procs
p, shape = procs._plan(dict(t.SPEC, wire_dtype="float32"))
for rank in range(3):
    assert all(t.same_bits(a, b) for a, b in zip(t.packed(p, shape, rank, "loop"), t.packed(p, shape, rank, "triton")))
aligned = dict(t.SPEC, preset="tiny-llama", trainer={{"dp_shard": 2}}, wire_dtype="float32")
p, shape = procs._plan(aligned)  # every run a multiple of 8 elements: the kernel's 16-byte variant
assert all(t.same_bits(a, b) for a, b in zip(t.packed(p, shape, 0, "loop"), t.packed(p, shape, 0, "triton")))
packer = t.packing.Packer(p, t.sender_rounds(p, 0), "pack", torch.device("cpu"), path="triton")
shards = {{n: v.clone() for n, v in procs.id_shards(p, shape, 0).items()}}  # torch's 64-byte alignment, not numpy's
packer.bind(t.execute.check_sources(p, 0, shards))
assert packer.aligned and packer._round(0).aligned
p, shape = procs._plan(t.SPEC)
for replica, tp_rank in [(0, 0), (1, 1)]:
    loop, tri = t.unpacked(p, replica, tp_rank, "loop"), t.unpacked(p, replica, tp_rank, "triton")
    assert all(t.same_bits(loop[n], tri[n]) for n in loop)
print("triton ok")
"""


@pytest.mark.timeout(300)
def test_the_triton_kernel_moves_the_bytes_of_the_block_loop_in_the_interpreter():
    """The one-launch CUDA kernel, run on CPU tensors by Triton's interpreter. Packing is checked
    with a float32 wire: the interpreter casts float32 -> bf16 by truncation where the compiled
    kernel (and torch) round to nearest even, so the cast itself is checked on a GPU
    (tools/bench/bench_pack.py compares every path's bytes there)."""
    pytest.importorskip("triton")
    tests = str(Path(__file__).parent)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), tests]))
    out = subprocess.run([sys.executable, "-c", TRITON_CHECK.format(tests=tests)], env=env, capture_output=True,
                         text=True, timeout=280)
    assert out.returncode == 0 and "triton ok" in out.stdout, out.stderr[-3000:]


class RecordingLink:
    """A transfer link on CPU that records what the sender does, in order, and what each send
    held when it was waited for (a buffer packed over before its send completed would show)."""

    def __init__(self, device: str = "cpu"):
        self.device = torch.device(device)
        self.events: list[str] = []
        self.sent: dict[int, torch.Tensor] = {}
        self.rounds = 0

    @contextlib.contextmanager
    def round(self, timeout):
        yield
        self.events.append(f"issued {self.rounds}")
        self.rounds += 1

    def isend(self, buf, dst, tag):
        return (tag, buf, self.rounds)

    def wait(self, handle, timeout):
        tag, buf, k = handle
        if f"waited {k}" not in self.events:
            self.events.append(f"waited {k}")
        self.sent[tag] = buf.clone()
        if self.device.type == "cuda":  # as NCCL's wait: the round's operations are done when it returns
            torch.cuda.current_stream(self.device).synchronize()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_the_sender_packs_the_next_round_while_a_round_is_on_the_wire_and_sends_the_loops_bytes(device, monkeypatch):
    """On CUDA the packing runs on a side stream the sends wait on (execute.send)."""
    p, shape = procs._plan(SPEC)
    execute._PACKERS.clear()
    run = packing.Packer.run
    link = RecordingLink(device)

    def recording(self, k, staging):
        link.events.append(f"packed {k}")
        run(self, k, staging)

    monkeypatch.setattr(packing.Packer, "run", recording)
    if device == "cpu":
        monkeypatch.setenv("HPCRL_PACKING", "gather")
    sources = execute.check_sources(p, 0, {n: v.to(device, copy=True) for n, v in procs.id_shards(p, shape, 0).items()})
    execute.send(link, p, 0, sources, timeout_s=5)
    rounds = len(sender_rounds(p, 0))
    assert rounds > 3 and link.events[:5] == ["packed 0", "issued 0", "packed 1", "waited 0", "issued 1"]
    assert link.events[-2:] == [f"issued {rounds - 1}", f"waited {rounds - 1}"]
    monkeypatch.setattr(packing.Packer, "run", run)
    expected = [m for batch in sender_rounds(p, 0) for m in batch]
    for m in expected:
        want = torch.empty(m.numel, dtype=torch.bfloat16, device=device)
        execute.pack(p, m, sources, want)
        assert same_bits(link.sent[m.id], want), m


@CUDA
@pytest.mark.parametrize("preset, dp_shard", [("tiny-qwen2", 3), ("tiny-llama", 2)], ids=["unaligned", "aligned"])
def test_on_cuda_every_path_packs_and_unpacks_bit_for_bit_as_the_block_loop(preset, dp_shard):
    """bf16 wire from float32 shards: the compiled Triton kernel's cast rounds as torch's copy_ does;
    tiny-llama at FSDP 2 takes the kernel's 16-byte variant, tiny-qwen2 at FSDP 3 the other."""
    assert packing.triton_works(torch.device("cuda", 0))
    p, shape = procs._plan(dict(SPEC, preset=preset, trainer={"dp_shard": dp_shard}))
    for rank in range(dp_shard):
        loop = packed(p, shape, rank, "loop", "cuda")
        for path in ("gather", "triton"):
            assert all(same_bits(a, b) for a, b in zip(loop, packed(p, shape, rank, path, "cuda"))), (rank, path)
    for tp_rank in range(2):
        loop = unpacked(p, 0, tp_rank, "loop", "cuda")
        for path in ("gather", "triton"):
            other = unpacked(p, 0, tp_rank, path, "cuda")
            assert all(same_bits(loop[n], other[n]) for n in loop), (tp_rank, path)
