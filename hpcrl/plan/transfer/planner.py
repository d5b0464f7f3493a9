"""The resharding planner: FSDP2 shards on the trainer -> vLLM tensor-parallel parameters.

    plan(trainer_layout, inference_layout, shape) -> TransferPlan

Pure and deterministic. For every HF weight it intersects three row maps: the vLLM segments of
each TP rank (layout.vllm_layout), the pieces of the trainer tensors that hold those
rows (names), and each dp_shard rank's torch.chunk row range. Each intersection is one
strided block (rows of one segment's column range); contiguous blocks are coalesced. Layers
share one template (the blocks of layer 0, re-labelled per layer with numpy), so a 70B plan
costs about as much as a 1-layer one.

Which trainer rank feeds which replica: every element has one holder per HSDP replicate group;
inference rank (replica j, TP rank r) reads from group (j + r) % dp_replicate. With several groups
the replicas are fed in parallel by different trainer ranks, and when dp_replicate divides the
replicas each group serves every TP rank equally often, so every trainer rank sends
(replicas / dp_replicate) x its shard: its share of the total. With fewer replicas than groups,
the TP ranks of one replica spread over the groups.
"""

from __future__ import annotations

import functools
import re
from dataclasses import replace

import numpy as np

from hpcrl.config.model_shapes import ModelShape
from hpcrl.errors import PlanError
from hpcrl.plan.transfer.layout import InferenceLayout, Segment, TrainerLayout, chunk_source_rows, vllm_layout
from hpcrl.plan.transfer.lora import lora_dims, lora_params, lora_sources
from hpcrl.plan.transfer.names import Piece, trainer_sources
from hpcrl.plan.transfer.plan import COLUMNS, WIRE_DTYPE_BYTES, TransferPlan

#: Default message size: 64 MiB, large enough for full link speed, small enough to pipeline.
DEFAULT_BUCKET_BYTES = 64 << 20
_LAYER = re.compile(r"layers\.(\d+)\.")
#: Each source's FSDP row ranges, asked once per piece: cached (a 235B MoE has thousands of pieces).
_chunks = functools.lru_cache(maxsize=4096)(chunk_source_rows)
# Template columns before a replica is chosen: shard, tp_rank, then COLUMNS[3:11].
_T_SHARD, _T_TP, _T_SOURCE, _T_DEST = 0, 1, 2, 3


def _abstract(name: str) -> tuple[str, int]:
    m = _LAYER.search(name)
    if not m:
        return name, -1
    return name[:m.start()] + "layers.{}." + name[m.end():], int(m.group(1))


