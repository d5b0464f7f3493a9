"""Settings of the control bus (heartbeats, size limits, default deadline) as one frozen dataclass.

The head's heartbeat settings win: it sends them to every worker when it welcomes it, so a
run has one heartbeat_timeout however its workers were started.

Size limits at the head (what anyone who can reach its port can make it hold; README "Security"):
every frame above `max_message_bytes` closes its connection in libzmq (ZMQ_MAXMSGSIZE, per frame);
each connection queues at most `receive_queue` whole messages in libzmq before it stops reading
that connection (TCP backpressure: nothing is lost, the sender waits); a message from a
connection that is not a registered peer's (a REGISTER, a supervisor's BYE) is refused above
`max_hello_bytes` before its MAC is computed, so junk costs the head no hashing. The head of a run
takes `max_message_bytes` from the run's config (`message_limit_for`), from its largest message.
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
    """Largest message (all frames together) accepted; larger ones are dropped and counted (too_large).
    At the head also libzmq's per-frame limit (ZMQ_MAXMSGSIZE): a larger frame closes its connection."""
    max_hello_bytes: int = 64 << 10
    """Largest message accepted from a connection that is not a registered peer's (REGISTER, a
    supervisor's BYE: a few hundred bytes); larger ones are refused (too_large) before the MAC. Never
    more than max_message_bytes."""
    receive_queue: int = 8
    """Whole messages libzmq queues per connection at the head (ZMQ_RCVHWM) before it stops reading
    that connection; the sender then waits (nothing is dropped). Bounds what one connection can make
    the head hold to about (receive_queue + 1) x max_message_bytes."""
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
        if self.max_hello_bytes < 1024:
            raise ConfigError(key="bus.max_hello_bytes", problem=f"{self.max_hello_bytes} is too small for a registration",
                              fix="keep the default (64 KiB): a registration is a few hundred bytes")
        if self.receive_queue < 1:
            raise ConfigError(key="bus.receive_queue", problem=f"must be at least 1, got {self.receive_queue}",
                              fix="keep the default (8 messages per connection)")


#: The head's refused-message counters in the run directory (JSON: {"refused": {reason: n}, "time": ...}),
#: rewritten when they change (at most every few seconds) and read by `hpcrl status`.
REFUSED_FILE = "bus_refused.json"

#: Bytes of one sequence token in the largest bus messages, as msgpack writes them: a token id (up to 5),
#: its logprob (a float64: 9), a policy-mask or per-token advantage entry (up to 9), and its share of the
#: completion's text (BPE tokens average 3-5 bytes of UTF-8; 25 leaves room for long ones).
BYTES_PER_TOKEN = 48
#: Bytes of one sequence besides its tokens (map keys, prompt id, finish reason, reward fields).
BYTES_PER_SEQUENCE = 512
#: The head's limit is twice the largest message's estimate, and never under this.
MIN_MESSAGE_BYTES = 16 << 20


def message_limit_for(*, sequences: int, tokens_per_sequence: int) -> int:
    """The head's `max_message_bytes` for a run: twice the largest message it receives, never under 16 MiB.

    The largest messages a head receives are an inference replica's reply to `generate` (at most a
    batch's sequences, each prompt + completion token ids, logprobs and text) and the `logprobs`
    replies (one float per token); everything else (registrations, heartbeats, train-step metrics,
    rewards) is kilobytes. So the limit is `sequences` (trainer.global_batch_size) x
    `tokens_per_sequence` (the model's max_model_len) x 48 bytes + 512 bytes per sequence, doubled.
    E.g. 64 x 768 tokens: 2.4 MB -> 16 MiB (the floor); 512 x 8192 tokens: 201 MB -> 403 MB."""
    estimate = sequences * (tokens_per_sequence * BYTES_PER_TOKEN + BYTES_PER_SEQUENCE)
    return max(MIN_MESSAGE_BYTES, 2 * estimate)
