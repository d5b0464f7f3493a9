"""The "triton" packing path (hpcrl.transfer.packing): a whole round in one kernel launch.

One program per tile (packing.tile_table): up to TILE elements of one block, read or written at
`offset + row * stride + col` of its tensor, whose address comes from a table (int64, by plan
index), and written or read at `position + element` of the round's staging buffer, cast to the
destination's dtype in the same pass (round to nearest even, as torch's copy_). A contiguous block
(the table gives it stride == length) skips the division into rows. Imported only where it runs
(CUDA tensors, Triton present); TRITON_INTERPRET=1 runs it on CPU tensors for the tests.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

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
    e = first.to(tl.int32) + i  # a block holds < 2**31 elements (tile_table checks)
    if stride == length:
        at = offset + e.to(tl.int64)
    else:
        width = length.to(tl.int32)
        r = e // width
        at = offset + r.to(tl.int64) * stride + (e - r * width).to(tl.int64)
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


def self_check(device: torch.device) -> str | None:
    """None if the kernel packs and unpacks a small strided case on `device` as torch does, else why not."""
    src = torch.arange(7 * 48, dtype=torch.float32, device=device).mul_(1.001).view(7, 48)
    want = torch.cat([src[1:6, 3:40].reshape(-1), src[2:4].reshape(-1)]).to(torch.bfloat16)
    tiles = torch.tensor([[0, 1 * 48 + 3, 48, 37, 0, 0, 5 * 37], [0, 2 * 48, 96, 96, 5 * 37, 0, 96]],
                         dtype=torch.int64, device=device)
    addresses = torch.tensor([src.data_ptr()], dtype=torch.int64, device=device)
    got = torch.zeros(want.numel(), dtype=torch.bfloat16, device=device)
    copy_tiles(tiles, addresses, [src], got, pack=True)
    back = torch.zeros(7, 48, dtype=torch.bfloat16, device=device)
    copy_tiles(tiles, torch.tensor([back.data_ptr()], dtype=torch.int64, device=device), [back], got, pack=False)
    if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
        return "packing a strided test case gave other bytes than torch"
    if not torch.equal(back[1:6, 3:40], src[1:6, 3:40].to(torch.bfloat16)) or back[0].any() or back[6].any():
        return "unpacking a strided test case gave other bytes than torch"
    return None
