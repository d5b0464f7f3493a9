"""The "triton" packing path (hpcrl.transfer.packing): a whole round in one kernel launch.

One program per tile (packing.tile_table): up to TILE elements of one block, read or written at
`offset + row * stride + col` of its tensor and at `position + element` of the round's staging
buffer, cast to the destination's dtype in the same pass (round to nearest even, as torch's
copy_). A contiguous block (the table gives it stride == length) skips the division into rows.

Every tensor of the round is reached from one of them (`like`, a kernel argument) by an element
offset (`relative`, int64, by plan index): the tensors are separate allocations, and one launch
cannot take hundreds of pointer arguments. Where every offset, stride, length, position and
tile size of the round is a multiple of 8 elements and the tensors are 16-byte aligned (Llama
shapes: always), ALIGNED tells the compiler so and it moves 16 bytes per load and store.

Imported only where it runs (CUDA tensors, Triton present); TRITON_INTERPRET=1 runs it on CPU
tensors for the tests. packing.triton_works() runs self_check() once per process before use.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]


@triton.jit
def _copy_tiles(tiles, relative, staging, like, PACK: tl.constexpr, ALIGNED: tl.constexpr, TILE: tl.constexpr):
    row = tiles + tl.program_id(0).to(tl.int64) * 7
    tensor = tl.load(row)
    offset = tl.load(row + 1)
    stride = tl.load(row + 2)
    length = tl.load(row + 3)
    position = tl.load(row + 4)
    first = tl.load(row + 5)
    n = tl.load(row + 6)
    base = tl.load(relative + tensor) + offset
    i = tl.arange(0, TILE)
    e = first.to(tl.int32) + i  # a block holds < 2**31 elements (tile_table checks)
    if stride == length:
        at = base + e.to(tl.int64)
    else:
        width = length.to(tl.int32)
        r = e // width
        at = base + r.to(tl.int64) * stride + (e - r * width).to(tl.int64)
    s = position + e.to(tl.int64)
    if ALIGNED:  # runs of 8 elements starting at multiples of 8, on both sides; n is a multiple of 8
        at = tl.max_contiguous(tl.multiple_of(at, 8), 8)
        s = tl.max_contiguous(tl.multiple_of(s, 8), 8)
        mask = (i // 8) < (n // 8)
    else:
        mask = i < n
    if PACK:
        v = tl.load(like + at, mask=mask)
        tl.store(staging + s, v.to(staging.dtype.element_ty), mask=mask)
    else:
        v = tl.load(staging + s, mask=mask)
        tl.store(like + at, v.to(like.dtype.element_ty), mask=mask)


def relative_offsets(tensors: list, device: torch.device) -> tuple[torch.Tensor | None, bool]:
    """(element offset of each tensor from the first present one, by plan index, on `device`; all 16-byte aligned
    with offsets that are multiples of 8), or (None, False) where the tensors are of several dtypes."""
    used = [t for t in tensors if t is not None]
    if not used or len({t.dtype for t in used}) > 1:
        return None, False
    size, origin = used[0].element_size(), used[0].data_ptr()
    rel = [(t.data_ptr() - origin) // size if t is not None else 0 for t in tensors]
    aligned = origin % 16 == 0 and all(r % 8 == 0 for r in rel)
    return torch.tensor(rel, dtype=torch.int64).to(device, non_blocking=True), aligned


def copy_tiles(tiles: torch.Tensor, relative: torch.Tensor, tensors: list, staging: torch.Tensor, *,
               pack: bool, aligned: bool, tile: int) -> None:
    """One launch moving every tile of a round between its tensors and `staging`; `tile` is the longest
    a tile may be (packing.TILE: the table's, passed in so that this module needs nothing of packing's).

    `aligned`: the round's table is (packing.tile_table's flag) and so are the tensors
    (relative_offsets); checked here for the staging buffer.
    """
    if not tiles.shape[0]:
        return
    like = next(t for t in tensors if t is not None)
    aligned = aligned and staging.data_ptr() % 16 == 0
    _copy_tiles[(tiles.shape[0],)](tiles, relative, staging, like, PACK=pack, ALIGNED=aligned, TILE=tile,
                                   num_warps=8)


def self_check(device: torch.device, tile: int) -> str | None:
    """None if the kernel (the variant of tiles up to `tile` elements) packs and unpacks small strided
    cases on `device` as torch does, else why not.

    Two rounds: one aligned (runs of multiples of 8 elements: the 16-byte loads), one not.
    """
    src = torch.arange(7 * 48, dtype=torch.float32, device=device).mul_(1.001).view(7, 48)
    for (r0, r1, c0, c1), aligned in (((1, 6, 3, 40), False), ((1, 6, 8, 40), True)):
        width = c1 - c0
        want = torch.cat([src[r0:r1, c0:c1].reshape(-1), src[2:4].reshape(-1)]).to(torch.bfloat16)
        n0 = (r1 - r0) * width
        tiles = torch.tensor([[0, r0 * 48 + c0, 48, width, 0, 0, n0], [0, 2 * 48, 96, 96, n0, 0, 96]],
                             dtype=torch.int64, device=device)
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        got = torch.zeros(want.numel() + 8, dtype=torch.bfloat16, device=device)
        copy_tiles(tiles, zero, [src], got, pack=True, aligned=aligned, tile=tile)
        back = torch.zeros(7, 48, dtype=torch.bfloat16, device=device)
        copy_tiles(tiles, zero, [back], got, pack=False, aligned=aligned, tile=tile)
        what = "aligned" if aligned else "unaligned"
        if not torch.equal(got[:want.numel()].view(torch.int16), want.view(torch.int16)) or got[want.numel():].any():
            return f"packing a strided {what} test case gave other bytes than torch"
        expect = torch.zeros_like(back)
        expect[r0:r1, c0:c1] = src[r0:r1, c0:c1].to(torch.bfloat16)
        expect[2:4] = src[2:4].to(torch.bfloat16)
        if not torch.equal(back.view(torch.int16), expect.view(torch.int16)):
            return f"unpacking a strided {what} test case gave other bytes than torch"
    return None
