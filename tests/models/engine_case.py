"""What the families' trainer-engine tests share: an engine on a saved checkpoint and a batch of two rows."""

from __future__ import annotations

from pathlib import Path


def small_engine(shape, weights: Path, **options):
    """A one-process TrainerEngine of `shape` loading `weights`, a large learning rate so a step changes what it
    touches; `options` override EngineOptions' fields."""
    from hpcrl.algorithms.base import Options
    from hpcrl.trainer import EngineOptions, TrainerEngine

    return TrainerEngine(EngineOptions(**{
        "shape": shape, "weights_path": str(weights), "max_seq_len": 64, "lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-6,
        "micro_batch_size": 2, "grad_clip": 1.0, "total_steps": 10,
        "loss": Options(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.0), **options}))


def two_rows():
    """Two rollouts of one prompt, one rewarded and one not."""
    from hpcrl.trainer.batch import pad_rows

    return pad_rows(sequences=[[1, 40, 41, 42, 43, 44], [1, 40, 50, 51]], prompt_lengths=[2, 2],
                    old_logprobs=[[-4.8, -4.9, -5.0, -4.7], [-4.6, -5.1]], advantages=[1.0, -1.0])
