"""Benchmark the resharding planner and the weight transfer; prints markdown for BENCHMARKS.md.

    PYTHONPATH=. python tools/bench/bench_reshard.py                 # everything (a few minutes on 2 cores)
    PYTHONPATH=. python tools/bench/bench_reshard.py --skip-update   # planner and bytes only (seconds)
    PYTHONPATH=. python tools/bench/bench_reshard.py --transport ucx # (3) over UCX (pip install ucxx-cu12)

1. Planner time (best of --repeat) for Llama-3-70B (FSDP 64 -> 4 replicas x TP 8) and Llama-3-8B
   (FSDP 8 -> 4 x TP 2), and the checker's time.
2. Bytes per inference rank versus the minimum for every config in configs/, next to vLLM's NCCL
   engine (full tensors to every rank) and M2N engine (full tensors for fused / vocab-parallel
   parameters), from hpcrl.plan.transfer.baselines.
3. A real update in one run on this machine: a small Llama made here (random weights), vLLM on CPU
   at TP --tp, trainer FSDP2 over --fsdp gloo ranks. Ours: every trainer rank sends its local
   shards straight into the live vLLM parameters (LLM.start_weight_update / update_weights /
   finish_weight_update). Naive: full_tensor() of every parameter on the trainer, rank 0 writes a
   safetensors file to /dev/shm, then the worker's reload_weights via collective_rpc. Median of
   --rounds rounds each, wall time seen by the driver from "go" to "weights live". The model, vLLM
   and the trainer ranks: the harness of tools/bench/weight_sync.py (shared with bench_moe_sync.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def bench_planner(repeat: int) -> list[str]:
    from hpcrl.config.model_shapes import PRESETS
    from hpcrl.plan.transfer.check import check_plan
    from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
    from hpcrl.plan.transfer.planner import plan

    rows = [f"| model | trainer -> inference | blocks | messages | plan (best of {repeat}) | check | digest |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for name, shard, replicas, tp in (("llama3-70b", 64, 4, 8), ("llama3-8b", 8, 4, 2)):
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            p = plan(TrainerLayout(dp_shard=shard), InferenceLayout(replicas=replicas, tensor_parallel=tp), PRESETS[name])
            best = min(best, time.perf_counter() - t0)
        t0 = time.perf_counter()
        check_plan(p)
        check = time.perf_counter() - t0
        t0 = time.perf_counter()
        _ = p.digest  # the property hashes the plan: this line is what is timed
        digest = time.perf_counter() - t0
        stats = p.stats()
        rows.append(f"| {name} | FSDP {shard} -> {replicas} x TP {tp} | {stats.blocks:,} | {stats.messages:,} | "
                    f"{best:.3f} s | {check:.3f} s | {digest:.3f} s |")
    return rows


def bench_bytes() -> list[str]:
    from hpcrl.cli.transfer_view import transfer_summary
    from hpcrl.config.load import load_config_and_shape

    rows = ["| config | trainer -> inference | bytes per inference rank | ours vs minimum | vLLM NCCL | vLLM M2N |"
            " sync at 400 Gbit/s (ours / NCCL) |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for path in sorted((REPO / "configs").glob("*.toml")):
        config, shape = load_config_and_shape(path)
        s = transfer_summary(config, shape, link_gbps=400)
        t, inf = s["trainer"], s["inference"]
        rows.append(f"| {path.name} | {t['dp_replicate']} x {t['dp_shard']} -> {inf['replicas']} x TP "
                    f"{inf['tensor_parallel']} | {max(inf['received_bytes']) / 2**30:.3f} GiB | "
                    f"{s['ratio_to_minimum']:.2f}x | {s['baselines_ratio']['vllm-nccl']:.1f}x | "
                    f"{s['baselines_ratio']['vllm-m2n']:.1f}x | {s['predicted_sync_s']:.3f} s / "
                    f"{s['baselines_sync_s']['vllm-nccl']:.3f} s |")
    return rows


# ---- a real update: ours vs the naive path --------------------------------------------------

def bench_update(*, tp: int, fsdp: int, rounds: int, transport: str = "gloo") -> list[str]:
    import dataclasses

    from weight_sync import WeightSync

    from hpcrl.config.model_shapes import PRESETS
    from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout

    shape = dataclasses.replace(PRESETS["tiny-llama"], hidden_size=512, intermediate_size=1536, num_layers=8,
                                num_heads=8, num_kv_heads=4, head_dim=64, vocab_size=4096)
    with WeightSync(shape, TrainerLayout(dp_shard=fsdp), InferenceLayout(tensor_parallel=tp), transport=transport,
                    name="reshard") as sync:
        for _ in range(rounds):
            sync.update()
            sync.reload()
    ours, naive = sync.times["ours"], sync.times["naive"]
    model_mib = sync.model_bytes / 2**20
    return [sync.setting("Llama-shaped, hidden 512, 8 layers, heads 8/4 x 64, vocab 4096", rounds),
            "",
            "| path | bytes moved into vLLM | wall time, go -> weights live (median) | of which trainer side | all rounds |",
            "|---|---:|---:|---:|---|",
            f"| ours: local shards -> live params ({transport} p2p) | {sync.received_bytes / 2**20:.1f} MiB "
            f"| {ours.median():.3f} s | {ours.median_trainer():.3f} s | {ours.rounds()} |",
            f"| naive: full_tensor + safetensors in /dev/shm + reload_weights | {model_mib:.1f} MiB written, "
            f"{tp} x {model_mib:.1f} MiB read | {naive.median():.3f} s | {naive.median_trainer():.3f} s | "
            f"{naive.rounds()} |",
            "", f"Speed-up: {naive.median() / ours.median():.1f}x."]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="planner runs (best is reported)")
    ap.add_argument("--skip-update", action="store_true", help="skip the real vLLM update (3)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--fsdp", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--transport", choices=["gloo", "ucx"], default="gloo", help="weight transport of ours (3)")
    args = ap.parse_args()
    out = ["### Planner", ""] + bench_planner(args.repeat)
    out += ["", "### Bytes per inference rank (shipped configs)", ""] + bench_bytes()
    if not args.skip_update:
        out += ["", "### A real update on this machine: ours vs the naive path", ""]
        out += bench_update(tp=args.tp, fsdp=args.fsdp, rounds=args.rounds, transport=args.transport)
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
