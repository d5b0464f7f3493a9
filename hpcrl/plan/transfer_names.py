"""Which trainer tensor, and which of its rows, holds each row of each Hugging Face weight.

Two trainer namings:

  hf          the trainer's tensors are the Hugging Face ones, row for row (a transformers
              model under fully_shard; or torchtitan converted through its state-dict adapter,
              as hpcrl's trainer does). Every model family has it.
  torchtitan  torchtitan's own FQNs and row order, where the model family models them
              (`Family.torchtitan_layout`; llama3: hpcrl/models/llama/titan_layout.py).

A `Piece` (hpcrl.models.layout) is a run of rows: HF row hf_row0 + k is source row
src_row0 + k*src_step, for k < count. Every HF row is in exactly one piece.
"""

from __future__ import annotations

from hpcrl.models import ModelShape
from hpcrl.models.layout import Piece, SourceTensor, as2d

__all__ = ["Piece", "SourceTensor", "hf_sources", "trainer_sources"]


def hf_sources(shape: ModelShape) -> tuple[list[SourceTensor], dict[str, list[Piece]]]:
    """The identity mapping: every HF tensor is a trainer tensor of the same name."""
    sources, pieces = [], {}
    for name, dims in shape.hf_parameters():
        rows, cols = as2d(dims)
        sources.append(SourceTensor(name=name, shape=(rows, cols)))
        pieces[name] = [Piece(hf_row0=0, count=rows, source=name, src_row0=0)]
    return sources, pieces


def trainer_sources(shape: ModelShape, *, naming: str, fuse_qkv: bool = True
                    ) -> tuple[list[SourceTensor], dict[str, list[Piece]]]:
    """Trainer tensors and the pieces of every HF row, for the trainer's naming."""
    if naming == "hf":
        return hf_sources(shape)
    return shape.family.torchtitan_layout(shape, fuse_qkv=fuse_qkv)
