"""Built-in reward functions: `module:function` names usable as reward.function.

Every function takes (prompt, completion, answer) and returns a float in [0, 1] (code_tests: with
the reason of a 0). They run in the reward pool's worker processes (hpcrl.reward.pool), in each
worker's main thread, which math_verify's timer needs.
"""

from __future__ import annotations

import logging
import re
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction

from hpcrl.reward.types import RewardError
from hpcrl.workers.sandbox import Limits, check_sandbox, extract_code, run_tests

#: Seconds math_verify may spend on one sample (parsing both sides and comparing) before it is an error.
MATH_VERIFY_TIMEOUT_S = 5.0
#: code_tests' limits: a wall time under reward.timeout_s's default (10 s), so the sandbox, not the pool, stops it.
CODE_TESTS_LIMITS = Limits()

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0].strip() if text.strip() else ""


def exact_match(prompt: str, completion: str, answer: str) -> float:
    """1 when the completion's first line equals the answer (spaces around it ignored)."""
    return float(_first_line(completion) == answer.strip())


def length_credit(prompt: str, completion: str, answer: str) -> float:
    """Partial credit for writing `answer` (builtin:repeat_x: N x's): the share of the completion's characters
    that are the answer's character, times 1 - |length - N| / N (0 below 0). Exactly N of them scores 1; one
    too many or too few scores 1 - 1/N, so a long answer's near misses still teach."""
    want = answer.strip()
    if not want:
        return float(not completion.strip())
    got = completion.strip()
    if not got:
        return 0.0
    share = got.count(want[0]) / len(got)
    return share * max(0.0, 1.0 - abs(len(got) - len(want)) / len(want))


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


def boxed_format(prompt: str, completion: str, answer: str) -> float:
    """1 when the completion puts one final answer in \\boxed{...} and stops soon after it (at most 64
    characters follow): the format reward paired with math_verify, as instruct models are prompted
    ("put your final answer within \\boxed{}"). The answer's correctness is math_verify's to score."""
    ends = []
    start = completion.find("\\boxed{")
    while start >= 0:
        depth, at = 0, start + len("\\boxed")
        while at < len(completion):  # the matching brace: answers nest them (\\frac{1}{2})
            depth += {"{": 1, "}": -1}.get(completion[at], 0)
            if depth == 0:
                break
            at += 1
        if depth:
            return 0.0  # unclosed
        ends.append(at + 1)
        start = completion.find("\\boxed{", at + 1)
    return float(len(ends) == 1 and len(completion) - ends[0] <= 64)


class _Overtime(BaseException):
    """Raised by math_verify's timer. A BaseException, so that math-verify's own `except Exception`
    clauses (which turn errors into a silent False) let it through."""


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """SIGALRM after `seconds` in the main thread (the pool's workers); elsewhere the pool's timeout
    bounds it. A timer already running (e.g. pytest-timeout's) is put back with its remaining time."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise _Overtime

    previous = signal.signal(signal.SIGALRM, expire)
    began = time.monotonic()
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, outer - (time.monotonic() - began)))


_warmed = False


def _warm_math_verify(parse, verify) -> None:
    """A first parse and verify in this process, outside the deadline: they import more of SymPy and the
    LaTeX parser, and an import that the timer cuts leaves those modules half made for the whole process
    (every later answer then "does not parse"). Slow on a loaded node, not a pathological input."""
    global _warmed
    if not _warmed:
        verify(parse("$\\frac{1}{2}$", parsing_timeout=None), parse("\\boxed{[1, 2)} and x < 3", parsing_timeout=None),
               timeout_seconds=None)
        _warmed = True


def _quiet_math_verify() -> None:
    """math-verify warns once per process that its own timeouts are off: ours (_deadline) stands in."""
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _TimeoutOffFilter) for f in logger.filters):
            logger.addFilter(_TimeoutOffFilter())


class _TimeoutOffFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


def math_verify(prompt: str, completion: str, answer: str) -> float:
    """1 when the completion's final answer equals `answer` as Hugging Face's math-verify judges it: the
    \\boxed{...} (all boxed parts together), else the last LaTeX or plain expression, compared as numbers,
    fractions, LaTeX expressions, sets, intervals or matrices. `answer` is LaTeX or plain math ("\\frac12",
    "[1, 2)", "0.5"). Over MATH_VERIFY_TIMEOUT_S, or with an answer that is not math, it raises: an error
    (the group held out), not a 0."""
    try:
        from math_verify import parse, verify
    except ImportError as err:
        raise RewardError(f"math_verify needs the math-verify package ({err}): pip install 'hpcrl[math]'") from None
    _quiet_math_verify()
    _warm_math_verify(parse, verify)
    try:
        with _deadline(MATH_VERIFY_TIMEOUT_S):
            gold = parse(answer if "\\boxed" in answer or "$" in answer else f"${answer}$", parsing_timeout=None)
            if not gold:
                raise ValueError(f"the answer {answer!r} does not parse as math; check the data set's answer column")
            return float(verify(gold, parse(completion, parsing_timeout=None), timeout_seconds=None))
    except _Overtime:
        raise TimeoutError(f"math-verify took more than {MATH_VERIFY_TIMEOUT_S:g} s") from None


def code_tests(prompt: str, completion: str, answer: str) -> tuple[float, str]:
    """1 when the completion's code (its last ```python block, else all of it) passes the tests in
    `answer` (`assert f(1) == 2` lines, or a `check(f)` call: run in a sandbox of their own against the
    code's top-level names, which the code's sandbox serves), with CODE_TESTS_LIMITS
    (hpcrl.workers.sandbox); 0 with the reason otherwise."""
    outcome = run_tests(extract_code(completion), answer, CODE_TESTS_LIMITS)
    return float(outcome.passed), outcome.reason


code_tests.check_at_start = check_sandbox  # type: ignore[attr-defined]  # the pool runs it as a worker starts
