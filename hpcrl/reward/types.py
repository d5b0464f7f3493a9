"""What the reward group takes and returns: plain data the head can use without starting a pool.

    Sample(id="p3/0", prompt_id="p3", prompt="1+2=", completion="3", answer="3")
    RewardResult(id="p3/0", prompt_id="p3", reward=1.0)          # or reward=None, error="why"
    RewardResult(id="p3/1", prompt_id="p3", reward=0.0, reason="killed at the CPU-time limit (4 s)")
    RewardResult(id="p3/2", prompt_id="p3", reward=1.2, parts={"math_verify": 1.0, "format_ok": 1.0})

A reward function takes (prompt, completion, answer), and `extra` (Sample.extra) when it has a parameter
of that name; it returns a number, or (number, reason): a reason says why a legitimate score is what
it is (a failed test, code killed at a limit) and travels with the result; an error (the function
raised, hung, died or returned something else) means there is no score at all, and the head holds
the sample's group out. With several weighted functions (reward.functions) `reward` is the weighted
sum and `parts` each function's own score, by its metric name.

The pool (pool.py), the reward model (model.py), the reward role and the head all use these, so
they live apart from the process pool that produces them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpcrl.errors import HpcrlError


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One completion to score."""

    id: str
    prompt_id: str
    prompt: str
    completion: str
    answer: str
    extra: dict[str, Any] = field(default_factory=dict)
    """The prompt's data.columns.extra values by column (Prompt.extra), for a function with an `extra` parameter."""


@dataclass(frozen=True, kw_only=True)
class RewardResult:
    """The score of one sample, or why there is none."""

    id: str
    prompt_id: str
    reward: float | None
    error: str | None = None
    seconds: float = 0.0
    reason: str | None = None
    """Why the score is what it is, when the function said (e.g. code_tests' limits)."""
    parts: dict[str, float] | None = None
    """With reward.functions: each function's unweighted score, by its metric name."""


@dataclass(frozen=True, kw_only=True)
class WeightedFunction:
    """One term of a combined reward: "module:function", its weight, and the name its mean is reported as."""

    name: str
    function: str
    weight: float = 1.0


class RewardError(HpcrlError):
    """The reward function cannot be used at all (not importable, not callable)."""
