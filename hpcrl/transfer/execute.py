"""Run one rank's part of a transfer plan over a transfer group (torch only, any device).

`link` is an open transfer group (registry.TransferLink: gloo, UCX or NCCL): `round(timeout)`,
`isend(buf, dst, tag)`, `irecv(buf, src, tag)` and `wait(handle, timeout)`, with ranks numbered as
in `inference_group_rank` (trainer ranks first).

A message is a run of consecutive plan blocks of one route (plan.blocks["message"]). Every
transport runs the same schedule: the plan's messages in rounds (hpcrl.plan.transfer.rounds,
`plan.round_bytes` of staging per rank and round). In each round a receiver posts all its `recv`s,
a sender packs each block's `count` strided runs out of its local shard, cast to the wire dtype,
into one buffer per message and `send`s it with the message number as tag; both wait, then the
receiver unpacks each buffer into its destination tensors in plan order. A round's operations are
issued inside `link.round()` (NCCL: one group_start ... group_end). `pack` / `unpack` below copy
block by block and define the bytes; hpcrl.transfer.packing moves the same bytes for a whole round
in a number of operations that does not grow with its blocks (one Triton kernel on a GPU), and the
sender packs round k + 1 while round k is on the wire.

Staging (class Staging) is one buffer per rank and sync, sized for the rank's largest round, on the
link's device: on a GPU with NCCL, packing and unpacking are device copies with no host round trip;
with a host transport (gloo, UCX) and GPU tensors, packing stays on the GPU and one pinned host hop
per round remains.

Failures (a peer gone, a timeout, a tensor missing or mis-shaped) raise TransferError naming
the message, its parameters and both ranks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch

from hpcrl.errors import TransferError
from hpcrl.plan.transfer.layout import chunk_source_rows
from hpcrl.plan.transfer.plan import TransferPlan
from hpcrl.plan.transfer.rounds import Message, receiver_rank, rounds
from hpcrl.transfer.packing import PATHS, Packer, pack, unpack  # noqa: F401 - pack/unpack: the reference, here too

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


def _peer(plan: TransferPlan, m: Message, side: str) -> str:
    """The other end of `m`, seen from `side` ("source": its receiver; "dest": its sender)."""
    return describe_group_rank(plan, receiver_rank(plan, m) if side == "source" else m.src_rank)


@contextmanager
def _issuing(plan: TransferPlan, batch: list[Message], side: str) -> Iterator[None]:
    """Issuing a round's operations: a failure names the round's first message and every peer of the round.

    Any peer can be the cause: NCCL's group_end fails after an abort, and gloo fails a post on one
    pair once another peer of the same context has closed its connection (a trainer rank that died)."""
    try:
        yield
    except TransferError:
        raise
    except Exception as err:  # noqa: BLE001 - re-raised naming the round
        verb = "sending" if side == "source" else "receiving"
        more = f" and {len(batch) - 1} more in its round" if len(batch) > 1 else ""
        peers = {_peer(plan, o, side) for o in batch} - {_peer(plan, batch[0], side)}
        also = f" (its round also with {', '.join(sorted(peers))})" if peers else ""
        raise TransferError(f"{verb} {_what(plan, batch[0], side)}{more}{also} could not be issued: {err}") from err


def _wait(link, plan: TransferPlan, m: Message, work, timeout: timedelta, side: str, batch: list[Message]) -> None:
    try:
        link.wait(work, timeout)
    except Exception as err:  # noqa: BLE001 - re-raised naming the message and ranks
        verb = "sending" if side == "source" else "receiving"
        # NCCL completes a round as a whole: name every peer this rank waited on in it.
        peers = {_peer(plan, o, side) for o in batch} - {_peer(plan, m, side)}
        also = f" (in a round also waiting on {', '.join(sorted(peers))})" if peers else ""
        raise TransferError(f"{verb} {_what(plan, m, side)} failed{also}: {err}") from err


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
    """This trainer rank's local shards by plan source index; TransferError if one is missing or mis-shaped.

    A grouped expert stack (source.shard_rows > 1: torchtitan's [E, I, H] seen as (E*I, H)) may come
    as its 3-D FSDP shard [E_local, I, H]: FSDP2 chunks whole experts (chunk_source_rows), so the
    shard is the same contiguous rows either way."""
    shard = rank % plan.trainer.dp_shard
    used = set(plan.blocks["source"][plan.blocks["src_rank"] == rank].tolist())
    out: list[torch.Tensor | None] = [None] * len(plan.sources)
    for i in sorted(used):
        s = plan.sources[i]
        a, e = chunk_source_rows(s.shape[0], plan.trainer.dp_shard, s.shard_rows)[shard]
        want = (e - a, s.shape[1])
        t = sources.get(s.name)
        if t is None:
            raise TransferError(f"trainer rank {rank} has no tensor {s.name!r} to send (the plan needs rows "
                                f"[{a}, {e}) of it); it has {len(sources)} tensors")
        seen = _as_rows(t)
        if t.numel() != want[0] * want[1] or (t.dim() and seen[:1] != want[:1]):
            each = f" of whole items of {s.shard_rows} rows" if s.shard_rows > 1 else ""
            raise TransferError(f"trainer rank {rank}: local shard of {s.name} is {tuple(t.shape)}, the plan "
                                f"expects {want} (rows [{a}, {e}) of {s.shape}, torch.chunk{each} over "
                                f"dp_shard {plan.trainer.dp_shard})")
        out[i] = _flat(t)
    return out


def _as_rows(t: torch.Tensor) -> tuple[int, ...]:
    """The (rows, columns) a tensor is seen as: 1-D as one column, 3-D [items, rows, columns] as
    (items * rows, columns); () for a scalar or more dimensions."""
    if t.dim() == 1:
        return (t.shape[0], 1)
    if t.dim() == 3:
        return (t.shape[0] * t.shape[1], t.shape[2])
    return tuple(t.shape) if t.dim() == 2 else ()


def check_dests(plan: TransferPlan, replica: int, tp_rank: int, dests: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Destination tensors by plan dest index; TransferError naming the parameter if one does not fit.

    A parameter is seen in the plan's rows (_as_rows: FusedMoE's [E_local, 2I/tp, H] is the plan's
    (E_local*2I/tp, H)). Under uneven expert parallelism a rank holding fewer experts has a smaller
    parameter: its `real_rows` rows, all that the plan writes there."""
    wire = TORCH_DTYPES[plan.wire_dtype]
    out = []
    for d in plan.dests:
        t = dests.get(d.name)
        where = f"replica {replica} TP rank {tp_rank}"
        if t is None:
            raise TransferError(f"{where} has no parameter {d.name!r} to receive into")
        rows, cols = d.local_shape
        real = d.real_rows[tp_rank]
        if _as_rows(t) not in {(rows, cols), (real, cols)}:
            raise TransferError(f"{where}: {d.name} is {tuple(t.shape)}, the plan expects {d.local_shape}"
                                + (f" ({real} real rows on this rank)" if real < rows else ""))
        if t.dtype != wire:
            raise TransferError(f"{where}: {d.name} is {t.dtype}, the plan's wire dtype is {plan.wire_dtype}")
        if not t.is_contiguous():
            raise TransferError(f"{where}: {d.name} is not contiguous; cannot receive into it in place")
        out.append(t.view(-1))
    return out


class Staging:
    """One rank's staging memory for one sync: room for its largest round, made once per sync.

    `link` is where the transport reads and writes (the link's device); `work` is where packing and
    unpacking run (the tensors' device). They are one buffer unless the tensors are on a GPU and the
    transport moves host memory (gloo, UCX): then `link` is pinned host memory and each round makes
    one host hop, device -> host after packing or host -> device before unpacking.
    """

    def __init__(self, numel: int, dtype: torch.dtype, *, link_device: torch.device, tensor_device: torch.device):
        self.hop = link_device != tensor_device
        pinned = self.hop and link_device.type == "cpu" and tensor_device.type == "cuda"
        self.link = torch.empty(numel, dtype=dtype, device=link_device, pin_memory=pinned)
        self.work = torch.empty(numel, dtype=dtype, device=tensor_device) if self.hop else self.link

    @staticmethod
    def slices(buf: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
        """Consecutive views of `buf`, one per message of the round."""
        return buf[:sum(sizes)].split(sizes)

    def to_link(self, numel: int) -> None:
        if self.hop:
            self.link[:numel].copy_(self.work[:numel], non_blocking=True)
            _synchronize(self.work.device)

    def to_work(self, numel: int) -> None:
        if self.hop:  # synchronised: the next round receives into the same host buffer
            self.work[:numel].copy_(self.link[:numel], non_blocking=True)
            _synchronize(self.work.device)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _staging_numel(batches: list[list[Message]]) -> int:
    return max((sum(m.numel for m in batch) for batch in batches), default=0)


def _device_of(tensors: list[torch.Tensor | None], default: torch.device) -> torch.device:
    return next((t.device for t in tensors if t is not None), default)


_PACKERS: dict[tuple, Packer] = {}
"""Packers by (plan digest, direction, rank, device): index tensors made on the first sync of a plan."""


def packer(plan: TransferPlan, batches: list[list[Message]], direction: str, who: tuple,
           device: torch.device) -> Packer:
    """The cached Packer of this rank's rounds (made once per plan; a new plan drops the old ones)."""
    forced = os.environ.get("HPCRL_PACKING") or None
    if forced is not None and forced not in PATHS:
        raise TransferError(f"HPCRL_PACKING={forced!r} is not a packing path; set one of {', '.join(PATHS)} "
                            f"or unset it (the default chooses by device: hpcrl/transfer/packing.py)")
    digest = plan_digest(plan)
    key = (digest, direction, who, str(device), forced)
    if key not in _PACKERS:
        for old in [k for k in _PACKERS if k[0] != digest]:
            del _PACKERS[old]
        _PACKERS[key] = Packer(plan, batches, direction, device, path=forced)
    return _PACKERS[key]


_DIGEST: list = [None, None]


def plan_digest(plan: TransferPlan) -> str:
    """plan.digest, hashed once per plan object."""
    if _DIGEST[0] is not plan:
        _DIGEST[:] = [plan, plan.digest]
    return _DIGEST[1]


def send(link, plan: TransferPlan, rank: int, sources: list[torch.Tensor | None], *, timeout_s: float) -> int:
    """Send every message of trainer `rank`, round by round (hpcrl.plan.transfer.rounds); the bytes sent.

    Per round: pack this rank's messages into staging (hpcrl.transfer.packing: a number of
    operations that does not grow with the round's blocks, the cast to the wire dtype included),
    issue the sends as one round of the link, and while they go pack the next round into a second
    staging buffer (2 x the largest round of staging memory); then wait for the sends. With NCCL on
    a GPU the packing runs on a side stream that the sends wait on through an event, so it overlaps
    the wire; with gloo or UCX the sends run on the transport's own threads.
    """
    wire = TORCH_DTYPES[plan.wire_dtype]
    timeout = timedelta(seconds=timeout_s)
    mine = [[m for m in batch if m.src_rank == rank] for batch in schedule(plan)]
    mine = [batch for batch in mine if batch]
    device = _device_of(sources, link.device)
    numel = _staging_numel(mine)
    stagings = [Staging(numel, wire, link_device=link.device, tensor_device=device)
                for _ in range(min(2, len(mine)))]
    packing = packer(plan, mine, "pack", ("trainer", rank), device)
    packing.bind(sources)
    side = torch.cuda.Stream(device) if device.type == "cuda" and stagings and not stagings[0].hop else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(device))  # the sources as the caller left them
    packed: list = [None] * len(mine)

    def prepare(k: int) -> None:
        staging = stagings[k % 2]
        if side is None:
            packing.run(k, staging.work)
            staging.to_link(sum(m.numel for m in mine[k]))
        else:
            with torch.cuda.stream(side):
                packing.run(k, staging.work)
                packed[k] = side.record_event()

    sent = 0
    if mine:
        prepare(0)
    for k, batch in enumerate(mine):
        sizes = [m.numel for m in batch]
        staging = stagings[k % 2]
        if packed[k] is not None:
            torch.cuda.current_stream(device).wait_event(packed[k])
        with _issuing(plan, batch, "source"), link.round(timeout):
            posted = [(m, link.isend(buf, inference_group_rank(plan, m.replica, m.tp_rank), m.id))
                      for m, buf in zip(batch, staging.slices(staging.link, sizes))]
        if k + 1 < len(mine):
            prepare(k + 1)  # overlaps round k's wire; its buffer's round k - 1 was waited for
        for m, work in posted:
            _wait(link, plan, m, work, timeout, "source", batch)
            sent += m.numel * plan.itemsize
    return sent


def receive(link, plan: TransferPlan, replica: int, tp_rank: int, dests: list[torch.Tensor], *, timeout_s: float,
            on_message: Callable[[Message], None] | None = None) -> int:
    """Receive every message for (replica, tp_rank) into `dests`, round by round; the bytes received.

    Per round: post every receive of the round as one round of the link, wait for them, unpack
    them into the destination tensors in place (hpcrl.transfer.packing: a number of operations
    that does not grow with the round's blocks), then report each message.
    """
    wire = TORCH_DTYPES[plan.wire_dtype]
    timeout = timedelta(seconds=timeout_s)
    mine = [[m for m in batch if m.replica == replica and m.tp_rank == tp_rank] for batch in schedule(plan)]
    mine = [batch for batch in mine if batch]
    device = _device_of(list(dests), link.device)
    staging = Staging(_staging_numel(mine), wire, link_device=link.device, tensor_device=device)
    unpacking = packer(plan, mine, "unpack", ("inference", replica, tp_rank), device)
    unpacking.bind(list(dests))
    received = 0
    for k, batch in enumerate(mine):
        sizes = [m.numel for m in batch]
        with _issuing(plan, batch, "dest"), link.round(timeout):
            posted = [(m, link.irecv(buf, m.src_rank, m.id))
                      for m, buf in zip(batch, staging.slices(staging.link, sizes))]
        for m, work in posted:
            _wait(link, plan, m, work, timeout, "dest", batch)
        staging.to_work(sum(sizes))
        unpacking.run(k, staging.work)
        for m in batch:
            received += m.numel * plan.itemsize
            if on_message is not None:
                on_message(m)
    return received
