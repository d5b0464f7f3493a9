"""The prompt stream: seeded order, epochs, cursor state across resume for every source, bad files,
the held-out evaluation prompts, and over-long prompts dropped."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from data_files import parquet, saved_dataset

from hpcrl.config.schema import DataConfig
from hpcrl.data.prompts import DataError, PromptStream
from hpcrl.data.tokens import token_counter
from hpcrl.errors import ConfigError


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
    with pytest.raises(ConfigError, match=r"p.jsonl:2 has no column 'answer' \(its columns: prompt\)"):
        PromptStream.from_config(DataConfig(source=str(path)))
    path.write_text("not json\n")
    with pytest.raises(DataError, match=r"p.jsonl:1: not valid JSON"):
        PromptStream.from_config(DataConfig(source=str(path)))


def rows(count: int, *, long_every: int = 0) -> list[dict]:
    """`count` rows "q<i>" with answers; every `long_every`-th prompt is 40 characters longer (the tiny
    model's tokenizer has one token per character, plus a BOS)."""
    return [{"id": f"r{i}", "prompt": f"q{i}" + ("x" * 40 if long_every and i % long_every == 0 else ""),
             "answer": str(i)} for i in range(count)]


def source(tmp_path: Path, kind: str, table: list[dict]) -> Path:
    if kind == "parquet":
        return parquet(tmp_path / "d.parquet", table)
    if kind == "datasets":
        return saved_dataset(tmp_path / "d", {"train": table})
    return jsonl(tmp_path, table)


@pytest.mark.parametrize("kind", ["parquet", "datasets", "jsonl"])
def test_every_source_resumes_at_the_same_prompt_with_over_long_prompts_dropped(tmp_path: Path, kind: str,
                                                                                  tiny_model: Path):
    config = DataConfig(source=str(source(tmp_path, kind, rows(20, long_every=4))), shuffle_seed=5,
                        max_prompt_tokens=16)
    measure = token_counter(str(tiny_model))
    whole = PromptStream.from_config(config, measure=measure)
    assert (whole.size, whole.dropped) == (15, 5)
    expected = whole.next_batch(40)  # two epochs and a bit
    assert not any("x" in p.text for p in expected)
    first = PromptStream.from_config(config, measure=measure)
    first.next_batch(23)
    resumed = PromptStream.from_config(config, measure=measure)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert resumed.next_batch(17) == expected[23:]


def test_an_over_long_prompt_is_dropped_counted_and_reported_in_one_warning(tmp_path: Path, tiny_model: Path,
                                                                             caplog: pytest.LogCaptureFixture):
    path = jsonl(tmp_path, rows(12, long_every=10))  # r0 and r10 have 43 and 44 tokens
    with caplog.at_level(logging.WARNING, logger="hpcrl.data.prompts"):
        stream = PromptStream.from_config(DataConfig(source=str(path), max_prompt_tokens=16),
                                          measure=token_counter(str(tiny_model)))
    assert (stream.size, stream.dropped) == (10, 2)
    assert {p.id for p in stream.next_batch(10)} == {f"r{i}" for i in range(12)} - {"r0", "r10"}
    (record,) = caplog.records
    assert "dropped 2 of 12 prompts longer than data.max_prompt_tokens = 16 tokens" in record.message
    assert "'r10', has 44" in record.message
    with pytest.raises(DataError, match="all 2 prompts of .* are longer than data.max_prompt_tokens = 16"):
        PromptStream.from_config(DataConfig(source=str(jsonl(tmp_path, rows(2, long_every=1))),
                                            max_prompt_tokens=16), measure=token_counter(str(tiny_model)))


def test_a_resume_over_a_different_number_of_prompts_is_refused(tmp_path: Path):
    path = jsonl(tmp_path, rows(10))
    stream = PromptStream.from_config(DataConfig(source=str(path)))
    stream.next_batch(3)
    state = stream.state_dict()
    jsonl(tmp_path, rows(12))
    with pytest.raises(DataError, match="over 10 prompts, the config gives 12"):
        PromptStream.from_config(DataConfig(source=str(path))).load_state_dict(state)


def test_an_eval_fraction_is_held_out_from_the_seed_and_never_trained_on(tmp_path: Path):
    path = jsonl(tmp_path, rows(50))
    config = DataConfig(source=str(path), shuffle_seed=2, eval_fraction=0.1)
    stream = PromptStream.from_config(config)
    held = {p.id for p in stream.eval_prompts()}
    trained = {p.id.partition("~")[0] for p in stream.next_batch(45 * 3)}  # three epochs (later ones: "r7~e1")
    assert len(held) == 5 and not held & trained and held | trained == {f"r{i}" for i in range(50)}
    assert [p.id for p in PromptStream.from_config(config).eval_prompts()] == [p.id for p in stream.eval_prompts()]
    other_seed = PromptStream.from_config(DataConfig(source=str(path), shuffle_seed=3, eval_fraction=0.1))
    assert {p.id for p in other_seed.eval_prompts()} != held
    with pytest.raises(DataError, match="eval_fraction = 0.9 of 2 prompts leaves none to train on"):
        PromptStream.from_config(DataConfig(source=str(jsonl(tmp_path, rows(2))), eval_fraction=0.9))


def test_an_eval_source_gives_a_fixed_list_of_eval_prompts_from_a_file_or_a_builtin_task(tmp_path: Path):
    table = saved_dataset(tmp_path / "d", {"train": rows(6), "test": rows(4)})
    stream = PromptStream.from_config(DataConfig(source=str(table), eval_source=str(table), eval_size=3))
    assert [p.id for p in stream.eval_prompts()] == ["r0", "r1", "r2"]
    assert stream.size == 6
    builtin = PromptStream.from_config(DataConfig(source="builtin:echo", eval_source="builtin:arithmetic"))
    evals = builtin.eval_prompts()
    assert len(evals) == 64 and evals[0].id == "arithmetic-test-0" and evals == builtin.eval_prompts()
    assert PromptStream.from_config(DataConfig(source="builtin:echo")).eval_prompts() == []


def test_a_file_smaller_than_a_batch_gives_every_prompt_of_a_batch_its_own_id(tmp_path):
    path = tmp_path / "few.jsonl"
    path.write_text("".join(f'{{"prompt": "say {i}:", "answer": "{i}"}}\n' for i in range(3)))
    stream = PromptStream.from_config(DataConfig(source=str(path)))
    batch = stream.next_batch(8)  # three epochs in one batch
    assert len({p.id for p in batch}) == 8
    assert sorted(p.text for p in batch[:3]) == ["say 0:", "say 1:", "say 2:"]
    again = PromptStream.from_config(DataConfig(source=str(path)))
    again.load_state_dict({**stream.state_dict(), "cursor": 0})
    assert [p.id for p in again.next_batch(8)] == [p.id for p in batch]  # a pure function of the cursor


@pytest.mark.parametrize("task", ["echo", "arithmetic", "reverse", "parity", "guess", "word_problems"])
def test_a_builtin_tasks_training_prompts_are_never_its_evaluation_prompts_whatever_the_seed(task: str):
    """Issue 38 (W3): with shuffle_seed = 1 the first 64 training prompts were exactly the test split, and with
    seed 0 a run read them again from its 1,000,003rd prompt on. Each draw of the train split is now its own."""
    data = DataConfig(source=f"builtin:{task}", eval_source=f"builtin:{task}")
    evals = [(p.text, p.answer) for p in PromptStream.from_config(data).eval_prompts()]
    assert len(evals) == 64
    for seed in [*range(40), 1_000_003, 2**32 - 1]:
        stream = PromptStream.from_config(DataConfig(source=f"builtin:{task}", eval_source=f"builtin:{task}",
                                                     shuffle_seed=seed))
        for cursor in (0, 1_000_003 - seed * 1_000_003 if seed < 2 else 0):
            stream.load_state_dict({**stream.state_dict(), "cursor": cursor})
            trained = stream.next_batch(64)
            assert [(p.text, p.answer) for p in trained] != evals, (seed, cursor)
            assert not {p.id for p in trained} & {p.id for p in stream.eval_prompts()}
    from hpcrl.data.builtin import builtin_task, draw_seed  # the seeds of the draws, for the proof over many seeds

    salt_of = {name: i for i, name in enumerate(["arithmetic", "reverse", "parity", "echo", "guess", "word_problems"], 1)}
    salt = salt_of[task]
    eval_seeds = {draw_seed("test", i, salt) for i in range(64)} | {draw_seed("validation", i, salt) for i in range(64)}
    train_seeds = {draw_seed("train", seed * 1_000_003 + position, salt) for seed in range(50) for position in range(64)}
    assert not eval_seeds & train_seeds
    assert builtin_task(task)("train", 5) == builtin_task(task)("train", 5)  # still a pure function of the index


FIRST_ECHO_DIGITS = "6216226495019837"


def test_the_default_tasks_training_prompts_are_the_ones_it_always_had():
    """The fix of W3 leaves the train split as it was: the embedded default (builtin:echo, seed 0) trains on
    the same prompts, in the same order (these are the first 16 of 8bcc209)."""
    stream = PromptStream.from_config(DataConfig(source="builtin:echo", eval_source="builtin:echo"))
    assert [p.text[4] for p in stream.next_batch(16)] == list(FIRST_ECHO_DIGITS)


def test_a_builtin_eval_split_that_is_the_training_split_is_refused():
    with pytest.raises(ConfigError, match=r"eval_split: is 'train', the split data.source trains on: builtin:echo's "
                                          r"evaluation prompts would be prompts it trains on"):
        DataConfig(source="builtin:echo", eval_source="builtin:echo", eval_split="train")
    DataConfig(source="builtin:echo", eval_source="builtin:arithmetic", eval_split="train")  # another task: fine


def test_a_word_problems_answer_is_the_sum_or_difference_of_its_two_numbers_and_never_below_1():
    import re

    from hpcrl.data.builtin import word_problems

    for split in ("train", "test"):
        for index in range(300):
            example = word_problems(split, index)
            prompt = example["prompt"]
            a, b = (int(n) for n in re.findall(r"\d+", prompt))
            adds = any(words in prompt for words in ("gets", "another box", "on Tuesday"))
            want = a + b if adds else a - b
            assert example["answer"] == str(want) and want >= 1 and 2 <= min(a, b) <= max(a, b) <= 21, example
