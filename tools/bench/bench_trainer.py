"""Benchmark one GRPO trainer step (FSDP2, torchtitan model), beside a plain training loop of the same model.

    python tools/bench/bench_trainer.py                                   # Llama-3 1B, bf16, batch 4 x 2048, cuda
    python tools/bench/bench_trainer.py --compare --json out.json         # the same beside the plain loop, and their ratio
    torchrun --nproc-per-node 8 tools/bench/bench_trainer.py --preset llama3-8b
    python tools/bench/bench_trainer.py --preset mid-llama --device cpu --batch 2 --seq-len 512 --compare   # CPU proxy
    python tools/bench/bench_trainer.py --preset tiny-llama --device cpu --batch 2 --seq-len 64   # CI smoke run

The engine side is `TrainerEngine.train_step`. The plain side (`--compare`, or `--plain` alone) is
the least a training step does with the same model (hpcrl/trainer/titan.py's torchtitan decoder,
sharded the same way, same batch): forward, float32 cross-entropy of the next token over all
positions (torchtitan's loss), backward, gradient clipping, fused AdamW; no host read inside it.
The engine's step does what GRPO needs on top (logprobs, the clipped loss, the entropy and
mismatch metrics, a read of them), so engine / plain is what hpcrl's step costs beyond the model.

Timing: every step ends with a device synchronisation and is timed alone; figures are medians
over --steps after --warmup. On CPU the two sides alternate step by step (a 2-vCPU machine's load
drifts; alternating makes the drift hit both alike); on CUDA each side runs alone (its own peak
memory, torch.cuda.max_memory_allocated) unless --interleave. The batch is random token ids with
every position but the first a completion token, so forward, backward and the optimizer step
cost what a real step of that size costs. MFU counts 6 x (matmul parameters) + 12 x layers x
heads x head_dim x seq_len FLOPs per token (torchtitan's convention; attention not halved for
causality) against the GPU's dense bf16 peak (--peak-tflops to override; none on CPU).

From Python (tools/gpu/gpu_check.py): `run_bench(parse_args([...]))` returns the result dict.
Results go to BENCHMARKS.md ("Trainer") by hand.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
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


def init_distributed(device: str) -> bool:
    """torchrun's environment when present, else a world of one (FSDP needs a process group).
    True when this call made the group (the caller destroys it)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    backend = "nccl" if device == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="hpcrl-bench-"), "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return True


class PlainLoop:
    """forward, float32 cross-entropy, backward, clip, AdamW on hpcrl's torchtitan model (module docstring)."""

    def __init__(self, shape, *, device: str, dtype: str, max_seq_len: int, lr: float,
                 activation_checkpointing: bool, seed: int = 0) -> None:
        import torch
        import torch.distributed as dist

        from hpcrl.trainer import titan
        from hpcrl.trainer.parallel import make_dp_mesh, shard_decoder

        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        model = titan.build_model(shape, max_seq_len=max_seq_len, device="meta")
        if activation_checkpointing:
            titan.apply_activation_checkpointing(model)
        if dist.is_initialized():
            mesh = make_dp_mesh(dp_replicate=1, dp_shard=-1, device_type=self.device.type)
            mixed = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
            shard_decoder(model, titan.transformer_blocks(model), mesh, param_dtype=mixed)
        model.to_empty(device=self.device)
        torch.manual_seed(seed)
        titan.init_states(model, device=self.device)
        model.train()
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=self.device.type == "cuda")

    def train_step(self, tokens):
        import torch

        tokens = tokens.to(self.device)
        logits = self.model(tokens)
        labels = torch.roll(tokens, -1, dims=1)  # every position, as the engine's fused pass
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(self.model.parameters()), 1.0, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-1b", help="model shape preset (hpcrl/config/model_shapes.py)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="", help="bfloat16 (default on cuda) or float32 (default on cpu)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=0, help="default: the whole batch")
    parser.add_argument("--steps", type=int, default=6, help="timed steps of each side (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--activation-checkpointing", action="store_true")
    side = parser.add_mutually_exclusive_group()
    side.add_argument("--compare", action="store_true", help="the engine step and the plain loop, and their ratio")
    side.add_argument("--plain", action="store_true", help="the plain loop only")
    parser.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                        help="alternate the two sides step by step (default: on CPU yes, on CUDA no)")
    parser.add_argument("--logprob-chunk-tokens", type=int, help="engine option (default: the engine's)")
    parser.add_argument("--logprob-recompute", action="store_true", help="engine option: recompute chunk logits")
    parser.add_argument("--compile-logprobs", action=argparse.BooleanOptionalAction, default=None,
                        help="engine option: torch.compile the chunks (default: the engine's, on for CUDA)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads on CPU (default: torch's)")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="peak of one device; default by GPU name")
    parser.add_argument("--json", type=Path, help="also write the result here")
    return parser.parse_args(argv)


