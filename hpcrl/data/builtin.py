"""Generated tasks with verifiable answers, small enough for a tiny model on a laptop CPU.

Each task maps (split, index) to a prompt and its reference answer, deterministically, so the
data order of a run is fixed by its seed and a checkpoint only needs a cursor. The characters
used fit the tiny model's character-level tokenizer (tools/make_tiny_model.py).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

Example = dict[str, str]


def draw_seed(split: str, index: int, salt: int) -> int | str:
    """The seed of example `index` of a split (`salt`: the task's). The train split's are integers
    (salt x 7919 + index: a training stream reads index shuffle_seed x 1,000,003 + position, so every
    integer from salt x 7919 up is some seed's prompt); every other split's are strings naming the split,
    which random.Random turns into integers of over 512 bits (the string's bytes and their SHA-512), so
    no split's example is ever another split's, whatever the seeds and however long a run reads."""
    return salt * 7919 + index if split == "train" else f"hpcrl-{split}-{salt}-{index}"


def _rng(split: str, index: int, salt: int) -> random.Random:
    return random.Random(draw_seed(split, index, salt))


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


def repeat_x(split: str, index: int) -> Example:
    """"x 37:" -> 37 x's: the long-completion task (issue 39). N is log-uniform from 1 to `REPEAT_X_MOST` (256),
    so completion lengths are skewed as reasoning traces are: the median is 16 (1/16 of the longest), one in
    four is above 64. The completion is N x's and the end-of-sequence token (N + 1 tokens); the reward
    `hpcrl.reward.builtin:length_credit` gives partial credit for a near length, so a tiny model learns it."""
    rng = _rng(split, index, 7)
    n = round(2.0 ** rng.uniform(0.0, math.log2(REPEAT_X_MOST)))
    return {"id": f"repeat_x-{split}-{index}", "prompt": f"x {n}:", "answer": "x" * n}


#: The longest answer of `repeat_x`, in characters (= tokens of the tiny model).
REPEAT_X_MOST = 256

_NAMES = ("Ana", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jack", "Kim", "Leo", "Maya",
          "Noah", "Omar", "Priya")
_ITEMS = ("apples", "books", "coins", "marbles", "stickers", "pencils", "cards", "shells", "stamps", "cookies")
#: (sentence, operation): {n} and {m} are two names, {i} a plural noun, {a} and {b} the numbers.
_WORD_PROBLEMS = (
    ("{n} has {a} {i}. {n} gets {b} more {i}. How many {i} does {n} have now?", "+"),
    ("{n} had {a} {i} and gave {b} of them to {m}. How many {i} does {n} have left?", "-"),
    ("There are {a} {i} in one box and {b} {i} in another box. How many {i} are there in all?", "+"),
    ("A shop had {a} {i}. It sold {b} of them. How many {i} does the shop have now?", "-"),
    ("{n} collected {a} {i} on Monday and {b} {i} on Tuesday. How many {i} did {n} collect?", "+"),
    ("{n} wants {a} {i} and already has {b}. How many more {i} does {n} need?", "-"),
)


def word_problems(split: str, index: int) -> Example:
    """Addition and subtraction word problems in six sentence patterns, numbers 2 to 20 (a difference is
    at least 1): a task for a small pretrained chat model (configs/smollm2_word_problems.toml), answered
    as a number that the math_verify reward checks. SmolLM2-135M-Instruct gets 16 % of the test split
    right greedily before training (BENCHMARKS.md, "A real model")."""
    rng = _rng(split, index, 6)
    text, op = rng.choice(_WORD_PROBLEMS)
    n, m = rng.sample(_NAMES, 2)
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    if op == "-":
        a, b = max(a, b) + (a == b), min(a, b)
    return {"id": f"word_problems-{split}-{index}", "prompt": text.format(n=n, m=m, a=a, b=b, i=rng.choice(_ITEMS)),
            "answer": str(a + b if op == "+" else a - b)}


BUILTIN_TASKS: dict[str, Callable[[str, int], Example]] = {
    "echo": echo,
    "arithmetic": arithmetic,
    "reverse": reverse,
    "parity": parity,
    "guess": guess,
    "word_problems": word_problems,
    "repeat_x": repeat_x,
}


def builtin_task(name: str) -> Callable[[str, int], Example]:
    """The generator of builtin task `name` (KeyError if unknown; config checks catch that first)."""
    return BUILTIN_TASKS[name]
