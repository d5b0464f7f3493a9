"""Proofs about a transfer plan, independent of how the planner made it.

`check_plan(plan)` (any size; vectorised, about a second for 70B):
  - every run reads inside the sender's local FSDP shard (torch.chunk size) and writes inside the
    receiver's parameter, in rows a transfer must write (never vLLM's vocab padding);
  - per (replica, TP rank, parameter) the written intervals tile the parameter's real elements
    exactly: every destination element is written exactly once, so every byte sent is needed;
  - messages are numbered in order, each within one route.

`verify_elements(plan, shape)` (small shapes): runs the plan on index values. Each trainer
shard is filled with the HF identity (tensor, row, column) of its elements, computed by a
separate re-implementation of torchtitan's permutation and torch.chunk; each vLLM rank's
expected parameters are built the way vLLM's weight loaders build them (narrow + concatenate,
zero padding); the plan must reproduce them element for element.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

from hpcrl.config.model_shapes import ModelShape
from hpcrl.errors import PlanError
from hpcrl.models.lora import HEAD_TARGET, adapter_parameters
from hpcrl.plan.transfer.layout import chunk_source_rows, pad_vocab_size
from hpcrl.plan.transfer.plan import TransferPlan


def _runs(plan: TransferPlan, side: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(block index, start, length) of every contiguous run on `side` ('src' or 'dst')."""
    b = plan.blocks
    off, stride, length, count = b[f"{side}_offset"], b[f"{side}_stride"], b["length"], b["count"]
    dense = (count == 1) | (stride == length)
    idx_dense = np.nonzero(dense)[0]
    idx_sparse = np.nonzero(~dense)[0]
    rep = np.repeat(idx_sparse, count[idx_sparse])
    within = np.arange(len(rep)) - np.repeat(np.cumsum(count[idx_sparse]) - count[idx_sparse], count[idx_sparse])
    idx = np.concatenate([idx_dense, rep])
    start = np.concatenate([off[idx_dense], off[rep] + within * stride[rep]])
    size = np.concatenate([length[idx_dense] * count[idx_dense], length[rep]])
    return idx, start, size


def _fail(plan: TransferPlan, block: int, problem: str) -> PlanError:
    b = plan.blocks
    return PlanError(f"transfer plan {plan.digest[:12]}: {problem} (block {block}: trainer rank "
                     f"{b['src_rank'][block]} -> replica {b['replica'][block]} TP rank {b['tp_rank'][block]}, "
                     f"{plan.sources[b['source'][block]].name} -> {plan.dests[b['dest'][block]].name})")


