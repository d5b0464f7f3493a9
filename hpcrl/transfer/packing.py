"""Packing and unpacking a whole round of a transfer plan in a number of operations that does not
grow with its blocks.

A round's staging buffer is the round's messages one after the other, each message its blocks one
after the other, each block `count` runs of `length` elements read at `offset + row * stride` of a
tensor's flat view (pack / unpack below copy them block by block: one strided copy, one
kernel launch or more, per block; ~22 us each on an H200, so a round of hundreds of blocks is
launch-bound). Three ways to move the same bytes, to the same places:

  "loop"    pack / unpack per message: one strided copy per block (the reference).
  "gather"  torch only, any device: per tensor of the round one gather and one scatter through
            element index tensors made once per plan (with the cast to the wire dtype between
            them), so ops per round = 2-3 x distinct tensors, whatever the number of blocks.
  "triton"  CUDA: one Triton kernel per round over a table of tiles (a tile: up to TILE elements
            of one block: tensor, offset, stride, run length, staging position), with the cast
            fused into the copy; tensors are reached through a table of their element offsets
            from one of them, made once per send or receive (packing_triton.py).

Memory, per (plan, side, rank), made on the first sync and cached (the plan is fixed for a run):
  - "triton": 7 int64 per tile of up to TILE = 4096 elements: <= 56 bytes per 8 KiB of bf16 wire
    (0.7 %) for long blocks, and 56 bytes per block for short ones (a 1-D norm weight: one tile).
  - "gather": two index tensors per element moved, int32 where every index fits (8 bytes per
    element: 4x a bf16 wire element), int64 otherwise (16 bytes). Only rounds whose indices fit
    in `index_budget_bytes` (all rounds of the rank together, default 1 GiB) take it; the others
    fall back to "loop", said once in the log. Index tensors per block row, expanded by stride
    arithmetic at each call, would need as much memory transiently and a dozen more passes.

`Packer` chooses: "triton" for CUDA tensors when Triton imports and its kernel passes a self-check,
"gather" (within the budget) on another accelerator, "loop" on CPU, where a strided copy costs a
few microseconds a block and index ops cost more than the launches they save (tools/bench/bench_pack.py,
BENCHMARKS.md). HPCRL_PACKING=loop|gather|triton forces one (A/B runs; the transfer tests run the
transports through each). Every path writes the bytes of the loop path, bit for bit.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from hpcrl.plan.transfer.plan import TransferPlan
from hpcrl.plan.transfer.rounds import Message

log = logging.getLogger(__name__)

PATHS = ("loop", "gather", "triton")
DEFAULT_INDEX_BUDGET_BYTES = 1 << 30
TILE = 4096
"""Elements per Triton program: one 16 KiB read of float32 and one 8 KiB write of bf16 per tile."""

_COLUMNS = {"pack": ("source", "src_offset", "src_stride"), "unpack": ("dest", "dst_offset", "dst_stride")}


@dataclass(frozen=True)
class RoundBlocks:
    """A round's blocks in staging order, as numpy columns (int64): the input of every index form."""

    tensor: np.ndarray
    """Plan source (pack) or dest (unpack) index of each block."""
    offset: np.ndarray
    stride: np.ndarray
    length: np.ndarray
    count: np.ndarray
    position: np.ndarray
    """First staging element of each block within the round."""

    @property
    def numel(self) -> int:
        return int((self.length * self.count).sum())


def round_blocks(plan: TransferPlan, batch: list[Message], direction: str) -> RoundBlocks:
    """The blocks of `batch` (one rank's messages of a round, in schedule order) with their staging positions."""
    b = plan.blocks
    idx = np.concatenate([np.arange(m.start, m.stop) for m in batch]) if batch else np.zeros(0, np.int64)
    tensor, offset, stride = (b[c][idx].astype(np.int64) for c in _COLUMNS[direction])
    length, count = b["length"][idx].astype(np.int64), b["count"][idx].astype(np.int64)
    sizes = length * count
    position = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if len(idx) else sizes
    return RoundBlocks(tensor=tensor, offset=offset, stride=stride, length=length, count=count, position=position)


