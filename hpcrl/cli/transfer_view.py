"""`hpcrl plan --transfer`: make, check and summarise the weight-transfer plan of a config.

The plan is the run's own: hpcrl.plan.for_config.plan_for_config, the function every trainer rank,
inference replica and the head call, on the same config (the wire dtype vLLM serves, float32 on
CPU; the run's message and round sizes), so the digest printed first is the one the run logs
("weight transfer plan <digest>: ..."). The predicted sync per transport, per trainer rank and per
inference GPU, is hpcrl.plan.transfer.speed's, at the bandwidths it states (--link-gbps and
--tcp-gbps set two).
"""

from __future__ import annotations

import json

from hpcrl.config.components import make_components
from hpcrl.config.model_shapes import DTYPE_BYTES, ModelShape
from hpcrl.config.schema import Config
from hpcrl.errors import ConfigError
from hpcrl.plan.for_config import describe_plan, plan_for_config
from hpcrl.plan.transfer.baselines import baseline_bytes_per_rank
from hpcrl.plan.transfer.check import check_plan
from hpcrl.plan.transfer.layout import vllm_layout
from hpcrl.plan.transfer.speed import Bandwidths, SyncPrediction, host_round_trip_warning, predict_sync


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n:.0f} B"


def _sec(s: float) -> str:
    """Seconds in s, ms below 0.1 s, us below 0.1 ms."""
    if s >= 0.1 or s == 0:
        return f"{s:.4g} s"
    return f"{s * 1e3:.4g} ms" if s >= 1e-4 else f"{s * 1e6:.4g} us"


def _predictions(config: Config, sent: list[int], received: list[int], bandwidths: Bandwidths) -> list[SyncPrediction]:
    inference = next(c for c in make_components(config) if c.name == "inference")
    return predict_sync(sent_per_trainer_rank=sent, received_per_inference_rank=received,
                        trainer_ranks_per_node=config.trainer.ranks_on_each_node,
                        inference_ranks_per_node=inference.tasks_per_node * config.inference.tensor_parallel,
                        trainer_on_gpus=config.trainer.gpus_per_node > 0,
                        inference_on_gpus=config.inference.gpus_per_node > 0, bandwidths=bandwidths)