def check_plan(plan: TransferPlan) -> None:
    """Raise PlanError naming the block, ranks and tensors unless the plan is exact (see module doc)."""
    b = plan.blocks
    n = plan.num_blocks
    if n == 0:
        raise PlanError("transfer plan has no blocks")
    tp = plan.inference.tensor_parallel
    for name in ("length", "count"):
        bad = np.nonzero(b[name] < 1)[0]
        if len(bad):
            raise _fail(plan, int(bad[0]), f"{name} {b[name][bad[0]]} < 1")
    for name, limit in (("src_rank", plan.trainer.world_size), ("replica", plan.inference.replicas),
                        ("tp_rank", tp), ("source", len(plan.sources)), ("dest", len(plan.dests))):
        bad = np.nonzero((b[name] < 0) | (b[name] >= limit))[0]
        if len(bad):
            raise _fail(plan, int(bad[0]), f"{name} {b[name][bad[0]]} out of range [0, {limit})")
    # Source bounds: inside the sender's local shard; runs of a block do not overlap.
    shard = b["src_rank"] % plan.trainer.dp_shard
    numel = np.zeros((len(plan.sources), plan.trainer.dp_shard), np.int64)
    for i, s in enumerate(plan.sources):
        numel[i] = [(e - a) * s.shape[1] for a, e in chunk_source_rows(s.shape[0], plan.trainer.dp_shard, s.shard_rows)]
    src_end = b["src_offset"] + (b["count"] - 1) * b["src_stride"] + b["length"]
    bad = np.nonzero((b["src_offset"] < 0) | (src_end > numel[b["source"], shard])
                     | ((b["count"] > 1) & (b["src_stride"] < b["length"])))[0]
    if len(bad):
        raise _fail(plan, int(bad[0]), "reads outside the sender's local shard")
    # Destination: runs tile [0, real elements) of each (replica, tp rank, dest) exactly once.
    real = np.array([[d.real_rows[r] * d.local_shape[1] for r in range(tp)] for d in plan.dests], np.int64)
    idx, start, size = _runs(plan, "dst")
    group = (b["replica"][idx] * tp + b["tp_rank"][idx]) * len(plan.dests) + b["dest"][idx]
    span = int(start.max()) + 1
    if int(group.max()) < np.iinfo(np.int64).max // span:  # one int64 key: ~4x faster than lexsort
        order = np.argsort(group * span + start, kind="stable")
    else:
        order = np.lexsort((start, group))
    idx, start, size, group = idx[order], start[order], size[order], group[order]
    first = np.ones(len(idx), bool)
    first[1:] = group[1:] != group[:-1]
    expected_start = np.where(first, 0, np.roll(start + size, 1))
    bad = np.nonzero(start != expected_start)[0]
    if len(bad):
        i = int(bad[0])
        what = "leaves elements unwritten before" if start[i] > expected_start[i] else "writes twice at"
        raise _fail(plan, int(idx[i]), f"{what} element {min(start[i], expected_start[i])} of the destination")
    last = np.ones(len(idx), bool)
    last[:-1] = first[1:]
    limit = real[b["dest"][idx], b["tp_rank"][idx]]
    bad = np.nonzero(last & (start + size != limit))[0]
    if len(bad):
        i = int(bad[0])
        problem = "writes padding or past the end" if start[i] + size[i] > limit[i] else "leaves the tail unwritten"
        raise _fail(plan, int(idx[i]), f"{problem}: ends at {start[i] + size[i]}, {limit[i]} elements to write")
    covered = np.zeros((plan.inference.replicas * tp, len(plan.dests)), bool)
    covered[(b["replica"] * tp + b["tp_rank"]), b["dest"]] = True
    missing = np.argwhere(~covered & (real[:, np.arange(plan.inference.replicas * tp) % tp].T > 0))
    if len(missing):
        rank, dest = (int(x) for x in missing[0])
        raise PlanError(f"transfer plan {plan.digest[:12]}: nothing writes {plan.dests[dest].name} on replica "
                        f"{rank // tp} TP rank {rank % tp}")
    # Messages: non-decreasing, never shared by two routes.
    msg = b["message"]
    step = np.diff(msg)
    route_change = (np.diff(b["src_rank"]) != 0) | (np.diff(b["replica"]) != 0) | (np.diff(b["tp_rank"]) != 0)
    bad = np.nonzero((step < 0) | (step > 1) | (route_change & (step != 1)))[0]
    if len(bad) or msg[0] != 0:
        raise _fail(plan, int(bad[0]) + 1 if len(bad) else 0, "messages are not numbered in route order")


# ---- element-level verification (small shapes) -------------------------------------------


def _hf_ids(shape: ModelShape) -> dict[str, np.ndarray]:
    """Every HF tensor filled with globally unique ids (2-D, 1-D as one column)."""
    out, base = {}, 0
    for name, dims in shape.hf_parameters():
        rows, cols = dims[0], (dims[1] if len(dims) == 2 else 1)
        out[name] = np.arange(base, base + rows * cols, dtype=np.int64).reshape(rows, cols)
        base += rows * cols
    return out


_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")


def _experts(hf: dict[str, Any]) -> dict[str, dict[str, list[Any]]]:
    """prefix ("model.layers.3.mlp.experts.") -> projection -> the experts' tensors, in expert order."""
    out: dict[str, dict[str, list[Any]]] = {}
    for name, w in hf.items():
        m = _EXPERT.match(name)
        if m:
            lst = out.setdefault(m.group(1), {}).setdefault(m.group(3), [])
            assert int(m.group(2)) == len(lst), name
            lst.append(w)
    return out


