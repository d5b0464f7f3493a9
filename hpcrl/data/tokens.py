"""Counting prompt tokens with the model's own tokenizer, on the head, before the first batch.

    measure = token_counter(config.model.path)
    measure(prompts)                     # [12, 87, ...]: what vLLM would count for each text

The count is of `Prompt.text` with the tokenizer's special tokens (a BOS), as vLLM tokenizes a text
prompt. The tokenizer (transformers' AutoTokenizer, a Rust fast tokenizer for the models hpcrl
serves) is loaded on the first call only, so a run over a builtin task never imports transformers,
and prompts are encoded in batches of BATCH by the Rust tokenizer (which spreads a batch over the
node's cores): about 10,000 prompts of ~180 tokens per second and core (docs/FACTS.md), so 100k
prompts add seconds to a start, not minutes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hpcrl.data.types import DataError, Prompt

#: Prompts encoded per tokenizer call: large enough for the fast tokenizer's batching to pay,
#: small enough that the ids of one batch never hold much memory.
BATCH = 1024


class TokenCounter:
    """A `Measure` (hpcrl.data.prompts) over the tokenizer of the model in `model_path`."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self._tokenizer: Any = None

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            except (OSError, ValueError) as err:
                raise DataError(f"cannot load the tokenizer of {self.model_path} to count prompt tokens ({err}). "
                                "Fix: point model.path at a Hugging Face checkpoint with its tokenizer files") from err
        return self._tokenizer

    def __call__(self, prompts: Sequence[Prompt]) -> list[int]:
        tokenizer = self.tokenizer()
        # A fast tokenizer's Rust backend gives the same ids as the tokenizer's own call; its
        # encode_batch_fast skips the character offsets, a third faster (docs/FACTS.md).
        backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
        lengths: list[int] = []
        for start in range(0, len(prompts), BATCH):
            texts = [p.text for p in prompts[start:start + BATCH]]
            if backend is not None:
                lengths += [len(e.ids) for e in backend.encode_batch_fast(texts, add_special_tokens=True)]
            else:
                encoded = tokenizer(texts, add_special_tokens=True, return_attention_mask=False)["input_ids"]
                lengths += [len(ids) for ids in encoded]
        return lengths


def token_counter(model_path: str) -> TokenCounter | None:
    """The measure of prompt lengths for a run of `model_path`; None without a path (a preset only:
    no tokenizer to count with, and nothing is dropped)."""
    return TokenCounter(model_path) if model_path else None
