"""How a family's tensors hold the rows of its Hugging Face tensors: plain data, no arithmetic.

A family describes both ends of a weight transfer in rows of its HF tensors (a 1-D weight is one
column), and hpcrl.plan turns the descriptions into a plan:

  trainer  `SourceTensor`s and `Piece`s: which trainer tensor, and which of its rows, holds each
           HF row (the identity for the "hf" naming; torchtitan's own naming where a family
           models it, e.g. hpcrl/models/llama/titan_layout.py).
  vLLM     `VllmParam`s: each vLLM parameter, the vLLM layer class that shards it over tensor
           parallelism, and the HF tensors its weight loader reads (hpcrl/plan/transfer_layout.py
           implements each layer's rule once, for every family).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class SourceTensor:
    """One trainer tensor (before FSDP sharding): name and global (rows, columns)."""

    name: str
    shape: tuple[int, int]


@dataclass(frozen=True, kw_only=True)
class Piece:
    """A run of rows: HF row hf_row0 + k is row src_row0 + k*src_step of `source`, for k < count."""

    hf_row0: int
    count: int
    source: str
    src_row0: int
    src_step: int = 1


def as2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, columns) of a 1-D or 2-D tensor shape (a 1-D tensor is one column)."""
    return (shape[0], shape[1]) if len(shape) == 2 else (shape[0], 1)


VllmLayer = Literal["vocab", "replicated", "qkv", "merged_column", "row", "moe_w13", "moe_w2"]
"""The vLLM layer classes whose tensor-parallel sharding hpcrl.plan.transfer_layout models:

  vocab          VocabParallelEmbedding / ParallelLMHead: rows split after padding the vocabulary
  replicated     norms: the whole tensor on every rank
  qkv            QKVParallelLinear: q heads split, k/v heads split or replicated (hf = q, k, v)
  merged_column  MergedColumnParallelLinear: each HF tensor's rows split, stacked (hf = gate, up)
  row            RowParallelLinear: columns split
  moe_w13        FusedMoE w13_weight (E, 2I/tp, H): per expert gate's and up's rows split, stacked
                 (hf = e0.gate, e0.up, e1.gate, ...); expert parallel: whole experts per rank
  moe_w2         FusedMoE w2_weight (E, H, I/tp): per expert down's columns split (hf = e0.down, ...)
"""


@dataclass(frozen=True, kw_only=True)
class VllmParam:
    """One vLLM parameter: its name, the layer that shards it, and the HF tensors it is loaded from."""

    name: str
    layer: VllmLayer
    hf: tuple[str, ...]
    """HF tensor names, in the order vLLM stacks them (q, k, v; gate, up); one for the other layers."""