def _trainer_tensors(plan: TransferPlan, shape: ModelShape, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = dict(hf)
    if plan.trainer.grouped_experts:  # torchtitan's GroupedExperts: torch.stack over experts
        for prefix, projections in _experts(hf).items():
            for proj, ws in projections.items():
                for e in range(len(ws)):
                    out.pop(f"{prefix}{e}.{proj}_proj.weight", None)
                out[f"{prefix}{proj}_proj.weight"] = np.stack(ws).reshape(-1, ws[0].shape[1])
    return out


def vllm_expected(plan: TransferPlan, shape: ModelShape, hf: dict[str, Any], r: int, *,
                  concat: Callable[[list], Any] = np.concatenate,
                  padded: Callable[[tuple[int, int], Any], Any] = lambda rows_cols, like: np.full(rows_cols, -1, np.int64),
                  ) -> dict[str, Any]:
    """One TP rank's parameters as vLLM's weight loaders would fill them from the HF tensors `hf`:
    numpy arrays here (padding rows -1), or any arrays with their `concat` and `padded(shape, like)`
    (tools/gpu/gpu_check_ranks.py passes torch's, to run it on a GPU at 1B scale)."""
    tp = plan.inference.tensor_parallel
    nh, d = shape.num_heads // tp, shape.head_dim
    reps = tp // shape.num_kv_heads if tp >= shape.num_kv_heads else 1
    nkv = max(1, shape.num_kv_heads // tp)
    out = {}
    for prefix, p in _experts(hf).items():  # FusedMoE's weight_loader, expert by expert
        num = len(p["gate"])
        if plan.inference.expert_parallel:  # determine_expert_map, re-derived: whole experts, no TP split
            if plan.inference.expert_placement == "round_robin":
                mine = list(range(r, num, tp))
            else:
                counts = [num // tp + (1 if k < num % tp else 0) for k in range(tp)]
                mine = list(range(sum(counts[:r]), sum(counts[:r + 1])))
            most = -(-num // tp)
            w13 = [concat([p["gate"][e], p["up"][e]]) for e in mine]
            w2 = [p["down"][e] for e in mine]
            rows13, rows2 = 2 * p["gate"][0].shape[0], p["down"][0].shape[0]
            w13 += [padded((rows13, p["gate"][0].shape[1]), p["gate"][0])] * (most - len(mine))
            w2 += [padded((rows2, p["down"][0].shape[1]), p["down"][0])] * (most - len(mine))
        else:  # _load_w13: narrow gate/up rows to the rank's share; _load_w2: narrow down's columns
            f = p["gate"][0].shape[0] // tp
            w13 = [concat([g[r * f:(r + 1) * f], u[r * f:(r + 1) * f]]) for g, u in zip(p["gate"], p["up"])]
            w2 = [w[:, r * f:(r + 1) * f] for w in p["down"]]
        out[prefix + "routed_experts.w13_weight"] = concat(w13)
        out[prefix + "routed_experts.w2_weight"] = concat(w2)
    for name, w in hf.items():
        if _EXPERT.match(name):
            continue
        if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias",
                          "up_proj.weight")):
            continue
        base = name.rsplit(".", 2)[0] + "."
        if name.endswith("kv_a_proj_with_mqa.weight") and base + "q_a_proj.weight" in hf:
            continue  # stacked after q_a_proj below
        if name.endswith("q_a_proj.weight"):  # DeepSeek's fused_qkv_a_proj: both whole on every rank (disable_tp)
            out[base + "fused_qkv_a_proj.weight"] = concat([w, hf[base + "kv_a_proj_with_mqa.weight"]])
        elif name.endswith(("q_b_proj.weight", "kv_b_proj.weight")) or (
                name.endswith("q_proj.weight") and base + "k_proj.weight" not in hf):  # ColumnParallelLinear
            f = w.shape[0] // tp
            out[name] = w[r * f:(r + 1) * f]
        elif name.endswith(("q_proj.weight", "q_proj.bias")):
            kind = name.rsplit(".", 1)[1]
            base = name[: -len("q_proj." + kind)]
            kv_rank = r // reps
            parts = [w[r * nh * d:(r + 1) * nh * d]]
            parts += [hf[f"{base}{x}_proj.{kind}"][kv_rank * nkv * d:(kv_rank + 1) * nkv * d] for x in "kv"]
            out[f"{base}qkv_proj.{kind}"] = concat(parts)
        elif name.endswith("gate_proj.weight"):
            f = w.shape[0] // tp
            up = hf[name.replace("gate_proj", "up_proj")]
            out[name.replace("gate_proj", "gate_up_proj")] = concat([w[r * f:(r + 1) * f], up[r * f:(r + 1) * f]])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            k = w.shape[1] // tp
            out[name] = w[:, r * k:(r + 1) * k]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            per = pad_vocab_size(w.shape[0], plan.inference.vocab_padding) // tp
            local = padded((per, w.shape[1]), w)
            part = w[r * per:(r + 1) * per]
            local[:len(part)] = part
            out[name] = local
        else:
            out[name] = w
    return out


#: vLLM's packed_modules_mapping of the dense families (llama.py, qwen2.py ...): an HF projection's LoRA layer and slice.
_PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _lora_ids(plan: TransferPlan, shape: ModelShape) -> dict[str, np.ndarray]:
    """Every adapter tensor filled with globally unique ids."""
    out, base = {}, 0
    for name, (rows, cols) in adapter_parameters(shape, plan.inference.lora_rank, plan.inference.lora_targets):
        out[name] = np.arange(base, base + rows * cols, dtype=np.int64).reshape(rows, cols)
        base += rows * cols
    return out


def lora_expected(plan: TransferPlan, shape: ModelShape, adapters: dict[str, Any], r: int) -> dict[str, Any]:
    """One TP rank's LoRA slot tensors as vLLM's LoRA layers' set_lora fills them from PEFT's tensors
    (vllm/lora/layers/: slice_lora_a / slice_lora_b of column- and row-parallel layers), re-derived:
    column-parallel A whole and B's rows of the rank (q heads; k/v the rank's KV-head block; gate/up),
    row-parallel A's columns of the rank and B whole; the lm_head's A and B whole."""
    tp = plan.inference.tensor_parallel
    nh, d = shape.num_heads // tp, shape.head_dim
    kv_rank = r // (tp // shape.num_kv_heads if tp >= shape.num_kv_heads else 1)
    nkv = max(1, shape.num_kv_heads // tp)
    out = {}
    for name, w in adapters.items():
        if not name.endswith(".lora_A.weight"):
            continue
        module = name[: -len(".lora_A.weight")]
        b = adapters[f"{module}.lora_B.weight"]
        parent, _, proj = module.rpartition(".")
        layer, index = _PACKED.get(proj, (proj, 0))
        if module == HEAD_TARGET:  # LogitsProcessorWithLoRA: both whole, registered as "lm_head"
            out[f"{HEAD_TARGET}.lora_a_stacked.0"], out[f"{HEAD_TARGET}.lora_b_stacked.0"] = w, b
            continue
        if proj in ("o_proj", "down_proj"):
            k = w.shape[1] // tp
            a_local, b_local = w[:, r * k:(r + 1) * k], b
        elif proj == "q_proj":
            a_local, b_local = w, b[r * nh * d:(r + 1) * nh * d]
        elif proj in ("k_proj", "v_proj"):
            a_local, b_local = w, b[kv_rank * nkv * d:(kv_rank + 1) * nkv * d]
        else:
            f = b.shape[0] // tp
            a_local, b_local = w, b[r * f:(r + 1) * f]
        out[f"{parent}.{layer}.lora_a_stacked.{index}"] = a_local
        out[f"{parent}.{layer}.lora_b_stacked.{index}"] = b_local
    return out


def verify_elements(plan: TransferPlan, shape: ModelShape) -> None:
    """Run the plan on element ids; raise PlanError naming the first wrong element."""
    lora = plan.inference.lora_rank > 0
    hf = _lora_ids(plan, shape) if lora else _hf_ids(shape)
    trainer = hf if lora else _trainer_tensors(plan, shape, hf)
    shards = plan.trainer.dp_shard
    local = {}
    for s in plan.sources:
        chunks = chunk_source_rows(s.shape[0], shards, s.shard_rows)
        local[s.name] = [trainer[s.name][a:e].reshape(-1) for a, e in chunks]
    tp = plan.inference.tensor_parallel
    b = plan.blocks
    for rep in range(plan.inference.replicas):
        for r in range(tp):
            expected = lora_expected(plan, shape, hf, r) if lora else vllm_expected(plan, shape, hf, r)
            got = {d.name: np.full(d.local_shape, -1, np.int64).reshape(-1) for d in plan.dests}
            for i in np.nonzero((b["replica"] == rep) & (b["tp_rank"] == r))[0]:
                src = local[plan.sources[b["source"][i]].name][b["src_rank"][i] % shards]
                dst = got[plan.dests[b["dest"][i]].name]
                for j in range(b["count"][i]):
                    so, do = b["src_offset"][i] + j * b["src_stride"][i], b["dst_offset"][i] + j * b["dst_stride"][i]
                    dst[do:do + b["length"][i]] = src[so:so + b["length"][i]]
            if lora and set(expected) != {d.name for d in plan.dests}:
                raise PlanError(f"transfer plan {plan.digest[:12]}: plans LoRA slot tensors "
                                f"{sorted({d.name for d in plan.dests} ^ set(expected))[:4]} unlike vLLM's layers")
            for d in plan.dests:
                want = expected[d.name].reshape(-1)
                have = got[d.name]
                if want.shape != have.shape or not np.array_equal(want, have):
                    k = int(np.argmax(want != have)) if want.shape == have.shape else -1
                    raise PlanError(f"transfer plan {plan.digest[:12]}: replica {rep} TP rank {r} {d.name} "
                                    f"element {k}: expected id {want[k] if k >= 0 else want.shape}, "
                                    f"got {have[k] if k >= 0 else have.shape}")
