"""Settings of the control bus (heartbeats, size limits, default deadline) as one frozen dataclass.

The head's heartbeat settings win: it sends them to every worker when it welcomes it, so a
run has one heartbeat_timeout however its workers were started.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class BusConfig:
    heartbeat_interval: float = 1.0
    """Seconds between heartbeats, sent both ways (head -> each worker, worker -> head)."""
    heartbeat_timeout: float = 5.0
    """A peer silent this long is unhealthy; a worker whose head is silent this long exits."""
    max_message_bytes: int = 64 << 20
    """Largest message (all frames together) accepted; larger ones are dropped and counted."""
    max_frames: int = 64
    """Most frames (the header frame + buffers) in one message; more are dropped and counted."""
    default_deadline: float = 60.0
    """Deadline in seconds of a call that does not give its own."""
    register_timeout: float = 120.0
    """How long a worker keeps trying to register before it gives up (the head may start later)."""
    register_window: float = 300.0
    """A registration whose wall-clock stamp is further than this from the head's clock is dropped."""
    reply_spin: float = 300e-6
    """Seconds the head keeps polling, instead of sleeping, after it sends a request while replies
    are awaited (yielding the CPU to any other runnable thread): a quick call's reply is then read
    without a thread wake-up (route() p50 -25 % on a 2-vCPU VM). 0 turns it off."""

    def __post_init__(self) -> None:
        for key in ("heartbeat_interval", "heartbeat_timeout", "default_deadline",
                    "register_timeout", "register_window"):
            if not getattr(self, key) > 0:
                raise ConfigError(key=f"bus.{key}", problem=f"must be above 0, got {getattr(self, key)}",
                                  fix=f"set bus.{key} to a positive number of seconds")
        if not 0 <= self.reply_spin <= 0.1:
            raise ConfigError(key="bus.reply_spin", problem=f"must be between 0 and 0.1 s, got {self.reply_spin}",
                              fix="use about one round trip of a quick call (300e-6), or 0 to never spin")
        if self.heartbeat_timeout < 2 * self.heartbeat_interval:
            raise ConfigError(key="bus.heartbeat_timeout",
                              problem=f"{self.heartbeat_timeout} s is under two heartbeat intervals "
                                      f"({self.heartbeat_interval} s): healthy peers would be declared dead",
                              fix="make heartbeat_timeout at least 2 x heartbeat_interval (3-5 x is usual)")
        if self.max_message_bytes < 1024 or self.max_frames < 1:
            raise ConfigError(key="bus.max_message_bytes",
                              problem="limits too small for a message",
                              fix="use max_message_bytes >= 1024 and max_frames >= 1")
