"""Benchmark: the trainer with LoRA against full fine-tuning on the embedded default's model, trainer alone.

    .venv/bin/python tools/bench/bench_lora_trainer.py [--rows 128] [--steps 20] [--threads N]

Two engines as `hpcrl run` builds them, from configs/tiny_lora_grpo.toml (rank-16 adapters on every linear,
lr 5e-3) and configs/tiny_grpo.toml (every weight, lr 1e-3), train on-policy on one fixed batch (the
batch of tools/bench/bench_train_step.py: `--rows` one-token answers, random advantages; old logprobs
from the engine before each step), alternating steps so a change of the machine's load hits both. It
prints per side: the median step time, the loss and gradient norm at a few steps, the rise of the mean
logprob of the positively advantaged answers (what GRPO should raise), the bytes a weight sync sends
(`local_shards()`: the adapters alone with LoRA) and the optimizer state the trainer holds; then the
memory plan of configs/qwen3-8b_lora_grpo.toml with and without its [lora] table.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools" / "bench"))


def _engine(config_name: str):
    from hpcrl.config import load_config
    from hpcrl.trainer import TrainerEngine

    config = load_config(REPO / "configs" / config_name, overrides=[f"model.path={REPO / 'models' / 'tiny-llama'}"])
    return TrainerEngine.from_config(config, device="cpu")


def _positive_logprob(engine, batch) -> float:
    logp = engine.logprobs(batch)
    keep = batch.completion_mask & (batch.advantages[:, None] > 0)
    return float(logp[keep].mean())


def main() -> None:
    from bench_train_step import make_batch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sides = {"lora": _engine("tiny_lora_grpo.toml"), "full": _engine("tiny_grpo.toml")}
    batch = make_batch(args.rows)
    start = {name: _positive_logprob(e, batch) for name, e in sides.items()}
    times: dict[str, list[float]] = {name: [] for name in sides}
    rows: dict[str, list[tuple[int, float, float]]] = {name: [] for name in sides}
    for step in range(1, args.steps + 1):
        for name, engine in sides.items():
            on_policy = dataclasses.replace(batch, old_logprobs=engine.logprobs(batch))
            began = time.perf_counter()
            metrics = engine.train_step(on_policy)
            times[name].append(time.perf_counter() - began)
            if step in (1, 2, 5, 10, args.steps):
                rows[name].append((step, metrics.loss, metrics.grad_norm))
    print(f"{args.rows} rows, {args.steps} on-policy steps on one batch, torch threads {torch.get_num_threads()}\n")
    print("| side | step (median) | loss / grad norm at steps | positive answers' mean logprob | sync bytes | optimizer state |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, engine in sides.items():
        sync = sum(s.tensor.numel() * s.tensor.element_size() for s in engine.local_shards().values())
        state = sum(t.numel() * t.element_size() for s in engine.optimizer.state.values()
                    for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        trail = ", ".join(f"{step}: {loss:.4f} / {norm:.3f}" for step, loss, norm in rows[name])
        print(f"| {name} | {1000 * statistics.median(times[name]):.1f} ms | {trail} | "
              f"{start[name]:.3f} -> {_positive_logprob(engine, batch):.3f} | {sync:,} | {state:,} |")

    from hpcrl.config.load import load_config_and_shape
    from hpcrl.plan import plan_resources

    config, shape = load_config_and_shape(REPO / "configs" / "qwen3-8b_lora_grpo.toml", cluster="generic")
    print("\nQwen3-8B trainer on one 80 GiB GPU (hpcrl plan):")
    for label, cfg in (("lora", config), ("full", dataclasses.replace(config, lora=None))):
        memory = plan_resources(cfg, shape).trainer_memory
        parts = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in memory.parts.items() if v)
        print(f"  {label}: {memory.total / 2**30:.1f} GiB ({'fits' if memory.fits else 'DOES NOT FIT'}): {parts}")


if __name__ == "__main__":
    main()
