"""Benchmark a LoRA sync against a full-weight sync on the tiny model; prints markdown for BENCHMARKS.md.

    PYTHONPATH=. python tools/bench/bench_lora_sync.py MODEL_DIR [--rank 8] [--fsdp 1] [--rounds 20]

A vLLM engine on CPU per mode (hpcrl's VllmEngine; with [lora]: enable_lora, max_lora_rank from --rank, 2 versions
resident), --fsdp trainer ranks (processes, gloo) holding their torch.chunk rows. --rounds LoRA syncs (the plan of
[lora] rank --rank on all seven projections, adapters drawn at random: PEFT's names, Shard(0) rows) into LoRA
slots; then, into an engine without LoRA (with LoRA on, vLLM wraps the linears: their weights are other
parameters), --rounds full-weight syncs of the checkpoint's tensors (the plan of the same layouts without [lora]). Per sync: the bytes the plan moves and the engine's wall time of
receive_weights (one collective_rpc: the receive, on CPU the repacking after a full sync, B's scaling after a
LoRA one), median and range over the rounds.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_plan(preset: str, dp: int, rank: int):
    from hpcrl.config.model_shapes import PRESETS
    from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
    from hpcrl.plan.transfer.planner import plan

    inference = InferenceLayout(lora_rank=rank, lora_targets=TARGETS) if rank else InferenceLayout()
    return plan(TrainerLayout(dp_shard=dp), inference, PRESETS[preset], wire_dtype="float32", bucket_bytes=16 << 20)


def trainer(model_dir: str, preset: str, rank: int, world: int, lora_rank: int, rounds: int, store: str) -> None:
    import torch
    from safetensors.torch import load_file

    from hpcrl.plan.transfer.layout import chunk_rows
    from hpcrl.transfer.trainer import TrainerSender

    p = make_plan(preset, world, lora_rank)
    if lora_rank:
        gen = torch.Generator().manual_seed(0)
        full = {s.name: torch.randn(s.shape, generator=gen) * 0.1 for s in p.sources}
    else:
        full = load_file(f"{model_dir}/model.safetensors")
    shards = {}
    for s in p.sources:
        a, e = chunk_rows(s.shape[0], world)[rank]
        shards[s.name] = full[s.name][a:e].contiguous()
    sender = TrainerSender.connect(p, rank=rank, store=store, timeout_s=300)
    for _ in range(rounds):
        sender.send(shards)
    sender.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--preset", default="tiny-llama")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--fsdp", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    from hpcrl.inference.engine import VllmEngine
    from hpcrl.rendezvous.meet import serve_store

    _keeper = serve_store()  # before vLLM starts: its workers inherit the stores' secret
    ctx = mp.get_context("spawn")
    rows = [f"| sync, tiny model, FSDP {args.fsdp} -> TP 1, gloo, CPU | bytes per sync | receive_weights median "
            f"(min-max), {args.rounds} syncs |", "|---|---:|---:|"]
    version = 0
    for lora_rank in (args.rank, 0):
        engine = VllmEngine(model_path=args.model, tensor_parallel=1, on_cpu=True, dtype="float32", seed=0,
                            max_model_len=128, gpu_memory_utilization=0.15, enforce_eager=True, temperature=1.0,
                            top_p=1.0, top_k=-1, max_tokens=8, kv_cache_gib=0.05, weight_transfer=True,
                            lora_rank=lora_rank, lora_alpha=2.0 * lora_rank, lora_versions=2)
        p = make_plan(args.preset, args.fsdp, lora_rank)
        store = serve_store()
        procs = [ctx.Process(target=trainer, args=(args.model, args.preset, r, args.fsdp, lora_rank, args.rounds,
                                                   store.address)) for r in range(args.fsdp)]
        for proc in procs:
            proc.start()
        engine.connect_transfer(p, store=store.address, timeout_s=300)
        times = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            engine.receive_weights(version)
            times.append(time.perf_counter() - t0)
            version += 1
        for proc in procs:
            proc.join(timeout=60)
        what = f"LoRA rank {lora_rank}, all 7 projections" if lora_rank else "full weights"
        rows.append(f"| {what} | {int(p.elements().sum()) * p.itemsize / 1024:.1f} KiB | "
                    f"{statistics.median(times) * 1e3:.1f} ms ({min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}) |")
        engine.close()
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
