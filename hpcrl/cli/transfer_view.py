"""`hpcrl plan --transfer`: make, check and summarise the weight-transfer plan of a config.

The trainer layout comes from [trainer] (dp_replicate x dp_shard, FSDP2 Shard(0)), the inference
layout from [inference] (replicas x tensor_parallel), the wire dtype from [model].dtype.
"""

from __future__ import annotations

import json

from hpcrl.config.model_shapes import DTYPE_BYTES, ModelShape
from hpcrl.config.schema import Config
from hpcrl.errors import ConfigError
from hpcrl.plan.transfer_baselines import baseline_bytes_per_rank
from hpcrl.plan.transfer_check import check_plan
from hpcrl.plan.transfer_layout import InferenceLayout, TrainerLayout
from hpcrl.plan.transfer_planner import plan as plan_transfer


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n:.0f} B"


def transfer_summary(config: Config, shape: ModelShape, *, link_gbps: float, bucket_mib: float) -> dict:
    """The checked plan of `config`, as a JSON-able summary."""
    if link_gbps <= 0:
        raise ConfigError(key="--link-gbps", problem=f"must be positive, got {link_gbps}", fix="e.g. --link-gbps 400")
    t, inf = config.trainer, config.inference
    shard = t.world_size // t.dp_replicate if t.dp_shard == -1 else t.dp_shard
    trainer = TrainerLayout(dp_replicate=t.dp_replicate, dp_shard=shard)
    inference = InferenceLayout(replicas=inf.replicas, tensor_parallel=inf.tensor_parallel)
    plan = plan_transfer(trainer, inference, shape, wire_dtype=config.model.dtype,
                         bucket_bytes=int(bucket_mib * (1 << 20)))
    check_plan(plan)
    stats = plan.stats()
    minimum = max(stats.minimum_per_tp_rank)
    baselines = baseline_bytes_per_rank(shape, inf.tensor_parallel, DTYPE_BYTES[config.model.dtype])
    link = link_gbps * 1e9 / 8
    return {
        "digest": plan.digest, "wire_dtype": plan.wire_dtype, "blocks": stats.blocks, "messages": stats.messages,
        "bucket_bytes": plan.bucket_bytes,
        "trainer": {"dp_replicate": t.dp_replicate, "dp_shard": shard,
                    "sent_bytes": stats.sent_per_trainer_rank,
                    "share_bytes": sum(stats.sent_per_trainer_rank) // trainer.world_size},
        "inference": {"replicas": inf.replicas, "tensor_parallel": inf.tensor_parallel,
                      "received_bytes": stats.received_per_inference_rank,
                      "minimum_bytes_per_tp_rank": stats.minimum_per_tp_rank},
        "ratio_to_minimum": stats.ratio(),
        "baselines_ratio": {k: v / minimum for k, v in baselines.items()},
        "link_gbps": link_gbps,
        "predicted_sync_s": stats.sync_seconds(link),
        "baselines_sync_s": {k: v / link for k, v in baselines.items()},
    }


def render_transfer(s: dict) -> str:
    t, inf = s["trainer"], s["inference"]
    sent, recv = t["sent_bytes"], inf["received_bytes"]
    lines = [
        f"weight transfer plan {s['digest'][:16]}: trainer {t['dp_replicate']} x {t['dp_shard']} (FSDP2 Shard(0)) "
        f"-> {inf['replicas']} replicas x TP {inf['tensor_parallel']}, wire {s['wire_dtype']}",
        f"  {s['blocks']:,} blocks in {s['messages']:,} messages of {_size(s['bucket_bytes'])} (+ at most one row); "
        "checked: every destination element written exactly once",
        f"  per trainer rank:   sends {_size(min(sent))} .. {_size(max(sent))} (share {_size(t['share_bytes'])})",
        f"  per inference rank: receives {_size(min(recv))} .. {_size(max(recv))}, "
        f"minimum {_size(min(inf['minimum_bytes_per_tp_rank']))} .. {_size(max(inf['minimum_bytes_per_tp_rank']))}",
        f"  bytes vs minimum: {s['ratio_to_minimum']:.2f}x  (vLLM NCCL engine {s['baselines_ratio']['vllm-nccl']:.1f}x, "
        f"M2N engine {s['baselines_ratio']['vllm-m2n']:.1f}x)",
        f"  predicted sync at {s['link_gbps']:g} Gbit/s per GPU: {s['predicted_sync_s']:.4g} s "
        f"(vLLM NCCL {s['baselines_sync_s']['vllm-nccl']:.4g} s, M2N {s['baselines_sync_s']['vllm-m2n']:.4g} s, "
        "receive side)",
    ]
    return "\n".join(lines)


def run_transfer(config: Config, shape: ModelShape, *, link_gbps: float, bucket_mib: float, as_json: bool) -> int:
    summary = transfer_summary(config, shape, link_gbps=link_gbps, bucket_mib=bucket_mib)
    print(json.dumps(summary, indent=2) if as_json else render_transfer(summary))
    return 0
