"""Reward functions that misbehave on purpose, for tests of the reward pool."""

import os
import time


def by_prompt(prompt: str, completion: str, answer: str) -> float:
    """Misbehaves as the prompt says: raise, hang, die, nan, text (slow: takes 0.6 s); else exact match."""
    if prompt == "raise":
        raise ValueError("verifier bug")
    if prompt == "hang":
        time.sleep(3600)
    if prompt == "die":
        os._exit(7)
    if prompt == "slow":
        time.sleep(0.6)
    if prompt == "nan":
        return float("nan")
    if prompt == "text":
        return "yes"  # type: ignore[return-value]
    return float(completion.strip() == answer)


def code_tests_quick(prompt: str, completion: str, answer: str) -> tuple[float, str]:
    """hpcrl.reward.builtin.code_tests with limits small enough for tests: 1 s of CPU, 2 s of wall
    time, 256 MiB, 16 processes."""
    from hpcrl.workers.sandbox import Limits, extract_code, run_tests

    outcome = run_tests(extract_code(completion), answer, Limits(cpu_s=1, wall_s=2, memory_mib=256, processes=16))
    return float(outcome.passed), outcome.reason


def half(prompt: str, completion: str, answer: str) -> float:
    """0.5 always; "raise" as the prompt makes it raise, to show one failing part fails the sample."""
    if prompt == "raise":
        raise ValueError("half failed")
    return 0.5


def needs_what_is_missing(prompt: str, completion: str, answer: str) -> float:
    """Never scores: its start-up check fails, as code_tests' does where no sandbox can be built."""
    return 1.0


def _missing() -> None:
    raise RuntimeError("this node lacks what the function needs")


needs_what_is_missing.check_at_start = _missing  # type: ignore[attr-defined]


def numbers_of_other_types(prompt: str, completion: str, answer: str) -> object:
    """A number of the type the prompt names: numpy's float32 / int64 / bool_, an int past a float's range,
    or a large float (weighted twice it overflows to inf)."""
    import numpy

    return {"float32": numpy.float32(0.5), "int64": numpy.int64(1), "bool_": numpy.bool_(True), "huge": 10 ** 400,
            "huger": 10 ** 5000, "large": 1e308, "nan": float("nan")}[prompt]


def given_extra(prompt: str, completion: str, answer: str, extra: dict) -> float:
    """1 when the completion is in the row's data.columns.extra "accepted" list (answer left empty)."""
    return float(completion in extra["accepted"])


def given_kwargs(prompt: str, completion: str, answer: str, **kwargs) -> float:
    """The number of extra columns a function taking **kwargs is given."""
    return float(len(kwargs["extra"]))


def surrogate_reason(prompt: str, completion: str, answer: str) -> tuple[float, str]:
    """A reason (or, with prompt "raise", an exception) holding a lone surrogate, as bytes decoded with
    errors="surrogateescape" do."""
    if prompt == "raise":
        raise ValueError("cannot read b'\udc80'")
    return 0.0, "output: \udc80"
