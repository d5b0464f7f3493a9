"""The prompt stream: seeded order, epochs, cursor state, bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcrl.config.schema import DataConfig
from hpcrl.data.prompts import DataError, PromptStream


def jsonl(tmp_path: Path, rows: list) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_file_is_shuffled_per_epoch_and_every_prompt_comes_once_per_epoch(tmp_path: Path):
    path = jsonl(tmp_path, [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)])
    stream = PromptStream.from_config(DataConfig(source=str(path), shuffle_seed=3))
    first, second = stream.next_batch(5), stream.next_batch(5)
    assert sorted(p.text for p in first) == sorted(p.text for p in second) == [f"q{i}" for i in range(5)]
    assert [p.text for p in first] != [p.text for p in second]  # a new permutation each epoch


def test_a_resumed_stream_continues_with_exactly_the_next_prompts(tmp_path: Path):
    config = DataConfig(source="builtin:arithmetic", shuffle_seed=11)
    whole = PromptStream.from_config(config).next_batch(12)
    first = PromptStream.from_config(config)
    first.next_batch(5)
    resumed = PromptStream.from_config(config)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert resumed.next_batch(7) == whole[5:]


def test_state_from_another_seed_is_refused():
    stream = PromptStream.from_config(DataConfig(source="builtin:reverse", shuffle_seed=1))
    state = stream.state_dict()
    with pytest.raises(DataError, match="differs from the config"):
        PromptStream.from_config(DataConfig(source="builtin:reverse", shuffle_seed=2)).load_state_dict(state)


def test_a_bad_line_is_reported_with_file_and_line(tmp_path: Path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "answer": "b"}\n{"prompt": "a"}\n')
    with pytest.raises(DataError, match=r"p.jsonl:2: needs the keys 'prompt' and 'answer'"):
        PromptStream.from_config(DataConfig(source=str(path)))
    path.write_text("not json\n")
    with pytest.raises(DataError, match=r"p.jsonl:1: not valid JSON"):
        PromptStream.from_config(DataConfig(source=str(path)))
