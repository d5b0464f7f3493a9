"""Benchmark one GRPO trainer step (FSDP2, torchtitan model) and print tokens/s and MFU.

    python tools/bench_trainer.py                                   # Llama-3 1B, bf16, batch 4 x 2048, cuda
    torchrun --nproc-per-node 8 tools/bench_trainer.py --preset llama3-8b
    python tools/bench_trainer.py --preset tiny-llama --device cpu --batch 2 --seq-len 64   # CI smoke run

The model has random weights (shapes from hpcrl's presets); the batch is random token ids with
every position but the first a completion token, so forward, backward and the optimizer step
cost what a real step of that size costs. MFU counts 6 x (matmul parameters) + 12 x layers x
heads x head_dim x seq_len FLOPs per token (torchtitan's convention; attention not halved for
causality) against the GPU's dense bf16 peak (--peak-tflops to override; none on CPU).

Measured: the H100 figure for Llama-3 1B (batch 4 x 2048, bf16) is pending a GPU session; the
target is at least 35% MFU (docs/FACTS.md has 38.4% for a plain torchtitan step on torch 2.11).
Results go to BENCHMARKS.md by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

#: Dense bf16 peak FLOP/s by GPU name fragment (without sparsity).
PEAK_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12}


def flops_per_token(shape, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul parameters + 12 x L x heads x head_dim x seq_len."""
    matmul = sum(n for name, dims in shape.hf_parameters() if len(dims) == 2 and "embed_tokens" not in name
                 for n in [dims[0] * dims[1]])
    if shape.tie_embeddings:
        matmul += shape.vocab_size * shape.hidden_size  # the lm_head matmul uses the embedding
    return 6.0 * matmul + 12.0 * shape.num_layers * shape.num_heads * shape.head_dim * seq_len


def init_distributed(device: str) -> None:
    """torchrun's environment when present, else a world of one (FSDP needs a process group)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if device == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="hpcrl-bench-"), "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-1b", help="model shape preset (hpcrl/config/model_shapes.py)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="", help="bfloat16 (default on cuda) or float32 (default on cpu)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=0, help="default: the whole batch")
    parser.add_argument("--steps", type=int, default=6, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="peak of one device; default by GPU name")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from hpcrl.config.model_shapes import preset
    from hpcrl.trainer import EngineOptions, RolloutBatch, TrainerEngine

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    init_distributed(args.device)
    shape = preset(args.preset)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    engine = TrainerEngine(EngineOptions(
        shape=shape, device=args.device, dtype=dtype, max_seq_len=args.seq_len, lr=1e-5,
        micro_batch_size=args.micro_batch_size or args.batch, activation_checkpointing=args.activation_checkpointing,
        total_steps=args.warmup + args.steps))
    generator = torch.Generator().manual_seed(engine.rank)
    tokens = torch.randint(0, shape.vocab_size, (args.batch, args.seq_len), generator=generator)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[:, 0] = False
    batch = RolloutBatch(tokens=tokens, completion_mask=mask,
                         old_logprobs=torch.full(tokens.shape, -float(torch.log(torch.tensor(shape.vocab_size)))),
                         advantages=torch.randn(args.batch, generator=generator))

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        engine.train_step(batch)
    sync()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        metrics = engine.train_step(batch)
    sync()
    step_s = (time.perf_counter() - start) / args.steps

    tokens_per_s = args.batch * args.seq_len / step_s  # per rank
    achieved = tokens_per_s * flops_per_token(shape, args.seq_len)
    peak = args.peak_tflops * 1e12
    if not peak and args.device == "cuda":
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_FLOPS.items() if k in name), 0.0)
    result = {
        "preset": args.preset, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": dtype, "world_size": engine.world_size, "batch_per_rank": args.batch, "seq_len": args.seq_len,
        "micro_batch_size": args.micro_batch_size or args.batch, "activation_checkpointing": args.activation_checkpointing,
        "parameters": shape.num_parameters,
        "step_ms": round(step_s * 1e3, 2), "tokens_per_s_per_rank": round(tokens_per_s, 1),
        "tflops_per_rank": round(achieved / 1e12, 3), "mfu": round(achieved / peak, 4) if peak else None,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if args.device == "cuda" else None,
        "last_loss": metrics.loss,
    }
    if engine.rank == 0:
        mfu = f"{100 * result['mfu']:.1f}%" if result["mfu"] is not None else "n/a (no peak FLOP/s known for this device)"
        print(f"{args.preset} {dtype} on {result['device']} x{engine.world_size}: {result['step_ms']} ms/step, "
              f"{result['tokens_per_s_per_rank']} tokens/s/rank, {result['tflops_per_rank']} TFLOP/s/rank, MFU {mfu}")
        print(json.dumps(result))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