@dataclass
class GatherIndex:
    """Per distinct tensor of a round (first-use order): its flat indices and their staging positions."""

    tensors: list[int]
    tensor_index: list[torch.Tensor]
    staging_index: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.tensor_index, *self.staging_index))


def gather_index_bytes(rb: RoundBlocks) -> int:
    """What `gather_index(rb)` will hold, before making it (int32 where the indices fit)."""
    n = rb.numel
    if not n:
        return 0
    top = max(int((rb.offset + (rb.count - 1) * rb.stride + rb.length).max()), n)
    return 2 * n * (4 if top < 2**31 else 8)


def gather_index(rb: RoundBlocks, device: torch.device) -> GatherIndex:
    """Index tensors of every element of the round, per tensor, staging order within each tensor.

    Made on `device`, block by block, into tensors of their final dtype (a block's indices: offset
    + row * stride + col): no more than one block of int64 besides the result at any time, and on
    a GPU in well under a second for a 1B model's rounds.
    """
    dtype = torch.int32 if gather_index_bytes(rb) <= 8 * rb.numel else torch.int64
    sizes = rb.length * rb.count
    tensors = list(dict.fromkeys(rb.tensor.tolist()))
    slot = {t: i for i, t in enumerate(tensors)}
    totals = np.zeros(len(tensors), np.int64)
    np.add.at(totals, [slot[t] for t in rb.tensor.tolist()], sizes)
    flat = [torch.empty(int(n), dtype=dtype, device=device) for n in totals]
    position = [torch.empty(int(n), dtype=dtype, device=device) for n in totals]
    filled = [0] * len(tensors)
    for t, off, stride, length, count, pos, n in zip(rb.tensor.tolist(), rb.offset.tolist(), rb.stride.tolist(),
                                                      rb.length.tolist(), rb.count.tolist(), rb.position.tolist(),
                                                      sizes.tolist()):
        i, at = slot[t], filled[slot[t]]
        rows = torch.arange(count, dtype=torch.int64, device=device).mul_(stride).add_(off)
        cols = torch.arange(length, dtype=torch.int64, device=device)
        flat[i][at:at + n].view(count, length).copy_(rows[:, None] + cols[None, :])
        torch.arange(pos, pos + n, out=position[i][at:at + n])
        filled[i] += n
    return GatherIndex(tensors=tensors, tensor_index=flat, staging_index=position)


def gather_pack(gi: GatherIndex, sources: list[torch.Tensor | None], out: torch.Tensor) -> None:
    """out[staging] = source[flat] per tensor: one gather, one cast (if the dtypes differ), one scatter."""
    for t, ti, si in zip(gi.tensors, gi.tensor_index, gi.staging_index):
        src = sources[t]
        assert src is not None, f"plan source {t} is in this rank's round but was not checked"
        out.index_put_((si,), src.index_select(0, ti).to(out.dtype))


def gather_unpack(gi: GatherIndex, buf: torch.Tensor, dests: list[torch.Tensor]) -> None:
    """dest[flat] = staging[position] per tensor: one gather, one scatter."""
    for t, ti, si in zip(gi.tensors, gi.tensor_index, gi.staging_index):
        dests[t].index_put_((ti,), buf.index_select(0, si))


