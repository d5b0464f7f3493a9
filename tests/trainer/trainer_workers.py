"""Helpers of the trainer tests: a fixed toy batch, and gloo worker processes.

`run_ranks` starts `world_size` processes with torch.multiprocessing (forked: tests/forked.py), each joining a gloo
group through a FileStore in the test's tmp_path (no ports), and kills them all if they outlive
the timeout. Each worker writes what it measured to tmp_path/rank<R>.pt.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import forked
import torch

from hpcrl.trainer import RolloutBatch, pad_rows


def toy_batch() -> RolloutBatch:
    """Five completions of uneven lengths (one without completion tokens), mixed advantages."""
    return pad_rows(
        sequences=[[1, 40, 41, 42, 43, 44], [1, 40, 50, 51], [1, 60, 61, 62, 63, 64, 65, 66],
                   [1, 40, 41, 70], [1, 80]],
        prompt_lengths=[2, 2, 3, 3, 2],
        old_logprobs=[[-4.8, -4.9, -5.0, -4.7], [-4.6, -5.1], [-4.9, -4.8, -4.7, -5.2, -4.9], [-4.9], []],
        advantages=[1.0, -1.0, 0.5, -0.5, 0.0])


def skewed_train_batch(*, per_token: bool = False):
    """A TrainBatch of twelve rollouts whose lengths are skewed (2 to 41 tokens; one with no policy token, one
    multi-turn with a tool reply inside), mixed advantages, per sequence or (per_token) per token."""
    import random

    from hpcrl.trainer import TrainBatch

    rng = random.Random(39)
    ids, masks, logprobs, advantages = [], [], [], []
    for row, completion in enumerate([1, 3, 0, 30, 2, 5, 1, 12, 2, 4, 1, 8]):
        prompt = rng.randint(2, 6)
        mask = [0] * prompt + [1] * completion
        if row == 7:  # policy, tool output (mask 0), policy again
            mask = [0] * prompt + [1] * 4 + [0] * 4 + [1] * 4
        ids.append([1] + [rng.randrange(4, 99) for _ in range(len(mask) - 1)])
        masks.append(mask)
        logprobs.append([-4.5 - rng.random() if m else 0.0 for m in mask])
        advantage = rng.uniform(-1.0, 1.0)
        advantages.append([advantage * (i + 1) / len(mask) for i in range(len(mask))] if per_token else advantage)
    return TrainBatch(prompt_ids=[f"p{i}" for i in range(len(ids))], input_ids=ids, policy_mask=masks,
                      logprobs=logprobs, advantages=advantages, rewards=[0.0] * len(ids))


def engine_options(model_dir: str, **overrides):
    from hpcrl.algorithms.base import Options
    from hpcrl.config.model_shapes import load_shape
    from hpcrl.trainer import EngineOptions

    # AdamW eps 1e-6, not 1e-8: Adam's first update is lr * g / (|g| + eps), which for gradient
    # entries near 1e-8 turns float rounding (different summation order across ranks) into
    # differences of up to lr; with 1e-8 the 1-vs-2-rank weights differ by 1.0e-5, with 1e-6 by 3e-7.
    values = dict(shape=load_shape(preset_name="", path=model_dir), weights_path=model_dir, max_seq_len=64,
                  lr=1e-3, betas=(0.9, 0.99), eps=1e-6, micro_batch_size=1, grad_clip=1.0, total_steps=10,
                  loss=Options(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.1))
    values.update(overrides)
    return EngineOptions(**values)


def _worker(rank: int, world_size: int, store_path: str, out_dir: str, model_dir: str, overrides: dict) -> None:
    import torch.distributed as dist

    from hpcrl.trainer import TrainerEngine

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        engine = TrainerEngine(engine_options(model_dir, **overrides))
        batch = toy_batch()
        logprobs = engine.logprobs(batch.shard(rank, world_size))
        metrics = engine.train_step(batch.shard(rank, world_size))
        engine.logprobs(batch.shard(rank, world_size))  # a no-grad forward must leave the shards in place
        shards = {name: (s.tensor.clone(), s.global_shape, s.dim0_offset)
                  for name, s in engine.local_shards().items()}
        full = engine.full_state_dict_hf()
        adapters = engine.adapter_state_dict() if engine.adapters is not None else None
        engine.save_checkpoint(os.path.join(out_dir, "checkpoint"))
        torch.save({"metrics": metrics.as_dict(), "shards": shards, "full": full, "logprobs": logprobs,
                    "adapters": adapters},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def step_gradients(engine) -> dict:
    """{parameter name: its gradient, whole} of the engine's next optimizer step, filled as the step starts
    (collective under FSDP: every rank's hook gathers)."""
    got: dict = {}

    def keep(optimizer, args, kwargs) -> None:
        got.update({name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                    for name, p in engine.model.named_parameters() if p.grad is not None})

    engine.optimizer.register_step_pre_hook(keep)
    return got


def _share_worker(rank: int, world_size: int, store_path: str, out_dir: str, model_dir: str, overrides: dict) -> None:
    """One train_share of skewed_train_batch() on this rank: the step's whole gradient and metrics."""
    import torch.distributed as dist

    from hpcrl.trainer import TrainerEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    try:
        engine = TrainerEngine(engine_options(model_dir, **overrides))
        grads = step_gradients(engine)
        metrics = engine.train_share(skewed_train_batch())
        torch.save({"metrics": metrics.as_dict(), "grads": grads}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, tmp_path: Path, model_dir: str, *, timeout_s: float = 120, shares: bool = False,
              **overrides) -> list[dict]:
    """Run one logprobs + train step on `world_size` gloo ranks (shares: one train_share of
    skewed_train_batch()); each rank's results."""
    context = forked.start_ranks(_share_worker if shares else _worker,
                                 args=(world_size, str(tmp_path / "store"), str(tmp_path), model_dir, overrides),
                                 nprocs=world_size)
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world_size} trainer ranks did not finish in {timeout_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
