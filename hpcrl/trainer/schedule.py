"""Learning-rate schedule: linear warmup, then constant, linear or cosine decay to a floor.

Pure function of the step, so a resumed run gets the same rate without a scheduler's state.
"""

from __future__ import annotations

import math
from typing import Literal

LrSchedule = Literal["constant", "linear", "cosine"]
"""The decay after warmup (config key trainer.lr_schedule)."""


def lr_at(step: int, *, peak: float, total_steps: int, warmup_steps: int = 0,
          schedule: LrSchedule = "constant", min_lr_ratio: float = 0.0) -> float:
    """Learning rate of optimizer step `step` (0-based).

    Warmup: peak * (step + 1) / warmup_steps for the first warmup_steps steps (never 0).
    After it, progress p goes 0 -> 1 over the remaining steps; linear gives
    peak * (1 - (1 - min_lr_ratio) * p), cosine peak * (min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi p)) / 2).
    """
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps - 1))
    if schedule == "linear":
        return peak * (1.0 - (1.0 - min_lr_ratio) * progress)
    if schedule == "cosine":
        return peak * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise ValueError(f"unknown lr schedule {schedule!r}; use constant, linear or cosine")
