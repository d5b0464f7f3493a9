"""How long a trainer step may take before the head calls it stuck (pure).

Heartbeats catch a process that stops (SIGSTOP, a frozen node): it falls silent. They do not catch
ranks that are alive but deadlocked - a collective one rank never joins, a hung NCCL kernel -
because each task's bus thread keeps answering. So the head gives every train step a deadline from
the recent step times: `factor` x their median, never below `floor_s`; until `warmup` steps were
timed (the first steps compile, load and allocate), the call's ordinary timeout. A step past its
deadline ends the run's attempt; the job is requeued and resumes from its newest checkpoint.
"""

from __future__ import annotations

import statistics
from collections import deque

#: A stuck step is one taking this many times the median of the recent ones ...
DEADLINE_FACTOR = 10.0
#: ... and at least this long: tiny CPU steps vary a lot in relative terms (GC, a loaded machine).
DEADLINE_FLOOR_S = 60.0
#: Steps timed before any deadline applies.
WARMUP_STEPS = 3


class StepDeadline:
    def __init__(self, *, ceiling_s: float, factor: float = DEADLINE_FACTOR, floor_s: float | None = None,
                 warmup: int = WARMUP_STEPS, window: int = 20) -> None:
        self.ceiling_s, self.factor, self.warmup = ceiling_s, factor, warmup
        self.floor_s = DEADLINE_FLOOR_S if floor_s is None else floor_s
        self.recent: deque[float] = deque(maxlen=window)

    def observe(self, seconds: float) -> None:
        self.recent.append(seconds)

    def seconds(self) -> float:
        """The deadline of the next step, in seconds."""
        if len(self.recent) < self.warmup:
            return self.ceiling_s
        return min(self.ceiling_s, max(self.floor_s, self.factor * statistics.median(self.recent)))

    def describe(self) -> str:
        if len(self.recent) < self.warmup:
            return f"{self.ceiling_s:g} s (the call timeout: fewer than {self.warmup} steps timed)"
        return (f"{self.seconds():.1f} s ({self.factor:g} x the median of the last {len(self.recent)} steps, "
                f"{statistics.median(self.recent):.2f} s; at least {self.floor_s:g} s)")
