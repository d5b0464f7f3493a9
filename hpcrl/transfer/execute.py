"""Run one rank's part of a transfer plan over a transfer group (torch only, any device).

`link` is an open transfer group (registry.TransferLink: gloo, or UCX): `isend(buf, dst, tag)`,
`irecv(buf, src, tag)` and `wait(handle, timeout)`, with ranks numbered as in
`inference_group_rank` (trainer ranks first).

A message is a run of consecutive plan blocks of one route (plan.blocks["message"]). Every
transport runs the same schedule: the plan's messages in rounds (hpcrl.plan.transfer_rounds,
`plan.round_bytes` of staging per rank and round). In each round a receiver posts all its `recv`s,
a sender packs each block's `count` strided runs out of its local shard (torch.as_strided, casting
to the wire dtype) into one buffer per message and `send`s it with the message number as tag; both
wait, then the receiver unpacks each buffer into its destination tensors in plan order.

Failures (a peer gone, a timeout, a tensor missing or mis-shaped) raise TransferError naming
the message, its parameters and both ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch

from hpcrl.errors import TransferError
from hpcrl.plan.transfer_layout import chunk_rows
from hpcrl.plan.transfer_plan import TransferPlan
from hpcrl.plan.transfer_rounds import Message, rounds

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_SCHEDULE: list = [None, None]
"""[plan, its rounds]: the last plan's schedule, made once (a plan is fixed for a run; each sync reuses it)."""


def schedule(plan: TransferPlan) -> list[list[Message]]:
    """rounds(plan, plan.round_bytes), computed once per plan object."""
    if _SCHEDULE[0] is not plan:
        _SCHEDULE[:] = [plan, rounds(plan, plan.round_bytes)]
    return _SCHEDULE[1]


def inference_group_rank(plan: TransferPlan, replica: int, tp_rank: int) -> int:
    return plan.trainer.world_size + replica * plan.inference.tensor_parallel + tp_rank


def _wait(link, plan: TransferPlan, m: Message, work, timeout: timedelta, side: str) -> None:
    try:
        link.wait(work, timeout)
    except Exception as err:  # noqa: BLE001 - re-raised naming the message and ranks
        verb = "sending" if side == "source" else "receiving"
        raise TransferError(f"{verb} {_what(plan, m, side)} failed: {err}") from err


def describe_group_rank(plan: TransferPlan, rank: int) -> str:
    if rank < plan.trainer.world_size:
        return f"trainer rank {rank}"
    replica, tp_rank = divmod(rank - plan.trainer.world_size, plan.inference.tensor_parallel)
    return f"replica {replica} TP rank {tp_rank}"


def _what(plan: TransferPlan, m: Message, side: str) -> str:
    b = plan.blocks
    names = sorted({plan.dests[d].name if side == "dest" else plan.sources[d].name
                    for d in b[side][m.start:m.stop]})
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"message {m.id} ({m.numel * plan.itemsize} bytes of {shown}) from trainer rank {m.src_rank} to "
            f"replica {m.replica} TP rank {m.tp_rank}")


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)


def check_sources(plan: TransferPlan, rank: int, sources: dict[str, torch.Tensor]) -> list[torch.Tensor | None]:
    """This trainer rank's local shards by plan source index; TransferError if one is missing or mis-shaped."""
    shard = rank % plan.trainer.dp_shard
    used = set(plan.blocks["source"][plan.blocks["src_rank"] == rank].tolist())
    out: list[torch.Tensor | None] = [None] * len(plan.sources)
    for i in sorted(used):
        s = plan.sources[i]
        a, e = chunk_rows(s.shape[0], plan.trainer.dp_shard)[shard]
        want = (e - a, s.shape[1])
        t = sources.get(s.name)
        if t is None:
            raise TransferError(f"trainer rank {rank} has no tensor {s.name!r} to send (the plan needs rows "
                                f"[{a}, {e}) of it); it has {len(sources)} tensors")
        if t.numel() != want[0] * want[1] or (t.dim() and t.shape[0] != want[0]):
            raise TransferError(f"trainer rank {rank}: local shard of {s.name} is {tuple(t.shape)}, the plan "
                                f"expects {want} (rows [{a}, {e}) of {s.shape}, torch.chunk over "
                                f"dp_shard {plan.trainer.dp_shard})")
        out[i] = _flat(t)
    return out


