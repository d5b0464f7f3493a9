"""One schedule for every transport: a plan's messages split into rounds that both ends derive alike.

    for each round, every rank: posts its receives; packs and sends; waits; unpacks

`rounds(plan, round_bytes)` walks the plan's messages in plan order and closes a round before the
message that would take its sender's or its receiver's staging bytes in the round above
`round_bytes`; a message larger than that on its own is then alone in its round for both of its
ranks. So:
  - every message is in exactly one round, and rounds are contiguous runs of plan order: the
    order of the messages of any (sender, receiver) pair is kept (NCCL matches a round's
    point-to-point ops per peer in issue order);
  - a rank's staging memory is bounded by `round_bytes` (one oversized message aside), on both
    sides: vLLM holds most of a GPU, and NCCL's per-peer buffers come out of the rest;
  - it is a pure function of the plan, so the trainer ranks and every vLLM worker agree without
    talking.

A rank runs only the rounds it has messages in and needs no barrier between rounds: the rank in
the lowest unfinished round waits only on peers in that same round, whose ops are all posted
before any waits, so the schedule cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcrl.plan.transfer.plan import DEFAULT_ROUND_BYTES, TransferPlan

__all__ = ["DEFAULT_ROUND_BYTES", "Message", "messages", "receiver_rank", "rounds"]


@dataclass(frozen=True, kw_only=True)
class Message:
    """A run of consecutive plan blocks of one route, sent as one buffer."""

    id: int
    src_rank: int
    replica: int
    tp_rank: int
    start: int
    """First block (index into plan.blocks)."""
    stop: int
    numel: int


def messages(plan: TransferPlan) -> list[Message]:
    """Every message of the plan, in plan order."""
    b = plan.blocks
    if not plan.num_blocks:
        return []
    starts = np.flatnonzero(np.r_[True, b["message"][1:] != b["message"][:-1]])
    stops = np.r_[starts[1:], plan.num_blocks]
    numel = np.add.reduceat(b["length"] * b["count"], starts)
    return [Message(id=int(b["message"][s]), src_rank=int(b["src_rank"][s]), replica=int(b["replica"][s]),
                    tp_rank=int(b["tp_rank"][s]), start=int(s), stop=int(e), numel=int(n))
            for s, e, n in zip(starts, stops, numel)]


def receiver_rank(plan: TransferPlan, m: Message) -> int:
    """The transfer-group rank receiving `m` (trainer ranks first, then replica x TP)."""
    return plan.trainer.world_size + m.replica * plan.inference.tensor_parallel + m.tp_rank


def rounds(plan: TransferPlan, round_bytes: int) -> list[list[Message]]:
    """The plan's messages in rounds (see the module docstring); every round has at least one message."""
    if round_bytes < 1:
        raise ValueError(f"round_bytes must be at least 1, got {round_bytes}")
    out: list[list[Message]] = []
    current: list[Message] = []
    staged: dict[int, int] = {}  # transfer-group rank -> bytes it stages in the current round
    for m in messages(plan):
        size = m.numel * plan.itemsize
        ends = (m.src_rank, receiver_rank(plan, m))
        if current and any(staged.get(r, 0) and staged.get(r, 0) + size > round_bytes for r in ends):
            out.append(current)
            current, staged = [], {}
        current.append(m)
        for r in ends:
            staged[r] = staged.get(r, 0) + size
    if current:
        out.append(current)
    return out
