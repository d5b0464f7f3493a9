"""Where a run's start-up time goes: each part's seconds, for the run log and the first step's metrics.

    clock = StartupClock()
    engine = clock.timed("inference", VllmEngine.from_config, config)   # parts may run in parallel threads
    clock.record("first_sync", 0.04)
    clock.metrics()   # {"startup_inference_s": 11.2, "startup_first_sync_s": 0.04, "startup_total_s": 14.9}
    startup_summary(clock.metrics())   # "start-up: 14.9 s from launch to the first step (inference 11.20 s, ...)"

`startup_total_s` is the process's age when asked (from its launch: interpreter start and imports
included), so, asked as the first step starts, it is the run's "launch -> first step" minus that step.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def process_age_s(pid: int | str = "self") -> float:
    """Seconds since process `pid` was launched (Linux: its start time in /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    # Field 22 (starttime, clock ticks after boot) counts from after the command name, which may hold spaces.
    started_ticks = int(stat.rpartition(")")[2].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))


class StartupClock:
    """Seconds of each named part of a start-up, in the order they were recorded (thread-safe)."""

    def __init__(self) -> None:
        self._parts: dict[str, float] = {}
        self._lock = threading.Lock()

    def record(self, part: str, seconds: float) -> None:
        with self._lock:
            self._parts[part] = seconds

    def timed(self, part: str, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs), its duration recorded as `part` (also when it raises)."""
        started = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            self.record(part, time.monotonic() - started)

    def parts(self) -> dict[str, float]:
        with self._lock:
            return dict(self._parts)

    def metrics(self) -> dict[str, float]:
        """startup_<part>_s for each part, and startup_total_s: this process's age now."""
        return {**{f"startup_{part}_s": round(s, 4) for part, s in self.parts().items()},
                "startup_total_s": round(process_age_s(), 4)}


def startup_summary(metrics: dict) -> str:
    """The run log's line of the start-up figures in `metrics` (StartupClock.metrics())."""
    parts = ", ".join(f"{key[len('startup_'):-2].replace('_', ' ')} {value:.2f} s" for key, value in metrics.items()
                      if key.startswith("startup_") and key != "startup_total_s")
    return f"start-up: {metrics['startup_total_s']:.1f} s from launch to the first step ({parts})"
