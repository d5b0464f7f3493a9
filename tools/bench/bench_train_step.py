"""Benchmark: one GRPO train step of the embedded default, hpcrl's trainer against the same step on
transformers' model (what TRL's GRPOTrainer runs), and where hpcrl's step spends its time.

    .venv/bin/python tools/bench/bench_train_step.py [--rows 128] [--steps 40] [--threads N]

Both sides hold the same weights (models/tiny-llama, float32, CPU) and train on the same batch:
`--rows` sequences of 8 tokens (bos, a 6-character prompt, one completion token), completion mask
on the last token, random advantages. hpcrl's side is `TrainerEngine.train_step` as `hpcrl run`
builds it (one rank, unsharded in float32, micro-batches of trainer.micro_batch_size). The
reference side is the least a GRPO step can do: one forward of the whole batch, log-softmax
gather, the clipped-ratio loss, backward, gradient clipping, AdamW (TRL's step adds its own
bookkeeping to this). Steps alternate between the two sides, so that a change in the machine's
load hits both alike; medians after `--warmup` steps. Then hpcrl's step again, timed in parts:
forward (+ the fused logprobs and entropy), loss, backward, the logprob-diff metric, clipping,
optimizer. (tools/bench/bench_trainer.py --compare measures the step against a plain loop of the same
torchtitan model at larger shapes.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

PROMPT = [1, 40, 20, 52, 70, 30, 18]  # bos + 6 characters; the ids only shape the batch


def make_batch(rows: int, seed: int = 0):
    from hpcrl.trainer.batch import pad_rows

    g = torch.Generator().manual_seed(seed)
    answers = torch.randint(3, 120, (rows,), generator=g).tolist()
    advantages = torch.randn(rows, generator=g).tolist()
    return pad_rows([PROMPT + [a] for a in answers], [len(PROMPT)] * rows, [[-4.5]] * rows, advantages)


class ReferenceStep:
    """The GRPO step on transformers' LlamaForCausalLM: forward, gather, clipped loss, backward, clip, AdamW."""

    def __init__(self, model_path: Path, *, lr: float, betas: tuple[float, float], clip: tuple[float, float]) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=betas, eps=1e-8, weight_decay=0.0)
        self.clip = clip

    def __call__(self, batch) -> float:
        tokens, mask = batch.tokens, batch.completion_mask[:, 1:].float()
        logits = self.model(input_ids=tokens).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        ratio = torch.exp(logp - batch.old_logprobs[:, 1:])
        adv = batch.advantages[:, None]
        per_token = -torch.min(ratio * adv, ratio.clamp(1 - self.clip[0], 1 + self.clip[1]) * adv)
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def timed_parts(engine, batch) -> dict[str, float]:
    """hpcrl's train_step, part by part (the same calls in the same order as TrainerEngine.train_step)."""
    from hpcrl.algorithms import load_algorithm
    from hpcrl.algorithms.terms import Normaliser, local_counts

    parts = dict.fromkeys(("setup", "forward", "loss", "backward", "metrics", "clip", "optimizer"), 0.0)
    last = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal last
        now = time.perf_counter()
        parts[name] += now - last
        last = now

    o = engine.options
    algorithm = load_algorithm(o.loss.name)
    counts = engine._all_reduce(torch.cat([local_counts(batch.completion_mask), batch.lengths.sum().double().view(1)]))
    norm = Normaliser(tokens=float(counts[0]), sequences=float(counts[1]))
    micro_batches = engine._micro_batches(batch)
    lap("setup")
    for mb in micro_batches:
        logp, entropy = engine._forward_logprobs(engine.model, mb, entropy=True)
        lap("forward")
        mask = mb.completion_mask
        share = algorithm.loss(logprobs=logp, old_logprobs=mb.old_logprobs, advantages=mb.advantages, mask=mask,
                               settings=o.loss, norm=norm)
        lap("loss")
        share.loss.backward()
        lap("backward")
        with torch.no_grad():
            (entropy * mask).sum()
            torch.where(mask, (logp - mb.old_logprobs).abs(), 0.0).sum()
        lap("metrics")
    float(engine._clip_gradients())
    lap("clip")
    engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=True)
    lap("optimizer")
    return parts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128, help="sequences in the batch (default: 8 prompts x 16)")
    parser.add_argument("--steps", type=int, default=40, help="steps of each side (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps of each side left out (default 5)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's, one per core)")
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny_grpo.toml"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from hpcrl.config import load_config
    from hpcrl.trainer import TrainerEngine

    config = load_config(args.config)
    engine = TrainerEngine.from_config(config)
    t = config.trainer
    reference = ReferenceStep(REPO / config.model.path, lr=t.lr, betas=tuple(t.betas),
                              clip=(config.algorithm.clip_eps_low, config.algorithm.clip_eps_high))
    batch = make_batch(args.rows)
    hpcrl_s, reference_s = [], []
    for _ in range(args.steps):
        started = time.perf_counter()
        engine.train_step(batch)
        hpcrl_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        reference(batch)
        reference_s.append(time.perf_counter() - started)
    parts = [timed_parts(engine, batch) for _ in range(args.steps)][args.warmup:]
    med = lambda xs: statistics.median(xs[args.warmup:]) * 1000  # noqa: E731
    print(f"{args.rows} rows x {batch.tokens.shape[1]} tokens, micro-batches of {t.micro_batch_size}, "
          f"{torch.get_num_threads()} torch threads, {args.steps} steps each (first {args.warmup} left out)")
    print("| step | median ms |\n| --- | --- |")
    print(f"| hpcrl TrainerEngine.train_step | {med(hpcrl_s):.1f} |")
    print(f"| transformers model, minimal GRPO step | {med(reference_s):.1f} |")
    print("\n| part of hpcrl's step | median ms |\n| --- | --- |")
    for name in parts[0]:
        print(f"| {name} | {statistics.median(p[name] for p in parts) * 1000:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