def _engine_options(args, shape, dtype: str):
    """The engine's options; the fused-logprob ones only when asked for (the script also runs
    against older engines, to measure a base commit)."""
    from hpcrl.trainer import EngineOptions

    extra = {}
    if args.logprob_chunk_tokens:
        extra["logprob_chunk_tokens"] = args.logprob_chunk_tokens
    if args.logprob_recompute:
        extra["logprob_recompute"] = True
    if args.compile_logprobs is not None:
        extra["compile_logprobs"] = args.compile_logprobs
    return EngineOptions(shape=shape, device=args.device, dtype=dtype, max_seq_len=args.seq_len, lr=1e-5,
                         micro_batch_size=args.micro_batch_size or args.batch,
                         activation_checkpointing=args.activation_checkpointing,
                         total_steps=args.warmup + args.steps, **extra)


def run_bench(args: argparse.Namespace) -> dict:
    """Run the benchmark that `args` (parse_args) describes; the result dict (also printed by main)."""
    import torch
    import torch.distributed as dist

    from hpcrl.config.model_shapes import preset
    from hpcrl.trainer import RolloutBatch, TrainerEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    made_group = init_distributed(args.device)
    shape = preset(args.preset)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, shape.vocab_size, (args.batch, args.seq_len), generator=generator)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[:, 0] = False
    batch = RolloutBatch(tokens=tokens, completion_mask=mask,
                         old_logprobs=torch.full(tokens.shape, -float(torch.log(torch.tensor(shape.vocab_size)))),
                         advantages=torch.randn(args.batch, generator=generator))

    def make_engine():
        engine = TrainerEngine(_engine_options(args, shape, dtype))
        return lambda: engine.train_step(batch).loss, engine

    def make_plain():
        loop = PlainLoop(shape, device=args.device, dtype=dtype, max_seq_len=args.seq_len, lr=1e-5,
                         activation_checkpointing=args.activation_checkpointing)
        return lambda: loop.train_step(tokens), loop

    makers = {"engine": make_engine, "plain": make_plain}
    sides = ["engine", "plain"] if args.compare else ["plain"] if args.plain else ["engine"]
    interleave = args.interleave if args.interleave is not None else args.device == "cpu"
    cuda = args.device == "cuda"

    def timed(step) -> float:
        started = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    times: dict[str, list[float]] = {s: [] for s in sides}
    peaks: dict[str, float | None] = dict.fromkeys(sides)
    if interleave:
        steps = {s: makers[s]()[0] for s in sides}
        for _ in range(args.warmup):
            for s in sides:
                timed(steps[s])
        for _ in range(args.steps):
            for s in sides:
                times[s].append(timed(steps[s]))
        del steps
    else:
        for s in sides:
            if cuda:
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            step, owner = makers[s]()
            for _ in range(args.warmup):
                timed(step)
            times[s] = [timed(step) for _ in range(args.steps)]
            if cuda:
                peaks[s] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            del step, owner

    peak = args.peak_tflops * 1e12
    if not peak and cuda:
        peak = next((v for k, v in PEAK_FLOPS.items() if k in torch.cuda.get_device_name()), 0.0)
    per_token = flops_per_token(shape, args.seq_len)

    def figures(side: str) -> dict:
        step_s = statistics.median(times[side])
        tokens_per_s = args.batch * args.seq_len / step_s  # per rank
        achieved = tokens_per_s * per_token
        return {"step_ms": round(step_s * 1e3, 2), "step_ms_all": [round(t * 1e3, 2) for t in times[side]],
                "tokens_per_s_per_rank": round(tokens_per_s, 1), "tflops_per_rank": round(achieved / 1e12, 3),
                "mfu": round(achieved / peak, 4) if peak else None, "peak_memory_gib": peaks[side]}

    result = {
        "preset": args.preset, "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "dtype": dtype, "world_size": dist.get_world_size(),
        "batch_per_rank": args.batch, "seq_len": args.seq_len,
        "micro_batch_size": args.micro_batch_size or args.batch,
        "activation_checkpointing": args.activation_checkpointing, "parameters": shape.num_parameters,
        "threads": torch.get_num_threads(), "interleaved": interleave, "steps": args.steps, "warmup": args.warmup,
        "side": sides[0], **figures(sides[0]),
    }
    if args.compare:
        result["plain"] = figures("plain")
        result["engine_over_plain"] = round(result["step_ms"] / result["plain"]["step_ms"], 4)
    if made_group:
        dist.destroy_process_group()
    return result


def _describe(name: str, figures: dict) -> str:
    mfu = f"{100 * figures['mfu']:.1f}%" if figures["mfu"] is not None else "n/a (no peak FLOP/s known for this device)"
    memory = f", peak {figures['peak_memory_gib']} GiB" if figures["peak_memory_gib"] is not None else ""
    return (f"{name}: {figures['step_ms']} ms/step, {figures['tokens_per_s_per_rank']} tokens/s/rank, "
            f"{figures['tflops_per_rank']} TFLOP/s/rank, MFU {mfu}{memory}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    result = run_bench(args)
    if rank == 0:
        head = f"{args.preset} {result['dtype']} on {result['device']} x{result['world_size']}"
        print(f"{head} {_describe('TrainerEngine.train_step' if result['side'] == 'engine' else 'plain loop', result)}")
        if "plain" in result:
            print(f"{head} {_describe('plain loop', result['plain'])}")
            print(f"engine / plain = {result['engine_over_plain']}")
        print(json.dumps(result))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