def check_dests(plan: TransferPlan, replica: int, tp_rank: int, dests: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Destination tensors by plan dest index; TransferError naming the parameter if one does not fit."""
    wire = TORCH_DTYPES[plan.wire_dtype]
    out = []
    for d in plan.dests:
        t = dests.get(d.name)
        where = f"replica {replica} TP rank {tp_rank}"
        if t is None:
            raise TransferError(f"{where} has no parameter {d.name!r} to receive into")
        if tuple(t.shape) not in (d.local_shape, (d.local_shape[0],) if d.local_shape[1] == 1 else ()):
            raise TransferError(f"{where}: {d.name} is {tuple(t.shape)}, the plan expects {d.local_shape}")
        if t.dtype != wire:
            raise TransferError(f"{where}: {d.name} is {t.dtype}, the plan's wire dtype is {plan.wire_dtype}")
        if not t.is_contiguous():
            raise TransferError(f"{where}: {d.name} is not contiguous; cannot receive into it in place")
        out.append(t.view(-1))
    return out


def pack(plan: TransferPlan, m: Message, sources: list[torch.Tensor | None], out: torch.Tensor) -> None:
    b, pos = plan.blocks, 0
    for i in range(m.start, m.stop):
        src = sources[b["source"][i]]
        count, length = int(b["count"][i]), int(b["length"][i])
        view = src.as_strided((count, length), (int(b["src_stride"][i]), 1),
                              src.storage_offset() + int(b["src_offset"][i]))
        out[pos:pos + count * length].view(count, length).copy_(view)
        pos += count * length


def unpack(plan: TransferPlan, m: Message, buf: torch.Tensor, dests: list[torch.Tensor]) -> None:
    b, pos = plan.blocks, 0
    for i in range(m.start, m.stop):
        dst = dests[b["dest"][i]]
        count, length = int(b["count"][i]), int(b["length"][i])
        view = dst.as_strided((count, length), (int(b["dst_stride"][i]), 1),
                              dst.storage_offset() + int(b["dst_offset"][i]))
        view.copy_(buf[pos:pos + count * length].view(count, length))
        pos += count * length


def send(link, plan: TransferPlan, rank: int, sources: list[torch.Tensor | None], *, timeout_s: float) -> int:
    """Send every message of trainer `rank`, round by round (hpcrl.plan.transfer_rounds); the bytes sent."""
    wire = TORCH_DTYPES[plan.wire_dtype]
    timeout = timedelta(seconds=timeout_s)
    sent = 0
    for batch in schedule(plan):
        mine = [m for m in batch if m.src_rank == rank]
        posted = []
        for m in mine:  # pack and send; the staging buffers live until the round's sends completed
            buf = torch.empty(m.numel, dtype=wire)
            pack(plan, m, sources, buf)
            posted.append((m, link.isend(buf, inference_group_rank(plan, m.replica, m.tp_rank), m.id), buf))
        for m, work, _ in posted:
            _wait(link, plan, m, work, timeout, "source")
            sent += m.numel * plan.itemsize
    return sent


def receive(link, plan: TransferPlan, replica: int, tp_rank: int, dests: list[torch.Tensor], *, timeout_s: float,
            on_message: Callable[[Message], None] | None = None) -> int:
    """Receive every message for (replica, tp_rank) into `dests`, round by round; the bytes received."""
    wire = TORCH_DTYPES[plan.wire_dtype]
    timeout = timedelta(seconds=timeout_s)
    received = 0
    for batch in schedule(plan):
        posted = []
        for m in batch:  # post every receive of the round before waiting on any
            if m.replica == replica and m.tp_rank == tp_rank:
                buf = torch.empty(m.numel, dtype=wire)
                posted.append((m, buf, link.irecv(buf, m.src_rank, m.id)))
        for m, buf, work in posted:
            _wait(link, plan, m, work, timeout, "dest")
            unpack(plan, m, buf, dests)
            received += m.numel * plan.itemsize
            if on_message is not None:
                on_message(m)
    return received
