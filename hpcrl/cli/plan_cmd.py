"""`hpcrl plan CONFIG`: print the resource plan without touching Slurm.

`hpcrl plan --transfer CONFIG [--link-gbps G] [--tcp-gbps G]`: the weight-transfer plan instead, the
very plan the run executes (its digest is the one in the run's log), with bytes per trainer and
inference rank, versus the minimum and vLLM's own engines, and the predicted sync time per
transport at stated bandwidths.

Exit codes: 0 the plan fits; 3 (EXIT_DOES_NOT_FIT) the memory estimate says DOES NOT FIT (the plan
is printed all the same, so scripts can test it: `hpcrl plan CONFIG >/dev/null || ...`); 2 the config
is wrong. `hpcrl submit` refuses a plan that does not fit (refuse_unfit_plan) unless
run.ignore_memory_plan = true.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from hpcrl.config.load import load_config_and_shape
from hpcrl.config.schema import Config
from hpcrl.errors import ConfigError, PlanError
from hpcrl.plan import ResourcePlan, plan_resources
from hpcrl.plan.resources import GIB

#: `hpcrl plan`'s exit code when the plan says DOES NOT FIT (0: it fits; 2: an error, such as a wrong config).
EXIT_DOES_NOT_FIT = 3


def add_parser(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "plan", parents=[common], help="print the resource plan of a config (no Slurm needed)",
        description="Print every component with nodes, tasks, GPUs and ranks, the trainer mesh, "
                    "the inference layout, the model size and a per-GPU memory estimate.",
        epilog=f"exit status: 0 when the plan fits, {EXIT_DOES_NOT_FIT} when the memory estimate says DOES NOT FIT "
               "(the plan is printed all the same; `hpcrl submit` refuses it unless "
               "--set run.ignore_memory_plan=true), 2 when the config is wrong.")
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


def _check_bandwidths(args: argparse.Namespace) -> None:
    """--link-gbps and --tcp-gbps: finite numbers above 0 (float() also reads "nan" and "inf", and a nan
    passes every comparison's negation: `nan <= 0` is false)."""
    for flag, value, example in (("--link-gbps", args.link_gbps, 400), ("--tcp-gbps", args.tcp_gbps, 25)):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(file="command line", key=flag, problem=f"must be a finite number of Gbit/s above 0, "
                              f"got {value}", fix=f"e.g. {flag} {example}")


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
    lines.append(f"recovery: {plan.recovery}")
    mesh, inf = plan.trainer_mesh, plan.inference_layout
    lines += [
        "",
        f"trainer mesh: {mesh['world_size']} ranks = dp_replicate {mesh['dp_replicate']} x dp_shard {mesh['dp_shard']}",
        f"inference: {inf['replicas']} replicas x TP {inf['tensor_parallel']}, max_model_len {inf['max_model_len']}, "
        f"KV cache {plan.kv_cache_tokens:,} tokens per replica",
    ]
    for title, est, fits in (("trainer", plan.trainer_memory, plan.trainer_memory.fits),
                             ("inference", plan.inference_memory, plan.inference_fits)):
        cap = f" of {_size(est.capacity)}" if est.capacity else " (capacity unknown)"
        verdict = "fits" if fits else "DOES NOT FIT"
        lines.append("")
        lines.append(f"{title} memory per {est.device}: {_size(est.total)}{cap}: {verdict}")
        lines += [f"  {name:<20}{_size(size):>12}" for name, size in est.parts.items() if size]
    if plan.notes or plan.warnings:
        lines.append("")
        lines += [f"warning: {w}" for w in plan.warnings] + [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def check_data_columns(config, config_path: str) -> None:
    """The data files read as the job's start reads them (hpcrl.data.prompts.check_data: the columns
    data.columns names, every row, ids unique), and a chat format's tokenizer has a template, where this
    machine can read them (a login node may not see the compute nodes' file system: then the job checks at
    its start). Costs what the job's start spends reading the data files (100k rows of ~330 characters:
    4-7 s of JSONL, 4 s of Parquet on a busy 2-core machine) and the read of the tokenizer's files; nothing for
    builtin tasks."""
    from hpcrl.data.chat import prompt_format
    from hpcrl.data.prompts import check_data
    from hpcrl.data.types import DataError
    try:
        check_data(config.data)
    except ConfigError as err:
        raise err.located(file=config_path, line=None) from None
    if config.model.path and Path(config.model.path).is_dir():  # the chat format needs the tokenizer's template
        try:
            prompt_format(config.data, config.model.path)
        except DataError as err:
            raise ConfigError(file=config_path, key="data.format", problem=str(err).split(". Fix: ")[0],
                              fix=str(err).partition(". Fix: ")[2] or "set data.format = \"text\"") from None


def run(args: argparse.Namespace) -> int:
    config, shape = load_config_and_shape(args.config, cluster=args.cluster, overrides=args.set)
    check_data_columns(config, args.config)
    if args.transfer:
        _check_bandwidths(args)
        from hpcrl.cli.transfer_view import run_transfer
        return run_transfer(config, shape, link_gbps=args.link_gbps, tcp_gbps=args.tcp_gbps, as_json=args.json)
    plan = plan_resources(config, shape)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(render_text(plan))
    return 0 if plan.fits else EXIT_DOES_NOT_FIT


def unfit_reasons(config: Config, plan: ResourcePlan) -> list[str]:
    """What does not fit, with the figures and the keys that change it (empty when the plan fits)."""
    reasons = []
    t = plan.trainer_memory
    if not t.fits:
        per = "GPU" if t.device == "GPU" else "CPU node"
        reasons.append(
            f"the trainer needs {t.total / GIB:.1f} GiB per {per}, more than its {t.capacity / GIB:.1f} GiB "
            f"({'cluster.gpu_mem_gib' if t.device == 'GPU' else 'cluster.mem_per_node_gib'}); lower it with more ranks to shard over (trainer.nodes), "
            "trainer.activation_checkpointing = true, a smaller "
            f"{'trainer.micro_batch_tokens' if config.trainer.micro_batch_tokens else 'trainer.micro_batch_size'}, "
            "or shorter sequences "
            "(data.max_prompt_tokens, inference.max_tokens)")
    i = plan.inference_memory
    if not i.fits:
        may_use = ("inference.gpu_memory_utilization x cluster.gpu_mem_gib" if i.device == "GPU"
                   else "cluster.mem_per_node_gib")
        lower = ("inference.kv_cache_gib when it is set" if i.device == "GPU"
                 else "inference.kv_cache_gib or inference.gpu_memory_utilization (the KV cache's share of RAM)")
        reasons.append(
            f"each inference {i.device} needs {i.total / GIB:.1f} GiB, more than the {i.capacity / GIB:.1f} GiB it "
            f"may use ({may_use}); raise inference.tensor_parallel, or lower {lower}")
    max_len = plan.inference_layout["max_model_len"]
    if plan.kv_cache_tokens < max_len:
        reasons.append(
            f"the KV cache of a replica holds {plan.kv_cache_tokens:,} tokens, fewer than one sequence of "
            f"max_model_len {max_len:,} (vLLM refuses to start); raise inference.tensor_parallel, "
            "inference.gpu_memory_utilization or inference.kv_cache_gib, or lower inference.max_tokens")
    return reasons


def refuse_unwritable_run_dir(config: Config, config_path: str) -> None:
    """What submit checks of the run directory beyond load (hpcrl.config.checks.check_run_dir_writable),
    as a ConfigError placed in the config file."""
    from hpcrl.config.checks import check_run_dir_writable
    try:
        check_run_dir_writable(config)
    except ConfigError as err:
        raise err.located(file=config_path, line=None) from None


def refuse_unfit_plan(config: Config, config_path: str) -> None:
    """Refuse to submit a run whose memory plan says DOES NOT FIT (it would fail in its first minutes with an
    out-of-memory error, after waiting in the queue), unless run.ignore_memory_plan = true: the estimate is on
    the safe side (hpcrl.plan.resources), and someone who measured may know better."""
    if config.run.ignore_memory_plan:
        return
    from hpcrl.config.model_shapes import shape_of
    shape = shape_of(config.model)
    reasons = unfit_reasons(config, plan_resources(config, shape))
    if reasons:
        raise PlanError(f"{config_path}: the memory plan says DOES NOT FIT: " + "; ".join(reasons)
                        + f". See `hpcrl plan {config_path}`; to submit anyway, --set run.ignore_memory_plan=true")
