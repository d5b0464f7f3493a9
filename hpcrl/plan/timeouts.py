"""How long a run waits for its tasks to start, and for a lost inference replica to come back.

    timeouts = run_timeouts(config, shape)    # Timeouts(start_s=..., rejoin_s=...)

Pure: [run] start_timeout_s and rejoin_timeout_s when set (> 0), else derived from the bytes of
the model's weights in model.dtype, since what a cold start waits for grows with them (every
trainer rank and vLLM worker reading its share of the checkpoint from a shared filesystem, vLLM
profiling memory and capturing CUDA graphs). The floors are what a small model needs with room to
spare (the tiny CPU model starts in well under a minute); the slopes allow about 100 MB/s of
reading per task at start (10 s per GB) and half of it for one replica started again alone:

    start   600 s + 10 s per GB     tiny 600 s, Llama-3 8B bf16 (16.1 GB) 761 s, 70B (141.1 GB) 2011 s
    rejoin  300 s +  5 s per GB     tiny 300 s, 8B 380 s, 70B 1006 s

`hpcrl submit` writes the start timeout into launch.json (the head's start-up watch, its
rendezvous store and the bus connect); the trainer ranks wait as long to form their process
group; the head's ports give a lost inference replica the rejoin timeout to register again.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.config.model_shapes import DTYPE_BYTES, ModelShape
from hpcrl.config.schema import Config

START_FLOOR_S = 600.0
START_S_PER_GB = 10.0
REJOIN_FLOOR_S = 300.0
REJOIN_S_PER_GB = 5.0


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    start_s: float
    """Seconds every task has to start and register (and the trainer ranks to form their group)."""
    rejoin_s: float
    """Seconds a lost inference replica, started again by the head, has to register."""


def weights_gb(config: Config, shape: ModelShape) -> float:
    """GB (1e9 bytes) of the model's weights in model.dtype."""
    return shape.num_parameters * DTYPE_BYTES[config.model.dtype] / 1e9


def run_timeouts(config: Config, shape: ModelShape) -> Timeouts:
    """The run's timeouts: [run]'s values where set, else derived (see the module docstring)."""
    gb = weights_gb(config, shape)
    run = config.run
    return Timeouts(
        start_s=run.start_timeout_s or float(round(START_FLOOR_S + START_S_PER_GB * gb)),
        rejoin_s=run.rejoin_timeout_s or float(round(REJOIN_FLOOR_S + REJOIN_S_PER_GB * gb)))
