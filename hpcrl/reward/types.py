"""What the reward group takes and returns: plain data the head can use without starting a pool.

    Sample(id="p3/0", prompt_id="p3", prompt="1+2=", completion="3", answer="3")
    RewardResult(id="p3/0", prompt_id="p3", reward=1.0)          # or reward=None, error="why"

The pool (pool.py), the reward model (model.py), the reward role and the head all use these, so
they live apart from the process pool that produces them.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.errors import HpcrlError


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One completion to score."""

    id: str
    prompt_id: str
    prompt: str
    completion: str
    answer: str


@dataclass(frozen=True, kw_only=True)
class RewardResult:
    """The score of one sample, or why there is none."""

    id: str
    prompt_id: str
    reward: float | None
    error: str | None = None
    seconds: float = 0.0


class RewardError(HpcrlError):
    """The reward function cannot be used at all (not importable, not callable)."""
