"""A prompt as the run carries it: from the data source to vLLM, the reward and the trainer.

Its fields travel over the bus as a plain dict (`dataclasses.asdict`, msgpack), so `messages` and
`extra` hold only strings, numbers, booleans, None, lists and string-keyed dicts (the readers check).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpcrl.errors import HpcrlError


class DataError(HpcrlError):
    """A prompt source is unusable (bad JSON, a bad value in a row, no prompts left)."""


@dataclass(frozen=True, kw_only=True)
class Prompt:
    id: str
    """Unique within its source: the id column, or FILE-ROW."""
    text: str
    """The prompt as plain text. For a row of messages, their contents one per line: the chat format
    renders `messages` with the model's template instead."""
    answer: str
    """The reference answer given to the reward ("" when data.columns.answer is "")."""
    messages: list[dict[str, Any]] | None = None
    """The row's OpenAI-style [{role, content}, ...] conversation, or None for a plain text prompt."""
    extra: dict[str, Any] = field(default_factory=dict)
    """data.columns.extra: column name -> the row's value, for rewards."""
    token_ids: list[int] | None = None
    """In the chat format: the prompt rendered with the model's chat template (hpcrl.data.chat), the ids
    vLLM generates from as they are; None in the text format, where vLLM tokenizes `text`."""
    prefix: list[int] | None = None
    """A partial rollout carried to a later window (hpcrl.rl.partial): the ids vLLM goes on from, the
    prompt's ids as vLLM read them and the tokens generated so far; None for a fresh prompt."""