def tile_table(rb: RoundBlocks) -> tuple[np.ndarray, bool]:
    """[tiles, 7] int64: (tensor, offset, stride, length, staging position, first element, elements) per
    tile, and whether all of them are multiples of 8 elements (the kernel's 16-byte loads and stores).

    A contiguous block (one row, or rows that follow each other) gets stride == length: the kernel
    then skips dividing element numbers into rows.
    """
    sizes = rb.length * rb.count
    if len(sizes) and int(sizes.max()) >= 2**31:
        raise ValueError(f"a block of {int(sizes.max())} elements is too large for the 'triton' path (< 2**31)")
    stride = np.where((rb.count == 1) | (rb.stride == rb.length), rb.length, rb.stride)
    tiles = -(-sizes // TILE)
    block = np.repeat(np.arange(len(sizes)), tiles)
    first = (np.arange(int(tiles.sum())) - np.repeat(np.cumsum(tiles) - tiles, tiles)) * TILE
    n = np.minimum(TILE, sizes[block] - first)
    table = np.stack([rb.tensor[block], rb.offset[block], stride[block], rb.length[block], rb.position[block],
                      first, n], axis=1).astype(np.int64)
    return table, bool((table[:, 1:] % 8 == 0).all())


@functools.cache
def triton_available() -> bool:
    try:
        from hpcrl.transfer import packing_triton  # noqa: F401 - probing the import
    except ImportError:
        return False
    return True


@functools.cache
def triton_works(device: torch.device) -> bool:
    """Triton imports and its kernel moves a small strided case on `device` as torch does (once per process).

    The kernel reaches tensors by offsets across allocations: a Triton or driver that compiles it wrongly
    must cost speed (the "gather" path), never the weights; the reason is logged.
    """
    if not triton_available():
        return False
    from hpcrl.transfer.packing_triton import self_check
    try:
        why = self_check(device, TILE)
    except Exception as err:  # noqa: BLE001 - the reason is logged and the torch path used instead
        why = f"{type(err).__name__}: {err}"
    if why is not None:
        log.warning("the 'triton' packing path fails its self-check on %s (%s); packing with torch index ops",
                    device, why)
    return why is None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class _Round:
    path: str
    tiles: torch.Tensor | None = None
    aligned: bool = False
    gather: GatherIndex | None = None

    @property
    def nbytes(self) -> int:
        tiles = self.tiles.numel() * self.tiles.element_size() if self.tiles is not None else 0
        return tiles + (self.gather.nbytes if self.gather is not None else 0)


def _block_views(plan: TransferPlan, m: Message, tensors: list, side: str):
    """(wire slice, the block's strided view of its tensor) of each block of message `m`, in plan order;
    `side` "source" (the trainer's shards) or "dest" (vLLM's parameters)."""
    b, pos = plan.blocks, 0
    stride, offset = ("src_stride", "src_offset") if side == "source" else ("dst_stride", "dst_offset")
    for i in range(m.start, m.stop):
        t = tensors[b[side][i]]
        count, length = int(b["count"][i]), int(b["length"][i])
        yield slice(pos, pos + count * length), t.as_strided((count, length), (int(b[stride][i]), 1),
                                                             t.storage_offset() + int(b[offset][i]))
        pos += count * length


def pack(plan: TransferPlan, m: Message, sources: list[torch.Tensor | None], out: torch.Tensor) -> None:
    """Message `m` into `out`, block by block (one strided copy each): the reference the packing paths match."""
    for wire, view in _block_views(plan, m, sources, "source"):
        out[wire].view(view.shape).copy_(view)


def unpack(plan: TransferPlan, m: Message, buf: torch.Tensor, dests: list[torch.Tensor]) -> None:
    """Message `m` from `buf` into the destinations, block by block: the reference the packing paths match."""
    for wire, view in _block_views(plan, m, dests, "dest"):
        view.copy_(buf[wire].view(view.shape))


class Packer:
    """One rank's packing (or unpacking) of its rounds of one plan, index tensors made once.

    `direction` is "pack" (a trainer rank: sources -> staging) or "unpack" (an inference rank:
    staging -> dests). `path` forces one of PATHS; None chooses (module docstring). Rounds whose
    gather indices would take the rank past `index_budget_bytes` copy block by block.
    """

    def __init__(self, plan: TransferPlan, batches: list[list[Message]], direction: str, device: torch.device, *,
                 path: str | None = None, index_budget_bytes: int = DEFAULT_INDEX_BUDGET_BYTES):
        if direction not in _COLUMNS:
            raise ValueError(f"direction must be 'pack' or 'unpack', got {direction!r}")
        if path is not None and path not in PATHS:
            raise ValueError(f"unknown packing path {path!r}; choose one of {', '.join(PATHS)}")
        if path == "triton" and not (triton_available() and (device.type == "cuda" or _interpreting())):
            raise ValueError(f"the 'triton' packing path needs Triton and CUDA tensors (or TRITON_INTERPRET=1); "
                             f"these are on {device}")
        self.use_triton = path == "triton" or (path is None and device.type == "cuda" and triton_works(device))
        self.auto = "triton" if self.use_triton else "loop" if device.type == "cpu" else "gather"
        self.plan, self.batches, self.direction, self.device = plan, batches, direction, device
        self.path, self.budget = path, index_budget_bytes
        self._rounds: list[_Round | None] = [None] * len(batches)
        self.tensors: list[torch.Tensor | None] = []
        self.relative: torch.Tensor | None = None
        self.aligned = False
        self._spent = 0
        self._refused = 0

    def _round(self, k: int) -> _Round:
        r = self._rounds[k]
        if r is None:
            r = self._rounds[k] = self._make(k)
        return r

    def _make(self, k: int) -> _Round:
        rb = round_blocks(self.plan, self.batches[k], self.direction)
        path = self.path
        if path is None:
            path = self.auto
        if path == "triton":
            table, aligned = tile_table(rb)
            return _Round("triton", tiles=torch.from_numpy(table).to(self.device), aligned=aligned)
        if path == "gather":
            need = gather_index_bytes(rb)
            if self._spent + need > self.budget:
                self._refused += 1
                if self._refused == 1:
                    log.info("%s: round %d's gather indices (%d MiB) would take this rank past its index "
                             "budget of %d MiB; it and any later such round copy block by block",
                             self.direction, k, need >> 20, self.budget >> 20)
                return _Round("loop")
            self._spent += need
            return _Round("gather", gather=gather_index(rb, self.device))
        return _Round("loop")

    def path_of(self, k: int) -> str:
        return self._round(k).path

    @property
    def index_bytes(self) -> int:
        """Device memory held by the index tensors made so far."""
        return sum(r.nbytes for r in self._rounds if r is not None)

    def bind(self, tensors: list[torch.Tensor | None]) -> None:
        """The tensors of this send or receive: the plan's sources (pack) or dests (unpack), flat views.

        The "triton" path reads their offsets from a device table made here, once per sync, and
        needs them all of one dtype (else its rounds copy block by block, said once in the log).
        """
        self.tensors = tensors
        self.relative, self.aligned = None, False
        if self.use_triton:
            from hpcrl.transfer.packing_triton import relative_offsets
            self.relative, self.aligned = relative_offsets(tensors, self.device)
            if self.relative is None and any(t is not None for t in tensors):
                log.info("%s: the tensors are of several dtypes (%s); the 'triton' path needs one, rounds that "
                         "would take it copy block by block", self.direction,
                         sorted({str(t.dtype) for t in tensors if t is not None}))

    def run(self, k: int, staging: torch.Tensor) -> None:
        """Round k: the bound sources -> staging[:round numel] (pack), or staging -> the bound dests (unpack)."""
        r, batch, tensors = self._round(k), self.batches[k], self.tensors
        n = sum(m.numel for m in batch)
        if r.tiles is not None and self.relative is not None:
            from hpcrl.transfer.packing_triton import copy_tiles
            copy_tiles(r.tiles, self.relative, tensors, staging[:n], pack=self.direction == "pack",
                       aligned=r.aligned and self.aligned, tile=TILE)
        elif r.gather is not None:
            if self.direction == "pack":
                gather_pack(r.gather, tensors, staging[:n])
            else:
                gather_unpack(r.gather, staging[:n], tensors)  # type: ignore[arg-type]
        else:
            pos = 0
            for m in batch:
                if self.direction == "pack":
                    pack(self.plan, m, tensors, staging[pos:pos + m.numel])
                else:
                    unpack(self.plan, m, staging[pos:pos + m.numel], tensors)  # type: ignore[arg-type]
                pos += m.numel
