"""Which trainer tensor, and which of its rows, holds each row of each Hugging Face weight.

Two trainer namings:

  hf          the trainer's tensors are the Hugging Face ones, row for row (a transformers
              model under fully_shard; or torchtitan converted through its state-dict adapter).
  torchtitan  torchtitan 0.3.0 llama3 FQNs (torchtitan/models/llama3/state_dict_adapter.py:
              tok_embeddings, layers.{i}.attention.qkv_linear.wq/wk/wv, attention.wo,
              feed_forward.w1/w3/w2, attention_norm, ffn_norm, norm, lm_head). Its q and k rows
              are permuted for its RoPE relative to HF: its `_permute` (to_hf) puts torchtitan
              row h*d + 2j + a (interleaved pairs) at HF row h*d + a*d/2 + j (halves), a in
              {0, 1}, j < d/2. With fuse_qkv
              (torchtitan/models/common/attention.py, FusedQKVLinear) one `wqkv` per layer holds,
              per KV group g, the group's q heads, then k head g, then v head g (head_dim rows each).

A `Piece` is a run of rows: HF row hf_row0 + k is source row src_row0 + k*src_step, for
k < count. Every HF row is in exactly one piece.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.config.model_shapes import ModelShape
from hpcrl.errors import PlanError


@dataclass(frozen=True, kw_only=True)
class SourceTensor:
    """One trainer tensor (before FSDP sharding): name and global (rows, columns)."""

    name: str
    shape: tuple[int, int]


@dataclass(frozen=True, kw_only=True)
class Piece:
    hf_row0: int
    count: int
    source: str
    src_row0: int
    src_step: int = 1


def _as2d(shape: tuple[int, ...]) -> tuple[int, int]:
    return (shape[0], shape[1]) if len(shape) == 2 else (shape[0], 1)


def hf_sources(shape: ModelShape) -> tuple[list[SourceTensor], dict[str, list[Piece]]]:
    """The identity mapping: every HF tensor is a trainer tensor of the same name."""
    sources, pieces = [], {}
    for name, dims in shape.hf_parameters():
        rows, cols = _as2d(dims)
        sources.append(SourceTensor(name=name, shape=(rows, cols)))
        pieces[name] = [Piece(hf_row0=0, count=rows, source=name, src_row0=0)]
    return sources, pieces


def _rope_pieces(hf_row0: int, src_row0: int, heads: int, head_dim: int, source: str) -> list[Piece]:
    """Pieces of `heads` heads whose rows torchtitan permuted for RoPE (see module docstring)."""
    half = head_dim // 2
    out = []
    for h in range(heads):
        for a in (0, 1):
            out.append(Piece(hf_row0=hf_row0 + h * head_dim + a * half, count=half,
                             source=source, src_row0=src_row0 + h * head_dim + a, src_step=2))
    return out


def torchtitan_sources(shape: ModelShape, *, fuse_qkv: bool) -> tuple[list[SourceTensor], dict[str, list[Piece]]]:
    """torchtitan llama3 names and layouts (see module docstring)."""
    if shape.architecture != "LlamaForCausalLM" or shape.qkv_bias or shape.qk_norm:
        raise PlanError(f"torchtitan naming is modelled for llama3 only, not {shape.architecture}; "
                        "set the trainer naming to 'hf'")
    if shape.head_dim % 2:
        raise PlanError(f"torchtitan's RoPE permutation needs an even head_dim, got {shape.head_dim}")
    h, d, nh, nkv = shape.hidden_size, shape.head_dim, shape.num_heads, shape.num_kv_heads
    per_group = nh // nkv
    sources: list[SourceTensor] = []
    pieces: dict[str, list[Piece]] = {}

    def same(hf: str, tt: str, dims: tuple[int, ...]) -> None:
        rows, cols = _as2d(dims)
        sources.append(SourceTensor(name=tt, shape=(rows, cols)))
        pieces[hf] = [Piece(hf_row0=0, count=rows, source=tt, src_row0=0)]

    same("model.embed_tokens.weight", "tok_embeddings.weight", (shape.vocab_size, h))
    for i in range(shape.num_layers):
        p, t = f"model.layers.{i}.", f"layers.{i}."
        same(p + "input_layernorm.weight", t + "attention_norm.weight", (h,))
        if fuse_qkv:
            wqkv = t + "attention.qkv_linear.wqkv.weight"
            sources.append(SourceTensor(name=wqkv, shape=((nh + 2 * nkv) * d, h)))
            q, k, v = [], [], []
            for g in range(nkv):
                base = g * (per_group + 2) * d
                q += _rope_pieces(g * per_group * d, base, per_group, d, wqkv)
                k += _rope_pieces(g * d, base + per_group * d, 1, d, wqkv)
                v.append(Piece(hf_row0=g * d, count=d, source=wqkv, src_row0=base + (per_group + 1) * d))
            pieces[p + "self_attn.q_proj.weight"] = q
            pieces[p + "self_attn.k_proj.weight"] = k
            pieces[p + "self_attn.v_proj.weight"] = v
        else:
            for hf, tt, heads in (("q", "wq", nh), ("k", "wk", nkv)):
                src = f"{t}attention.qkv_linear.{tt}.weight"
                sources.append(SourceTensor(name=src, shape=(heads * d, h)))
                pieces[f"{p}self_attn.{hf}_proj.weight"] = _rope_pieces(0, 0, heads, d, src)
            same(p + "self_attn.v_proj.weight", t + "attention.qkv_linear.wv.weight", (nkv * d, h))
        same(p + "self_attn.o_proj.weight", t + "attention.wo.weight", (h, nh * d))
        same(p + "post_attention_layernorm.weight", t + "ffn_norm.weight", (h,))
        f = shape.intermediate_size
        same(p + "mlp.gate_proj.weight", t + "feed_forward.w1.weight", (f, h))
        same(p + "mlp.up_proj.weight", t + "feed_forward.w3.weight", (f, h))
        same(p + "mlp.down_proj.weight", t + "feed_forward.w2.weight", (h, f))
    same("model.norm.weight", "norm.weight", (h,))
    if not shape.tie_embeddings:
        same("lm_head.weight", "lm_head.weight", (shape.vocab_size, h))
    return sources, pieces


def trainer_sources(shape: ModelShape, *, naming: str, fuse_qkv: bool = True
                    ) -> tuple[list[SourceTensor], dict[str, list[Piece]]]:
    """Trainer tensors and the pieces of every HF row, for the trainer's naming."""
    if naming == "hf":
        return hf_sources(shape)
    return torchtitan_sources(shape, fuse_qkv=fuse_qkv)
