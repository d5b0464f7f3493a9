"""Generated tasks with verifiable answers, small enough for a tiny model on a laptop CPU.

Each task maps (split, index) to a prompt and its reference answer, deterministically, so the
data order of a run is fixed by its seed and a checkpoint only needs a cursor. The characters
used fit the tiny model's character-level tokenizer (tools/make_tiny_model.py).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable

Example = dict[str, str]

# Distinct seeds per split keep train and test prompts apart.
_SPLIT_SALT = {"train": 0, "test": 1_000_003}


def _rng(split: str, index: int, salt: int) -> random.Random:
    return random.Random(salt * 7919 + _SPLIT_SALT.get(split, zlib.crc32(split.encode())) + index)


def echo(split: str, index: int) -> Example:
    """"say 7:" -> "7": the embedded default's task, learnable by a tiny random model in ~200 RL steps."""
    rng = _rng(split, index, 4)
    digit = rng.randrange(10)
    return {"id": f"echo-{split}-{index}", "prompt": f"say {digit}:", "answer": str(digit)}


def arithmetic(split: str, index: int) -> Example:
    """"a+b=" with one-digit operands; the answer is the sum's digits."""
    rng = _rng(split, index, 1)
    a, b = rng.randrange(10), rng.randrange(10)
    return {"id": f"arithmetic-{split}-{index}", "prompt": f"{a}+{b}=", "answer": str(a + b)}


def reverse(split: str, index: int) -> Example:
    """"rev abc:" -> "cba", three to five lowercase letters."""
    rng = _rng(split, index, 2)
    word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 5)))
    return {"id": f"reverse-{split}-{index}", "prompt": f"rev {word}:", "answer": word[::-1]}


def parity(split: str, index: int) -> Example:
    """A bit string; the answer is "1" when it holds an odd number of ones, else "0"."""
    rng = _rng(split, index, 3)
    bits = "".join(rng.choice("01") for _ in range(rng.randint(2, 6)))
    return {"id": f"parity-{split}-{index}", "prompt": f"par {bits}:", "answer": str(bits.count("1") % 2)}


def guess(split: str, index: int) -> Example:
    """"guess:" -> a hidden digit: the "feedback" environment's task (hpcrl.env.builtin), where a wrong
    first guess is told the digit and the second try is scored."""
    rng = _rng(split, index, 5)
    return {"id": f"guess-{split}-{index}", "prompt": "guess:", "answer": str(rng.randrange(10))}


BUILTIN_TASKS: dict[str, Callable[[str, int], Example]] = {
    "echo": echo,
    "arithmetic": arithmetic,
    "reverse": reverse,
    "parity": parity,
    "guess": guess,
}


def builtin_task(name: str) -> Callable[[str, int], Example]:
    """The generator of builtin task `name` (KeyError if unknown; config checks catch that first)."""
    return BUILTIN_TASKS[name]
