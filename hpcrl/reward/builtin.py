"""Built-in reward functions: `module:function` names usable as reward.function.

Every function takes (prompt, completion, answer) and returns a float in [0, 1].
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0].strip() if text.strip() else ""


def exact_match(prompt: str, completion: str, answer: str) -> float:
    """1 when the completion's first line equals the answer (spaces around it ignored)."""
    return float(_first_line(completion) == answer.strip())


def _as_number(text: str) -> Fraction | None:
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def math_answer(prompt: str, completion: str, answer: str) -> float:
    """1 when the final answer (\\boxed{...}, else the last number) equals `answer` as a number."""
    boxed = _BOXED.findall(completion)
    candidates = boxed[-1:] if boxed else _NUMBER.findall(completion)[-1:]
    if not candidates:
        return 0.0
    got, want = _as_number(candidates[0].strip()), _as_number(answer.strip())
    if got is None or want is None:
        return float(candidates[0].strip() == answer.strip())
    return float(got == want)


def format_ok(prompt: str, completion: str, answer: str) -> float:
    """1 when the completion is one non-empty line with no trailing text after a newline."""
    stripped = completion.strip("\n")
    return float(bool(stripped.strip()) and "\n" not in stripped)
