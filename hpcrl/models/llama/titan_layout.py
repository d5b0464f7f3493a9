"""torchtitan's own llama3 naming of the trainer's tensors, for the transfer planner.

torchtitan 0.3.0 llama3 FQNs (torchtitan/models/llama3/state_dict_adapter.py: tok_embeddings,
layers.{i}.attention.qkv_linear.wq/wk/wv, attention.wo, feed_forward.w1/w3/w2, attention_norm,
ffn_norm, norm, lm_head). Its q and k rows are permuted for its RoPE relative to HF: its
`_permute` (to_hf) puts torchtitan row h*d + 2j + a (interleaved pairs) at HF row h*d + a*d/2 + j
(halves), a in {0, 1}, j < d/2. With fuse_qkv (torchtitan/models/common/attention.py,
FusedQKVLinear) one `wqkv` per layer holds, per KV group g, the group's q heads, then k head g,
then v head g (head_dim rows each).

hpcrl's own trainer uses HF names (hpcrl.trainer.titan); this naming is what a stock torchtitan
trainer would send (tests/titan_stock.py builds one).
"""

from __future__ import annotations

from hpcrl.errors import PlanError
from hpcrl.models.layout import Piece, SourceTensor, as2d
from hpcrl.models.shape import ModelShape


def _rope_pieces(hf_row0: int, src_row0: int, heads: int, head_dim: int, source: str) -> list[Piece]:
    """Pieces of `heads` heads whose rows torchtitan permuted for RoPE (see module docstring)."""
    half = head_dim // 2
    out = []
    for h in range(heads):
        for a in (0, 1):
            out.append(Piece(hf_row0=hf_row0 + h * head_dim + a * half, count=half,
                             source=source, src_row0=src_row0 + h * head_dim + a, src_step=2))
    return out


def llama3_titan_layout(shape: ModelShape, *, fuse_qkv: bool) -> tuple[list[SourceTensor], dict[str, list[Piece]]]:
    """torchtitan llama3 names and layouts (see module docstring)."""
    if shape.qkv_bias or shape.qk_norm:
        raise PlanError(f"torchtitan naming is modelled for llama3 without q/k/v biases or q/k norms, "
                        f"not {shape.architecture} with them; set the trainer naming to 'hf'")
    if shape.head_dim % 2:
        raise PlanError(f"torchtitan's RoPE permutation needs an even head_dim, got {shape.head_dim}")
    h, d, nh, nkv = shape.hidden_size, shape.head_dim, shape.num_heads, shape.num_kv_heads
    per_group = nh // nkv
    sources: list[SourceTensor] = []
    pieces: dict[str, list[Piece]] = {}

    def same(hf: str, tt: str, dims: tuple[int, ...]) -> None:
        rows, cols = as2d(dims)
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
