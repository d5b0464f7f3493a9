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
