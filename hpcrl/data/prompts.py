"""The prompt stream of a run: a fixed, seeded order over a JSONL file or a builtin task, with a cursor.

    stream = PromptStream.from_config(config.data)
    batch = stream.next_batch(8)          # [Prompt(id, text, answer), ...]
    state = stream.state_dict()           # {"cursor": 8, ...}: all a checkpoint needs
    PromptStream.from_config(config.data).load_state_dict(state)   # continues with prompt 9

Every epoch over a file is a new permutation drawn from (shuffle_seed, epoch), so the order is a
pure function of the seed and the cursor: a resumed run sees exactly the prompts it would have.
Builtin tasks are unbounded, each index its own deterministic example.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from hpcrl.config.schema import DataConfig
from hpcrl.data.builtin import builtin_task
from hpcrl.errors import HpcrlError


class DataError(HpcrlError):
    """A prompt file is unusable (bad JSON, missing keys)."""


@dataclass(frozen=True, kw_only=True)
class Prompt:
    id: str
    text: str
    answer: str


def read_jsonl(path: Path, *, prompt_key: str, answer_key: str) -> list[Prompt]:
    """Every line of a JSONL prompt file; a bad line is an error naming the file and line."""
    prompts = []
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{number}: not valid JSON ({err}). Fix: one JSON object per line") from None
            if not isinstance(row, dict) or prompt_key not in row or answer_key not in row:
                raise DataError(f"{path}:{number}: needs the keys {prompt_key!r} and {answer_key!r}. "
                                "Fix: add them, or set data.prompt_key / data.answer_key")
            prompts.append(Prompt(id=str(row.get("id", f"{path.stem}-{number}")), text=str(row[prompt_key]),
                                  answer=str(row[answer_key])))
    if not prompts:
        raise DataError(f"{path}: holds no prompts. Fix: add lines, or point data.source elsewhere")
    return prompts


class PromptStream:
    """Prompts in a seeded order; see the module docstring."""

    def __init__(self, *, prompts: list[Prompt] | None, task: str | None, split: str, seed: int) -> None:
        self._prompts = prompts
        self._task = builtin_task(task) if task else None
        self._split = split
        self._seed = seed
        self._cursor = 0

    @classmethod
    def from_config(cls, data: DataConfig) -> PromptStream:
        if data.source.startswith("builtin:"):
            return cls(prompts=None, task=data.source.removeprefix("builtin:"), split=data.split,
                       seed=data.shuffle_seed)
        prompts = read_jsonl(Path(data.source), prompt_key=data.prompt_key, answer_key=data.answer_key)
        return cls(prompts=prompts, task=None, split=data.split, seed=data.shuffle_seed)

    def _at(self, position: int) -> Prompt:
        if self._task is not None:
            # Builtin tasks: a seeded stride over an unbounded index space.
            example = self._task(self._split, self._seed * 1_000_003 + position)
            return Prompt(id=example["id"], text=example["prompt"], answer=example["answer"])
        assert self._prompts is not None
        epoch, offset = divmod(position, len(self._prompts))
        order = list(range(len(self._prompts)))
        random.Random(self._seed * 10_007 + epoch).shuffle(order)
        return self._prompts[order[offset]]

    def next_batch(self, size: int) -> list[Prompt]:
        batch = [self._at(self._cursor + i) for i in range(size)]
        self._cursor += size
        return batch

    @property
    def cursor(self) -> int:
        return self._cursor

    def state_dict(self) -> dict:
        return {"cursor": self._cursor, "seed": self._seed, "split": self._split}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed") != self._seed or state.get("split") != self._split:
            raise DataError(f"checkpoint's prompt order (seed {state.get('seed')}, split {state.get('split')!r}) "
                            f"differs from the config's (seed {self._seed}, split {self._split!r}). Fix: resume "
                            "with the run's own config")
        self._cursor = int(state["cursor"])
