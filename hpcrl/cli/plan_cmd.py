"""`hpcrl plan CONFIG`: print the resource plan without touching Slurm.

`hpcrl plan --transfer CONFIG [--link-gbps G] [--tcp-gbps G]`: the weight-transfer plan instead, the
very plan the run executes (its digest is the one in the run's log), with bytes per trainer and
inference rank, versus the minimum and vLLM's own engines, and the predicted sync time per
transport at stated bandwidths.
"""

from __future__ import annotations

import argparse
import json

from hpcrl.config.load import load_config_and_shape
from hpcrl.plan import ResourcePlan, plan_resources
from hpcrl.plan.resources import GIB


def add_parser(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "plan", parents=[common], help="print the resource plan of a config (no Slurm needed)",
        description="Print every component with nodes, tasks, GPUs and ranks, the trainer mesh, "
                    "the inference layout, the model size and a per-GPU memory estimate.")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--transfer", action="store_true",
                        help="print the weight-transfer plan (trainer FSDP shards -> vLLM TP shards)")
    parser.add_argument("--link-gbps", type=float, default=400.0, metavar="G",
                        help="with --transfer: InfiniBand bandwidth per GPU in Gbit/s for the predicted sync "
                             "over NCCL (and UCX's RDMA) (default 400, one NDR port = 50 GB/s)")
    parser.add_argument("--tcp-gbps", type=float, default=25.0, metavar="G",
                        help="with --transfer: a node's Ethernet in Gbit/s, shared by its ranks, for the predicted "
                             "sync over gloo (default 25)")
    parser.set_defaults(func=run)


def _size(n: float) -> str:
    """Bytes in GiB, or MiB below one GiB (tiny models)."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.2f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def render_text(plan: ResourcePlan) -> str:
    m = plan.model
    lines = [
        f"run {plan.run_name}: executor {plan.executor}, layout {plan.layout}",
        f"model {m['preset'] or m['path']} ({m['architecture']}): {_count(m['parameters'])} parameters, "
        f"{m['layers']} layers, hidden {m['hidden_size']}, heads {m['heads']}/{m['kv_heads']} KV, "
        f"vocab {m['vocab_size']}; {_size(m['bytes'])} in {m['dtype']}",
        "",
        f"{'component':<10} {'het':>3} {'nodes':>5} {'tasks/node':>10} {'tasks':>5} {'gpus/task':>9} "
        f"{'cpus/task':>9} {'mem/node':>9}  runs",
    ]
    for c in plan.components:
        lines.append(f"{c.name:<10} {c.index:>3} {c.nodes:>5} {c.tasks_per_node:>10} {c.tasks:>5} "
                     f"{c.gpus_per_task:>9} {c.cpus_per_task or '-':>9} {c.mem or '-':>9}  {c.role}")
    lines.append("(each task sees only its own GPUs; '-': Slurm's default, the profile does not say)")
    mesh, inf = plan.trainer_mesh, plan.inference_layout
    lines += [
        "",
        f"trainer mesh: {mesh['world_size']} ranks = dp_replicate {mesh['dp_replicate']} x dp_shard {mesh['dp_shard']}",
        f"inference: {inf['replicas']} replicas x TP {inf['tensor_parallel']}, max_model_len {inf['max_model_len']}, "
        f"KV cache {plan.kv_cache_tokens:,} tokens per replica",
    ]
    for title, est in (("trainer", plan.trainer_memory), ("inference", plan.inference_memory)):
        cap = f" of {_size(est.capacity)}" if est.capacity else " (capacity unknown)"
        verdict = "fits" if est.fits else "DOES NOT FIT"
        lines.append("")
        lines.append(f"{title} memory per {est.device}: {_size(est.total)}{cap}: {verdict}")
        lines += [f"  {name:<20}{_size(size):>12}" for name, size in est.parts.items() if size]
    if plan.notes or plan.warnings:
        lines.append("")
        lines += [f"warning: {w}" for w in plan.warnings] + [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    config, shape = load_config_and_shape(args.config, cluster=args.cluster, overrides=args.set)
    if args.transfer:
        from hpcrl.cli.transfer_view import run_transfer
        return run_transfer(config, shape, link_gbps=args.link_gbps, tcp_gbps=args.tcp_gbps, as_json=args.json)
    plan = plan_resources(config, shape)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(render_text(plan))
    return 0
