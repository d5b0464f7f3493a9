"""How a family's tensors hold the rows of its Hugging Face tensors: plain data, no arithmetic.

A family describes both ends of a weight transfer in rows of its HF tensors (a 1-D weight is one
column), and hpcrl.plan turns the descriptions into a plan:

  trainer  `SourceTensor`s and `Piece`s: which trainer tensor, and which of its rows, holds each
           HF row (the trainer holds HF names: the identity, experts grouped or not).
  vLLM     `VllmParam`s: each vLLM parameter, the vLLM layer class that shards it over tensor
           parallelism, and the HF tensors its weight loader reads (hpcrl/plan/transfer/layout.py
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
    shard_rows: int = 1
    """Rows of one dim-0 item: FSDP2 chunks dim 0 of the real tensor, so a grouped expert stack
    [E, I, H] seen as (E*I, H) rows is chunked in whole experts (shard_rows = I)."""


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


VllmLayer = Literal["vocab", "replicated", "qkv", "kv_heads", "merged_column", "row", "moe_w13", "moe_w2"]
"""The vLLM layer classes whose tensor-parallel sharding hpcrl.plan.transfer.layout models:

  vocab          VocabParallelEmbedding / ParallelLMHead: rows split after padding the vocabulary
  replicated     norms, ReplicatedLinear: the whole tensor on every rank; several HF tensors are
                 stacked by rows (a MergedColumnParallelLinear with disable_tp, e.g. DeepSeek's
                 fused_qkv_a_proj: hf = q_a_proj, kv_a_proj_with_mqa)
  qkv            QKVParallelLinear: q heads split, k/v heads split or replicated (hf = q, k, v)
  kv_heads       one of QKVParallelLinear's k or v parts alone: the rows of the rank's KV-head block (split,
                 or replicated when tp > num_kv_heads), as vLLM's LoRA slices a k or v lora_B
                 (hpcrl/plan/transfer/lora.py)
  merged_column  MergedColumnParallelLinear: each HF tensor's rows split, stacked (hf = gate, up);
                 one HF tensor: a ColumnParallelLinear
  row            RowParallelLinear: columns split
  moe_w13        FusedMoE w13_weight [experts, 2*I/tp, H]: per expert, gate rows split | up rows split
                 (hf = e0 gate, e0 up, e1 gate, e1 up, ...); under expert parallel whole experts per rank
  moe_w2         FusedMoE w2_weight [experts, H, I/tp]: per expert, columns split (hf = e0 down, e1 down,
                 ...); under expert parallel whole experts per rank
"""


@dataclass(frozen=True, kw_only=True)
class VllmParam:
    """One vLLM parameter: its name, the layer that shards it, and the HF tensors it is loaded from."""

    name: str
    layer: VllmLayer
    hf: tuple[str, ...]
    """HF tensor names, in the order vLLM stacks them (q, k, v; gate, up; each expert's gate, up for
    moe_w13, each expert's down for moe_w2; a replicated stack's); one for the other layers."""
