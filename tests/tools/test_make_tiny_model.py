"""tools/make_tiny_model.py makes a loadable checkpoint whose shape is the preset's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.config.model_shapes import PRESETS, from_hf_config
from hpcrl.data import BUILTIN_TASKS

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_tiny_model_has_the_preset_shape_and_a_character_tokenizer(preset: str, tmp_path: Path):
    out = tmp_path / preset
    done = subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny_model.py"), "--preset", preset,
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == (f"{out}: made {preset} (seed 0)\n", "")  # one line; no progress bar
    assert from_hf_config(json.loads((out / "config.json").read_text())) == PRESETS[preset]

    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    weights = load_file(out / "model.safetensors")
    expected = dict(PRESETS[preset].hf_parameters())
    assert {name: tuple(t.shape) for name, t in weights.items()} == expected
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in weights.values())

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) <= PRESETS[preset].vocab_size
    # A chat template where the vocabulary has room for its four turn tokens (tiny-qwen2 has 100 ids).
    assert bool(tokenizer.chat_template) == (preset != "tiny-qwen2")
    for task in BUILTIN_TASKS.values():
        example = task("train", 3)
        text = example["prompt"] + example["answer"]
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert len(ids) == len(text)                # one token per character
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text

    again = subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny_model.py"), "--preset", preset,
                            "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert "already made" in again.stdout