def _blocks_of(segments: list[tuple[int, Segment]], pieces: list[Piece], src_shape: dict[str, tuple[int, int]],
               dst_cols: dict[str, int], shards: int, src_unit: dict[str, int]) -> list[tuple]:
    """Blocks (shard, tp, source name, dest name, src_off, src_stride, dst_off, dst_stride, length, count)."""
    out = []
    for tp, seg in segments:
        cl = dst_cols[seg.dest]
        if seg.col1 - seg.col0 != cl:
            raise PlanError(f"internal: segment of {seg.hf_name} is {seg.col1 - seg.col0} columns wide, "
                            f"{seg.dest} has {cl}")
        for pc in pieces:
            lo, hi = max(seg.hf_row0, pc.hf_row0), min(seg.hf_row1, pc.hf_row0 + pc.count)
            if lo >= hi:
                continue
            rows, cols = src_shape[pc.source]
            ranges = _chunks(rows, shards, src_unit[pc.source])
            size = ranges[0][1] - ranges[0][0]
            k0, k1 = lo - pc.hf_row0, hi - pc.hf_row0  # piece indices
            first = pc.src_row0 + k0 * pc.src_step
            last = pc.src_row0 + (k1 - 1) * pc.src_step
            for shard in range(first // size, last // size + 1):
                a, b = ranges[shard]
                # piece indices k with a <= src_row0 + k*step < b
                ka = max(k0, -(-(a - pc.src_row0) // pc.src_step))
                kb = min(k1, -(-(b - pc.src_row0) // pc.src_step))
                if ka >= kb:
                    continue
                src_row = pc.src_row0 + ka * pc.src_step
                dst_row = seg.dst_row0 + pc.hf_row0 + ka - seg.hf_row0
                length, count = seg.col1 - seg.col0, kb - ka
                src_stride, dst_stride = pc.src_step * cols, cl
                if count > 1 and src_stride == length and dst_stride == length:
                    length, count = length * count, 1
                if count == 1:
                    src_stride = dst_stride = length
                out.append((shard, tp, pc.source, seg.dest, (src_row - a) * cols + seg.col0, src_stride,
                            dst_row * cl, dst_stride, length, count))
    out.sort(key=lambda b: (b[1], b[3], b[6]))
    merged: list[tuple] = []
    for blk in out:  # merge contiguous neighbours (same shard, source, dest; both sides adjacent)
        if merged:
            p = merged[-1]
            if (p[:4] == blk[:4] and p[9] == 1 and blk[9] == 1 and p[4] + p[8] == blk[4]
                    and p[6] + p[8] == blk[6]):
                n = p[8] + blk[8]
                merged[-1] = p[:5] + (n, p[6], n, n, 1)
                continue
        merged.append(blk)
    return merged


def plan(trainer: TrainerLayout, inference: InferenceLayout, shape: ModelShape, *,
         wire_dtype: str = "bfloat16", bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> TransferPlan:
    """The transfer plan from `trainer`'s FSDP shards to every replica's vLLM TP shards."""
    if wire_dtype not in WIRE_DTYPE_BYTES:
        raise PlanError(f"wire dtype {wire_dtype!r} is unknown; use one of {', '.join(WIRE_DTYPE_BYTES)}")
    if bucket_bytes < WIRE_DTYPE_BYTES[wire_dtype]:
        raise PlanError(f"bucket_bytes = {bucket_bytes} is smaller than one element")
    tp, shards = inference.tensor_parallel, trainer.dp_shard
    if inference.replicas >= 1 << 12 or tp >= 1 << 10 or trainer.world_size >= 1 << 17:
        raise PlanError(f"plan too large to index: {trainer.world_size} trainer ranks, {inference.replicas} "
                        f"replicas, TP {tp} (limits 2^17, 2^12, 2^10)")
    if trainer.dp_replicate == 1 and inference.replicas > 1:  # every replica reads the same ranks: plan one, copy it
        one = plan(trainer, replace(inference, replicas=1), shape, wire_dtype=wire_dtype, bucket_bytes=bucket_bytes)
        return replace(one, inference=inference, blocks=_replicate(one.blocks, inference.replicas))
    if inference.lora_rank:  # only the adapters move, into vLLM's LoRA slots (hpcrl/plan/transfer/lora.py)
        rank, targets = inference.lora_rank, inference.lora_targets
        sources, pieces = lora_sources(shape, rank, targets)
        dests, segs = vllm_layout(shape, tp, params=lora_params(shape, rank, targets),
                                  dims=lora_dims(shape, rank, targets))
    else:
        dests, segs = vllm_layout(shape, tp, inference.vocab_padding, expert_parallel=inference.expert_parallel,
                                  expert_placement=inference.expert_placement)
        sources, pieces = trainer_sources(shape, grouped_experts=trainer.grouped_experts)
    src_unit = {s.name: s.shard_rows for s in sources}
    src_index = {s.name: i for i, s in enumerate(sources)}
    dst_index = {d.name: i for i, d in enumerate(dests)}
    src_shape = {s.name: s.shape for s in sources}
    dst_cols = {d.name: d.local_shape[1] for d in dests}

    by_hf: dict[str, list[tuple[int, Segment]]] = {}
    for r in range(tp):
        for seg in segs[r]:
            by_hf.setdefault(seg.hf_name, []).append((r, seg))
    # One template per abstract HF name; layers re-label it.
    templates: dict[str, tuple[np.ndarray, list[str], list[str]]] = {}
    layers_of: dict[str, list[int]] = {}
    for hf_name in by_hf:
        key, layer = _abstract(hf_name)
        layers_of.setdefault(key, []).append(layer)
        if key in templates:
            continue
        blocks = _blocks_of(by_hf[hf_name], pieces[hf_name], src_shape, dst_cols, shards, src_unit)
        names_s = sorted({b[2] for b in blocks})
        names_d = sorted({b[3] for b in blocks})
        arr = np.array([(b[0], b[1], names_s.index(b[2]), names_d.index(b[3])) + b[4:] for b in blocks],
                       dtype=np.int64).reshape(-1, 10)
        templates[key] = (arr, [_abstract(n)[0] for n in names_s], [_abstract(n)[0] for n in names_d])

    parts = []
    for key, (arr, names_s, names_d) in templates.items():
        layers = layers_of[key]
        fill = (lambda n, layer: n.format(layer)) if layers[0] >= 0 else (lambda n, layer: n)
        try:
            smap = np.array([[src_index[fill(n, layer)] for n in names_s] for layer in layers], np.int64)
            dmap = np.array([[dst_index[fill(n, layer)] for n in names_d] for layer in layers], np.int64)
        except KeyError as err:
            raise PlanError(f"internal: a layer lacks tensor {err.args[0]}") from None
        a = np.tile(arr, (len(layers), 1))
        which = np.repeat(np.arange(len(layers)), len(arr))
        a[:, _T_SOURCE] = smap[which, a[:, _T_SOURCE]]
        a[:, _T_DEST] = dmap[which, a[:, _T_DEST]]
        parts.append(a)
    template = np.concatenate(parts) if parts else np.zeros((0, 10), np.int64)

    # Rows of one replica; every replica reads the same template from its HSDP group.
    n, reps = len(template), inference.replicas
    replica = np.repeat(np.arange(reps, dtype=np.int64), n)
    tiled = {name: np.tile(template[:, i], reps) for i, name in enumerate(COLUMNS[2:11], start=1)}
    group = (replica + tiled["tp_rank"]) % trainer.dp_replicate
    c = {"src_rank": group * shards + np.tile(template[:, _T_SHARD], reps), "replica": replica, **tiled}
    # Stable sort by route then destination tensor; the template is already ordered by destination
    # offset within each (tp rank, destination) (q before k before v, gate before up).
    route_key = (((c["src_rank"] << 12 | c["replica"]) << 10 | c["tp_rank"]) << 24) | c["dest"]
    order = np.argsort(route_key, kind="stable")
    c = {k: v[order] for k, v in c.items()}
    c = _bucket(c, max(1, bucket_bytes // WIRE_DTYPE_BYTES[wire_dtype]))
    model = (f"{shape.architecture} h{shape.hidden_size} f{shape.intermediate_size} L{shape.num_layers} "
             f"heads {shape.num_heads}/{shape.num_kv_heads}x{shape.head_dim} vocab {shape.vocab_size}"
             f"{' tied' if shape.tie_embeddings else ''}{' qkv_bias' if shape.qkv_bias else ''}"
             f"{' qk_norm' if shape.qk_norm else ''}{_experts(shape)}")
    return TransferPlan(trainer=trainer, inference=inference, model=model, wire_dtype=wire_dtype,
                        bucket_bytes=bucket_bytes, sources=tuple(sources), dests=tuple(dests), blocks=c)


def _replicate(one: dict[str, np.ndarray], reps: int) -> dict[str, np.ndarray]:
    """The blocks of `reps` replicas from one replica's (sorted by source rank, cut into messages), when
    every replica reads the same trainer ranks (no HSDP): as the general path orders them (by source
    rank, then replica, then TP rank and destination) and numbers their messages, without sorting and
    cutting reps times the blocks (Kimi-K2 to 6 replicas: 7.9 M blocks)."""
    m = len(one["src_rank"])
    if not m:
        return {**one, "replica": one["replica"][:0]}
    first = np.flatnonzero(np.r_[True, one["src_rank"][1:] != one["src_rank"][:-1]])  # each source rank's run
    length = np.diff(np.r_[first, m])
    msg0 = one["message"][first]
    msgs = np.r_[msg0[1:], one["message"][-1] + 1] - msg0  # messages never span two source ranks
    span = reps * length
    group = np.repeat(np.arange(len(first)), span)
    within = np.arange(int(span.sum())) - np.repeat(np.cumsum(span) - span, span)
    replica = within // length[group]
    pos = first[group] + within % length[group]
    out = {k: v[pos] for k, v in one.items() if k not in ("replica", "message")}
    out["replica"] = replica
    out["message"] = (np.cumsum(reps * msgs) - reps * msgs)[group] + replica * msgs[group] + one["message"][pos] - msg0[group]
    return {k: out[k] for k in one}


def _experts(shape: ModelShape) -> str:
    """The MoE part of the plan's model summary ('' for a dense model, so dense digests are unchanged)."""
    experts = getattr(shape, "num_experts", 0)
    if not experts:
        return ""
    return (f" experts {experts} top{getattr(shape, 'num_experts_per_tok', 0)}"
            f" moe_f{getattr(shape, 'moe_intermediate_size', 0)}")


def _bucket(c: dict[str, np.ndarray], bucket: int) -> dict[str, np.ndarray]:
    """Cut blocks where a route's element stream crosses a multiple of `bucket`; number messages.

    A cut falls on the first whole unit (row of a strided block, element of a contiguous one)
    past the boundary, so a message holds at most `bucket` elements plus one row.
    """
    n_blocks = len(c["src_rank"])
    if not n_blocks:
        return {**c, "message": np.zeros(0, np.int64)}
    key = (c["src_rank"] << 40) | (c["replica"] << 20) | c["tp_rank"]
    new_route = np.ones(n_blocks, bool)
    new_route[1:] = key[1:] != key[:-1]
    elems = c["length"] * c["count"]
    ends = np.cumsum(elems)
    starts = ends - elems
    route_start = np.maximum.accumulate(np.where(new_route, starts, 0))
    e0 = starts - route_start
    contiguous = c["count"] == 1
    unit = np.where(contiguous, 1, c["length"])
    units = np.where(contiguous, c["length"], c["count"])
    m_first = e0 // bucket + 1
    m_last = (e0 + elems - 1) // bucket
    nb = np.maximum(0, m_last - m_first + 1)
    idx = np.repeat(np.arange(n_blocks), nb)
    within = np.arange(len(idx)) - np.repeat(np.cumsum(nb) - nb, nb)
    cut = -(-((m_first[idx] + within) * bucket - e0[idx]) // unit[idx])
    keep = (cut > 0) & (cut < units[idx])
    points_idx = np.concatenate([np.arange(n_blocks), idx[keep]])
    points = np.concatenate([np.zeros(n_blocks, np.int64), cut[keep]])
    order = np.lexsort((points, points_idx))
    points_idx, points = points_idx[order], points[order]
    dup = np.zeros(len(points), bool)
    dup[1:] = (points_idx[1:] == points_idx[:-1]) & (points[1:] == points[:-1])
    points_idx, points = points_idx[~dup], points[~dup]
    last = np.ones(len(points), bool)
    last[:-1] = points_idx[1:] != points_idx[:-1]
    nxt = np.where(last, units[points_idx], np.roll(points, -1))
    b, u0, nu = points_idx, points, nxt - points
    out = {k: v[b].copy() for k, v in c.items()}
    cont = contiguous[b]
    out["src_offset"] += np.where(cont, u0, u0 * c["src_stride"][b])
    out["dst_offset"] += np.where(cont, u0, u0 * c["dst_stride"][b])
    out["length"] = np.where(cont, nu, c["length"][b])
    out["src_stride"] = np.where(cont, nu, c["src_stride"][b])
    out["dst_stride"] = np.where(cont, nu, c["dst_stride"][b])
    out["count"] = np.where(cont, 1, nu)
    msg_in_route = (e0[b] + u0 * unit[b]) // bucket
    route_id = np.cumsum(new_route) - 1
    pair = np.column_stack([route_id[b], msg_in_route])
    change = np.ones(len(b), bool)
    change[1:] = np.any(pair[1:] != pair[:-1], axis=1)
    out["message"] = np.cumsum(change) - 1
    return out