def transfer_summary(config: Config, shape: ModelShape, *, link_gbps: float, tcp_gbps: float = 25.0) -> dict:
    """The checked plan of `config` (the run's: plan_for_config), as a JSON-able summary; `shape` is the
    config's model, as load_config_and_shape read it."""
    for flag, value, example in (("--link-gbps", link_gbps, 400), ("--tcp-gbps", tcp_gbps, 25)):
        if value <= 0:
            raise ConfigError(key=flag, problem=f"must be positive, got {value}", fix=f"e.g. {flag} {example}")
    t, inf = config.trainer, config.inference
    plan = plan_for_config(config, shape)
    trainer, inf_layout = plan.trainer, plan.inference
    check_plan(plan)
    stats = plan.stats()
    minimum = max(stats.minimum_per_tp_rank)
    baselines = baseline_bytes_per_rank(shape, inf.tensor_parallel, DTYPE_BYTES[plan.wire_dtype])
    link = link_gbps * 1e9 / 8
    bandwidths = Bandwidths(infiniband_per_gpu=link, ethernet_per_node=tcp_gbps * 1e9 / 8)
    predictions = _predictions(config, stats.sent_per_trainer_rank, stats.received_per_inference_rank, bandwidths)
    lora = None
    if inf_layout.lora_rank:  # what a full-weight sync of the same layouts would move at the least
        dests, _ = vllm_layout(shape, inf.tensor_parallel, inf_layout.vocab_padding,
                               expert_parallel=inf_layout.expert_parallel, expert_placement=inf_layout.expert_placement)
        full = max(sum(d.real_rows[r] * d.local_shape[1] for d in dests) for r in range(inf.tensor_parallel))
        lora = {"rank": inf_layout.lora_rank, "targets": list(inf_layout.lora_targets), "adapter_tensors": len(plan.sources),
                "full_weights_minimum_bytes_per_tp_rank": full * plan.itemsize,
                "full_weights_sync_s": full * plan.itemsize / link_gbps / 1e9 * 8}
    return {
        "headline": describe_plan(plan),
        "lora": lora,
        "digest": plan.digest, "wire_dtype": plan.wire_dtype, "blocks": stats.blocks, "messages": stats.messages,
        "bucket_bytes": plan.bucket_bytes, "round_bytes": plan.round_bytes,
        "trainer": {"dp_replicate": trainer.dp_replicate, "dp_shard": trainer.dp_shard,
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
        "weight_transport": {"configured": inf.weight_transport, "resolved": config.weight_transport},
        "warning": host_round_trip_warning(config),
        "on_gpus": {"trainer": t.gpus_per_node > 0, "inference": inf.gpus_per_node > 0},
        "bandwidths": {"bytes_per_s": {"infiniband_per_gpu": bandwidths.infiniband_per_gpu,
                                       "nvlink_per_gpu": bandwidths.nvlink_per_gpu, "pcie": bandwidths.pcie,
                                       "ethernet_per_node": bandwidths.ethernet_per_node}},
        "transports": {p.label: {"transport": p.transport, "path": p.path, "trainer_rank_s": list(p.trainer_rank_s),
                                 "inference_rank_s": list(p.inference_rank_s), "sync_s": p.sync_s,
                                 "same_node_only": p.same_node_only} for p in predictions},
    }


def _transport_table(s: dict) -> list[str]:
    """Per trainer rank and per inference GPU: bytes and seconds over each transport; then the figures used."""
    sent, recv = s["trainer"]["sent_bytes"], s["inference"]["received_bytes"]
    preds = s["transports"]
    inference_unit = "GPU" if s["on_gpus"]["inference"] else "rank"
    cpu = {side: "" if s["on_gpus"][side] else ", CPU" for side in ("trainer", "inference")}

    def size(values: list[int]) -> str:
        return _size(max(values)) if min(values) == max(values) else f"<= {_size(max(values))}"

    rows = [(f"per trainer rank (x{len(sent)}{cpu['trainer']})", size(sent), "trainer_rank_s"),
            (f"per inference {inference_unit} (x{len(recv)}{cpu['inference']})", size(recv), "inference_rank_s"),
            ("sync", "", "sync_s")]
    first = max(len(r[0]) for r in rows)
    cols = {label: [_sec(max(p[key]) if isinstance(p[key], list) else p[key]) for _, _, key in rows]
            for label, p in preds.items()}
    width = {label: max(len(label), *(len(v) for v in values)) for label, values in cols.items()}
    lines = ["  predicted sync per transport (every rank at once, at the bandwidths below; the slowest sets the sync):",
             f"    {'':<{first}}  {'bytes':>10}  " + "  ".join(f"{label:>{width[label]}}" for label in cols)]
    for i, (name, nbytes, _) in enumerate(rows):
        lines.append(f"    {name:<{first}}  {nbytes:>10}  " + "  ".join(f"{v[i]:>{width[label]}}"
                                                                    for label, v in cols.items()))
    key_width = max(len(label) for label in preds)
    lines += [f"    {label:<{key_width}}  {p['path']}" for label, p in preds.items()]
    if "nccl-nvlink" in preds:
        lines.append("  trainer and inference run on nodes of their own in the hetjob: NCCL goes over InfiniBand; "
                     "NVLink only joins GPUs of one node")
    wt = s["weight_transport"]
    lines.append(f"  this run: {wt['resolved']} (inference.weight_transport = \"{wt['configured']}\"), "
                 f"predicted {_sec(preds[wt['resolved']]['sync_s'])}")
    if s["warning"]:
        lines.append(f"  warning: {s['warning']}")
    return lines


def render_transfer(s: dict) -> str:
    t, inf = s["trainer"], s["inference"]
    sent, recv = t["sent_bytes"], inf["received_bytes"]
    lines = [
        s["headline"],
        f"  {s['blocks']:,} blocks in {s['messages']:,} messages of {_size(s['bucket_bytes'])} (+ at most one row), "
        f"staged in rounds of {_size(s['round_bytes'])}; checked: every destination element written exactly once",
        f"  per trainer rank:   sends {_size(min(sent))} .. {_size(max(sent))} (share {_size(t['share_bytes'])})",
        f"  per inference rank: receives {_size(min(recv))} .. {_size(max(recv))}, "
        f"minimum {_size(min(inf['minimum_bytes_per_tp_rank']))} .. {_size(max(inf['minimum_bytes_per_tp_rank']))}",
        f"  bytes vs minimum: {s['ratio_to_minimum']:.2f}x  (vLLM NCCL engine {s['baselines_ratio']['vllm-nccl']:.1f}x, "
        f"M2N engine {s['baselines_ratio']['vllm-m2n']:.1f}x)",
        f"  predicted sync at {s['link_gbps']:g} Gbit/s per GPU: {s['predicted_sync_s']:.4g} s "
        f"(vLLM NCCL {s['baselines_sync_s']['vllm-nccl']:.4g} s, M2N {s['baselines_sync_s']['vllm-m2n']:.4g} s, "
        "receive side)",
    ]
    if s["lora"]:
        lo = s["lora"]
        lines.append(f"  LoRA: only the {lo['adapter_tensors']} adapter tensors move, into vLLM's LoRA slots; the full "
                     f"weights would be at least {_size(lo['full_weights_minimum_bytes_per_tp_rank'])} per inference "
                     f"rank ({_sec(lo['full_weights_sync_s'])} at {s['link_gbps']:g} Gbit/s)")
    return "\n".join(lines + _transport_table(s))


def run_transfer(config: Config, shape: ModelShape, *, link_gbps: float, as_json: bool, tcp_gbps: float = 25.0) -> int:
    summary = transfer_summary(config, shape, link_gbps=link_gbps, tcp_gbps=tcp_gbps)
    print(json.dumps(summary, indent=2) if as_json else render_transfer(summary))
    return 0
