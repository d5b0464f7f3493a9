"""Prompt lengths in the model's tokens: what the tokenizer itself gives, special tokens included."""

from __future__ import annotations

from pathlib import Path

from hpcrl.data.tokens import BATCH, token_counter
from hpcrl.data.types import Prompt


def test_prompt_lengths_are_the_tokenizers_own_counts_with_its_bos_across_batches(tiny_model: Path):
    from transformers import AutoTokenizer

    texts = [f"say {i % 10}:" + "x" * (i % 37) for i in range(BATCH + 5)]  # more than one batch
    measure = token_counter(str(tiny_model))
    assert measure is not None and token_counter("") is None  # a preset without a path: nothing to count with
    lengths = measure([Prompt(id=str(i), text=t, answer="") for i, t in enumerate(texts)])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert lengths == [len(tokenizer(t)["input_ids"]) for t in texts]
    assert lengths[0] == len("say 0:") + 1  # one token per character, and the BOS vLLM adds too
