"""The "triton" packing path (hpcrl.transfer.packing): a whole round in one kernel launch.

One program per tile (packing.tile_table): up to TILE elements of one block, read or written at
`offset + row * stride + col` of its tensor, whose address comes from a table (int64, by plan
index), and written or read at `position + element` of the round's staging buffer, cast to the
destination's dtype in the same pass. Imported only where it runs (CUDA tensors, Triton present);
TRITON_INTERPRET=1 runs it on CPU tensors for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hpcrl.transfer.packing import TILE


@triton.jit
def _copy_tiles(tiles, addresses, staging, like, PACK: tl.constexpr, TILE: tl.constexpr):
    row = tiles + tl.program_id(0).to(tl.int64) * 7
    tensor = tl.load(row)
    offset = tl.load(row + 1)
    stride = tl.load(row + 2)
    length = tl.load(row + 3)
    position = tl.load(row + 4)
    first = tl.load(row + 5)
    n = tl.load(row + 6)
    base = tl.load(addresses + tensor).to(like.dtype)  # int64 address -> pointer to the tensors' dtype
    i = tl.arange(0, TILE)
    mask = i < n
    e = first + i.to(tl.int64)
    r = e // length
    at = offset + r * stride + (e - r * length)
    if PACK:
        v = tl.load(base + at, mask=mask)
        tl.store(staging + position + e, v.to(staging.dtype.element_ty), mask=mask)
    else:
        v = tl.load(staging + position + e, mask=mask)
        tl.store(base + at, v.to(like.dtype.element_ty), mask=mask)


def copy_tiles(tiles: torch.Tensor, addresses: torch.Tensor, tensors: list, staging: torch.Tensor, *,
               pack: bool) -> None:
    """One launch moving every tile of a round between its tensors and `staging` (all tensors one dtype)."""
    if not tiles.shape[0]:
        return
    like = next(t for t in tensors if t is not None)
    _copy_tiles[(tiles.shape[0],)](tiles, addresses, staging, like, PACK=pack, TILE=TILE, num_warps=8)
