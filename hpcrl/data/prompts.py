"""The prompt stream of a run: a fixed, seeded order over a data file or a builtin task, with a cursor.

    stream = PromptStream.from_config(config.data, measure=token_counter(config.model.path),
                                      chat=chat_template_for(config.data, config.model.path))
    batch = stream.next_batch(8)          # [Prompt(id, text, answer, messages, extra, token_ids), ...]
    state = stream.state_dict()           # {"cursor": 8, ...}: all a checkpoint needs
    PromptStream.from_config(config.data).load_state_dict(state)   # continues with prompt 9
    stream.eval_prompts()                 # the held-out prompts, a fixed list (data.eval_*)
    stream.dropped                        # prompts over data.max_prompt_tokens, left out

At start a file source (hpcrl.data.sources) is read whole, then, in this order:
1. data.eval_fraction holds out that share of its rows, drawn from shuffle_seed alone (data.eval_source
   reads a second source instead): evaluation prompts are never trained on.
2. `measure` gives every prompt's length in tokens, all in one batched call; prompts longer than
   data.max_prompt_tokens are dropped (vLLM would refuse them), counted, and logged once. In the chat
   format (`chat`, hpcrl.data.chat) the length is that of the rendered template, system prompt included.
3. Every epoch over the prompts kept is a new permutation drawn from (shuffle_seed, epoch).
So the order is a pure function of the seed and the cursor, given the same data and config: a resumed
run sees exactly the prompts it would have (the checkpoint holds the number of prompts, and a
resume over a different number is refused). Builtin tasks are unbounded, each index its own
deterministic example, and not measured (their prompts are a few characters; in the chat format a
batch whose rendering is over max_prompt_tokens is an error naming the prompt).

In the chat format next_batch and eval_prompts hand out prompts with their token ids (Prompt.token_ids),
rendered batch by batch (a batch takes milliseconds), not kept for the whole file: 100k prompts of
~200 tokens would hold ~700 MB of Python ints on the head. The rendering is a pure function of the
row and the tokenizer, so the ids measured at start are the ids generated from.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from hpcrl.config.schema import DataConfig
from hpcrl.data.builtin import builtin_task
from hpcrl.data.chat import ChatTemplate
from hpcrl.data.sources import check_columns, read_prompts
from hpcrl.data.types import DataError, Prompt

__all__ = ["DataError", "Measure", "Prompt", "PromptStream", "check_data"]

log = logging.getLogger(__name__)

#: Prompts -> their lengths in tokens, in order (hpcrl.data.tokens.token_counter; the chat format
#: measures the rendered template).
Measure = Callable[[Sequence[Prompt]], list[int]]

#: Evaluation prompts of a builtin eval_source when data.eval_size is 0.
BUILTIN_EVAL_SIZE = 64


def _builtin_prompt(task: str, split: str, index: int) -> Prompt:
    example = builtin_task(task)(split, index)
    return Prompt(id=example["id"], text=example["prompt"], answer=example["answer"])


def check_data(data: DataConfig) -> None:
    """Read the prompts as the start of a run does (PromptStream.from_config: every row of data.source and
    data.eval_source, checked, and the eval_fraction hold-out), so that `hpcrl plan` and `hpcrl submit`
    refuse what the job would, where this machine can read the files (a login node may not see the compute
    nodes' file system: then the job's start is the first to read them). Prompt lengths are not measured
    here (that needs the model's tokenizer). A ConfigError for a missing column, a DataError for the rest."""
    check_columns(data)
    files = [s for s in (data.source, data.eval_source) if s and not s.startswith("builtin:")]
    if all(os.access(Path(f), os.R_OK) for f in files):
        PromptStream.from_config(data)


def hold_out(count: int, fraction: float, seed: int) -> set[int]:
    """The row indices of `count` held out for evaluation: round(fraction * count), at least one,
    drawn from `seed` alone (not from the order's seeds), so a run and its resumes hold out the same rows."""
    held = max(1, round(fraction * count))
    if held >= count:
        raise DataError(f"data.eval_fraction = {fraction} of {count} prompts leaves none to train on. "
                        "Fix: lower eval_fraction, or add prompts")
    return set(random.Random(f"hpcrl-eval-{seed}").sample(range(count), held))


class PromptStream:
    """Prompts in a seeded order; see the module docstring."""

    def __init__(self, *, prompts: list[Prompt] | None, task: str | None, split: str, seed: int,
                 eval_prompts: Sequence[Prompt] = (), dropped: int = 0, eval_dropped: int = 0,
                 chat: ChatTemplate | None = None, max_prompt_tokens: int = 0) -> None:
        if prompts is not None and not prompts:
            raise DataError("no prompts are left to train on. Fix: check data.source and data.max_prompt_tokens")
        self._prompts = prompts
        self._task = task
        self._split = split
        self._seed = seed
        self._cursor = 0
        self._eval = list(eval_prompts)
        self._order: tuple[int, list[int]] = (-1, [])  # the permutation of the epoch last read
        self._chat = chat
        self._limit = max_prompt_tokens
        if chat is not None:
            self._eval = self._rendered(self._eval)
        self.dropped = dropped
        """Training prompts left out for being longer than data.max_prompt_tokens."""
        self.eval_dropped = eval_dropped
        """Evaluation prompts left out for the same reason."""

    @classmethod
    def from_config(cls, data: DataConfig, *, measure: Measure | None = None,
                    chat: ChatTemplate | None = None) -> PromptStream:
        """The stream of `data`; `measure` counts prompt tokens (None: nothing is dropped for length);
        `chat` renders prompts in the chat format (hpcrl.data.chat.chat_template_for), and measures them
        in place of `measure`."""
        if chat is not None:
            measure = chat
        builtin = data.source.startswith("builtin:")
        prompts = None if builtin else read_prompts(Path(data.source), split=data.split, columns=data.column_names)
        evals: list[Prompt] = []
        if data.eval_fraction and prompts is not None:
            held = hold_out(len(prompts), data.eval_fraction, data.shuffle_seed)
            evals = [p for i, p in enumerate(prompts) if i in held]
            prompts = [p for i, p in enumerate(prompts) if i not in held]
        elif data.eval_source.startswith("builtin:"):
            task = data.eval_source.removeprefix("builtin:")
            evals = [_builtin_prompt(task, data.eval_split, i) for i in range(data.eval_size or BUILTIN_EVAL_SIZE)]
        elif data.eval_source:
            evals = read_prompts(Path(data.eval_source), split=data.eval_split, columns=data.column_names)
        dropped = eval_dropped = 0
        file_eval = bool(data.eval_source) and not data.eval_source.startswith("builtin:")
        if measure is not None and (prompts is not None or file_eval):
            prompts, evals, dropped, eval_dropped = _drop_long(prompts, evals, measure, data)
            if prompts == []:
                raise DataError(f"all {dropped} prompts of {data.source} are longer than data.max_prompt_tokens = "
                                f"{data.max_prompt_tokens} tokens. Fix: raise max_prompt_tokens")
        if data.eval_size:
            evals = evals[:data.eval_size]
        return cls(prompts=prompts, task=data.source.removeprefix("builtin:") if builtin else None,
                   split=data.split, seed=data.shuffle_seed, eval_prompts=evals, dropped=dropped,
                   eval_dropped=eval_dropped, chat=chat, max_prompt_tokens=data.max_prompt_tokens)

    def _at(self, position: int) -> Prompt:
        if self._task is not None:
            # Builtin tasks: a seeded stride over an unbounded index space.
            return _builtin_prompt(self._task, self._split, self._seed * 1_000_003 + position)
        assert self._prompts is not None
        epoch, offset = divmod(position, len(self._prompts))
        if self._order[0] != epoch:
            order = list(range(len(self._prompts)))
            random.Random(self._seed * 10_007 + epoch).shuffle(order)
            self._order = (epoch, order)
        prompt = self._prompts[self._order[1][offset]]
        # After the first epoch a row's id carries its epoch ("row-3~e1"): a file smaller than a batch
        # repeats rows within one batch, and every prompt of a batch (every completion scored) needs its own id.
        return replace(prompt, id=f"{prompt.id}~e{epoch}") if epoch else prompt

    def next_batch(self, size: int) -> list[Prompt]:
        """The next `size` prompts."""
        batch = [self._at(self._cursor + i) for i in range(size)]
        if self._chat is not None:
            batch = self._rendered(batch)
        self._cursor += size
        return batch

    def _rendered(self, prompts: list[Prompt]) -> list[Prompt]:
        """`prompts` with their chat-format token ids, checked against max_prompt_tokens (a file's prompts
        over it were dropped at start; a builtin task's are not measured, so their first check is here)."""
        assert self._chat is not None
        rendered = self._chat.with_ids(prompts)
        if self._limit:
            for prompt in rendered:
                if prompt.token_ids is not None and len(prompt.token_ids) > self._limit:
                    raise DataError(f"prompt {prompt.id!r} is {len(prompt.token_ids)} tokens in the chat format, "
                                    f"over data.max_prompt_tokens = {self._limit}. Fix: raise max_prompt_tokens "
                                    "(the template and data.system_prompt count)")
        return rendered

    def eval_prompts(self) -> list[Prompt]:
        """The held-out evaluation prompts (data.eval_source or data.eval_fraction, at most data.eval_size),
        the same list on every call and every resume; empty when the config names none."""
        return list(self._eval)

    @property
    def cursor(self) -> int:
        return self._cursor

    @property
    def format(self) -> str:
        """How prompts reach the model: "chat" (rendered with its chat template, hpcrl.data.chat) or "text"."""
        return "text" if self._chat is None else "chat"

    @property
    def size(self) -> int | None:
        """Training prompts in one epoch (None: a builtin task, unbounded)."""
        return None if self._prompts is None else len(self._prompts)

    def state_dict(self) -> dict:
        state = {"cursor": self._cursor, "seed": self._seed, "split": self._split, "format": self.format}
        if self._prompts is not None:
            state["prompts"] = len(self._prompts)
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed") != self._seed or state.get("split") != self._split:
            raise DataError(f"checkpoint's prompt order (seed {state.get('seed')}, split {state.get('split')!r}) "
                            f"differs from the config's (seed {self._seed}, split {self._split!r}). Fix: resume "
                            "with the run's own config")
        # Checkpoints from before the format was kept were made in the text format.
        if state.get("format", "text") != self.format:
            raise DataError(f"checkpoint's prompts were given to the model in the {state.get('format', 'text')} "
                            f"format, the config gives the {self.format} format (data.format), so the resumed policy "
                            "would see its prompts otherwise. Fix: set data.format = "
                            f"\"{state.get('format', 'text')}\" (a checkpoint made before the chat format was text)")
        # Checkpoints from before the count was kept have none: they are taken as they are.
        if "prompts" in state and state["prompts"] != self.size:
            raise DataError(f"checkpoint's prompt order is over {state['prompts']} prompts, the config gives "
                            f"{self.size} (the data file, data.columns, the eval split, data.max_prompt_tokens or "
                            "data.system_prompt changed), so the resumed run would not see the prompts it would have. "
                            "Fix: resume with the run's own data and config")
        self._cursor = int(state["cursor"])


def _drop_long(prompts: list[Prompt] | None, evals: list[Prompt], measure: Measure,
               data: DataConfig) -> tuple[list[Prompt] | None, list[Prompt], int, int]:
    """Leave out the prompts longer than data.max_prompt_tokens (measured in one call) and log one line."""
    limit = data.max_prompt_tokens
    train = prompts or []
    lengths = measure(train + evals)
    if len(lengths) != len(train) + len(evals):
        raise DataError(f"the prompt measure returned {len(lengths)} lengths for {len(train) + len(evals)} prompts")
    train_kept = [p for p, n in zip(train, lengths) if n <= limit]
    eval_kept = [p for p, n in zip(evals, lengths[len(train):]) if n <= limit]
    dropped, eval_dropped = len(train) - len(train_kept), len(evals) - len(eval_kept)
    if dropped or eval_dropped:
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        example = (train + evals)[longest]
        held = f" ({eval_dropped} of the {len(evals)} evaluation prompts)" if eval_dropped else ""
        log.warning(f"dropped {dropped + eval_dropped} of {len(lengths)} prompts longer than data.max_prompt_tokens "
                    f"= {limit} tokens{held}; the longest, {example.id!r}, has {lengths[longest]}. Raise "
                    "max_prompt_tokens to keep them")
    return (train_kept if prompts is not None else None), eval_kept, dropped, eval_dropped
