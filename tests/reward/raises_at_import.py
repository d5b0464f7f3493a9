"""A reward module that fails as it is imported (a typo in a module-level constant, say)."""

LIMITS = {"cpu_s": 1}["cpu"]


def score(prompt: str, completion: str, answer: str) -> float:
    return 1.0
