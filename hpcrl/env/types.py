"""What crosses the bus between the head's episodes and the environment workers: plain data.

    EnvRequest(episode="p3/0", row={"id": "p3", "prompt": "guess:", "answer": "7"}, messages=[])       # reset
    EnvReply(episode="p3/0", messages=[{"role": "user", "content": "guess:"}])
    EnvRequest(episode="p3/0", row=..., messages=[...the conversation so far, the policy's turn last...])  # step
    EnvReply(episode="p3/0", messages=[{"role": "user", "content": "no, it is 7"}], reward=None, done=False)
    EnvReply(episode="p3/0", messages=None, error="timed out after 10 s")   # the episode's group is held out

A request carries everything the environment needs (the prompt's row and the whole conversation), so
any worker can serve any call: a worker that crashed or hung is replaced and nothing of an episode is
lost with it (an environment's state must follow from its row and the conversation: docs/ARCHITECTURE.md
"An environment"). A message is a chat message as transformers' chat templates take it: {"role",
"content"} and, for tools, "tool_calls" / "name" / "tool_call_id" as the template reads them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hpcrl.errors import HpcrlError

Message = dict
"""A chat message: {"role": "system" | "user" | "assistant" | "tool", "content": str, ...}."""


class EnvError(HpcrlError):
    """An environment cannot be used at all (not importable, not a class with reset and step, cannot start)."""


@dataclass(frozen=True, kw_only=True)
class EnvRequest:
    """One call to an environment: reset when `messages` is empty, else step on the conversation so far."""

    episode: str
    """The episode's id, "prompt_id/k" (k: which of the prompt's group_size episodes)."""
    row: dict
    """The prompt's row as the environment sees it: {"id", "prompt", "answer"} and the row's "extra" keys."""
    messages: list[Message] = field(default_factory=list)
    """The conversation so far: [] for reset; for step, every message, the policy's turn last."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class EnvReply:
    """What the environment answered, or why it could not."""

    episode: str
    messages: list[Message] | None = None
    """reset: the episode's first messages (the conversation the policy answers); step: the messages to append
    (a tool's output, feedback), [] if none. None with an error."""
    reward: float | None = None
    """The episode's reward when the environment gives one (usually with done); None: the run's [reward] scores
    the episode's last policy turn when it ends."""
    done: bool = False
    error: str | None = None
    """The environment raised, hung past env.step_timeout_s, killed its worker or returned something else:
    the episode has no outcome and its group is held out (never scored zero)."""
    seconds: float = 0.0
    """Wall time of the call in its worker."""

    def to_dict(self) -> dict:
        return asdict(self)
