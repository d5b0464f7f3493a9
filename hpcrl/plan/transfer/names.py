"""Which trainer tensor, and which of its rows, holds each row of each Hugging Face weight.

The trainer's tensors are the Hugging Face ones, row for row: hpcrl's trainer converts torchtitan's
model through its state-dict adapter (hpcrl.trainer.titan), so every model family plans with HF names.

The trainer may hold experts grouped (`TrainerLayout.grouped_experts`): each layer's experts
stacked in one tensor per projection, as torchtitan's GroupedExperts holds them (`group_experts`).

A `Piece` (hpcrl.models.layout) is a run of rows: HF row hf_row0 + k is source row
src_row0 + k*src_step, for k < count. Every HF row is in exactly one piece.
"""

from __future__ import annotations

import re

from hpcrl.errors import PlanError
from hpcrl.models import ModelShape
from hpcrl.models.layout import Piece, SourceTensor, as2d

__all__ = ["Piece", "SourceTensor", "group_experts", "hf_sources", "trainer_sources"]

#: An HF expert tensor: "<prefix>experts.<e>.<rest>"; its grouped tensor is "<prefix>experts.<rest>".
EXPERT = re.compile(r"^(.*\.experts\.)(\d+)\.(.+)$")


def hf_sources(shape: ModelShape) -> tuple[list[SourceTensor], dict[str, list[Piece]]]:
    """The identity mapping: every HF tensor is a trainer tensor of the same name."""
    sources, pieces = [], {}
    for name, dims in shape.hf_parameters():
        rows, cols = as2d(dims)
        sources.append(SourceTensor(name=name, shape=(rows, cols)))
        pieces[name] = [Piece(hf_row0=0, count=rows, source=name, src_row0=0)]
    return sources, pieces


def group_experts(sources: list[SourceTensor], pieces: dict[str, list[Piece]]
                  ) -> tuple[list[SourceTensor], dict[str, list[Piece]]]:
    """Replace each layer's per-expert tensors by one stack per projection (torchtitan's
    GroupedExperts [E, rows, cols], seen as (E*rows, cols)): expert e's rows are rows
    [e*rows, (e+1)*rows) of the stack, and FSDP2 chunks the stack in whole experts."""
    stacks: dict[str, list[SourceTensor]] = {}
    numbers: dict[str, list[str]] = {}  # each stack's expert numbers as its members' names spell them
    out: list[SourceTensor] = []
    for s in sources:
        m = EXPERT.match(s.name)
        if not m:
            out.append(s)
            continue
        name = m.group(1) + m.group(3)
        if name not in stacks:
            stacks[name], numbers[name] = [], []
            out.append(SourceTensor(name=name, shape=(0, 0)))  # placeholder: keeps first-appearance order
        stacks[name].append(s)
        numbers[name].append(m.group(2))
    grouped = {}
    for name, members in stacks.items():
        rows, cols = members[0].shape
        if any(t.shape != (rows, cols) for t in members):
            raise PlanError(f"experts of {name} differ in shape; a grouped expert stack needs equal experts")
        if numbers[name] != [str(e) for e in range(len(members))]:
            raise PlanError(f"experts of {name} are not numbered 0..{len(members) - 1} in order")
        grouped[name] = SourceTensor(name=name, shape=(len(members) * rows, cols), shard_rows=rows)
        for e, t in enumerate(members):
            pieces[t.name] = [Piece(hf_row0=pc.hf_row0, count=pc.count, source=name,
                                    src_row0=e * rows + pc.src_row0, src_step=pc.src_step)
                              for pc in pieces[t.name]]
    return [grouped.get(s.name, s) for s in out], pieces


def trainer_sources(shape: ModelShape, *, grouped_experts: bool = False
                    ) -> tuple[list[SourceTensor], dict[str, list[Piece]]]:
    """Trainer tensors and the pieces of every HF row (experts stacked if `grouped_experts`)."""
    sources, pieces = hf_sources(shape)
    return group_experts(sources, pieces) if grouped_experts else (sources, pieces)
