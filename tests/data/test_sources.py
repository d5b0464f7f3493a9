"""Data sources: JSONL, Parquet and datasets directories, the column mapping, and the errors a user meets."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_files import jsonl, parquet, saved_dataset

from hpcrl.config.build import build
from hpcrl.config.schema import DataColumns, DataConfig
from hpcrl.data.prompts import DataError, PromptStream
from hpcrl.data.sources import check_columns, read_prompts
from hpcrl.errors import ConfigError

# veRL's Parquet layout: the prompt is a list of messages, the answer inside a struct.
VERL_ROWS = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i}+1?"}],
              "reward_model": {"style": "rule", "ground_truth": str(i + 1)}, "level": i % 3, "uid": f"u{i}"}
             for i in range(4)]
VERL_COLUMNS = DataColumns(prompt="prompt", answer="reward_model.ground_truth", id="uid", extra=["level"])


def test_a_parquet_file_in_verls_layout_gives_messages_answers_ids_and_extra_fields(tmp_path: Path):
    prompts = read_prompts(parquet(tmp_path / "gsm.parquet", VERL_ROWS), split="train", columns=VERL_COLUMNS)
    assert [p.id for p in prompts] == ["u0", "u1", "u2", "u3"]
    assert prompts[2].messages == VERL_ROWS[2]["prompt"]
    assert prompts[2].text == "Be brief.\n2+1?"  # the plain rendering; the chat format uses the template
    assert [p.answer for p in prompts] == ["1", "2", "3", "4"]
    assert [p.extra for p in prompts] == [{"level": 0}, {"level": 1}, {"level": 2}, {"level": 0}]


def test_a_datasets_directory_gives_its_rows_and_a_dataset_dict_the_split_asked_for(tmp_path: Path):
    rows = [{"question": f"q{i}", "answer": i} for i in range(3)]
    columns = DataColumns(prompt="question")
    one = read_prompts(saved_dataset(tmp_path / "one", rows), split="train", columns=columns)
    assert [(p.id, p.text, p.answer, p.messages) for p in one] == [
        ("one-0", "q0", "0", None), ("one-1", "q1", "1", None), ("one-2", "q2", "2", None)]
    both = saved_dataset(tmp_path / "both", {"train": rows, "test": [{"question": "held", "answer": 9}]})
    assert [(p.id, p.text) for p in read_prompts(both, split="test", columns=columns)] == [("both-test-0", "held")]
    with pytest.raises(ConfigError, match=r"data.split: .*both has no split 'validation' \(its splits: train, test\)"):
        read_prompts(both, split="validation", columns=columns)


def test_a_messages_column_is_carried_through_and_a_bad_one_names_its_row(tmp_path: Path):
    chat = [{"role": "user", "content": "hello"}]
    path = jsonl(tmp_path / "chat.jsonl", [{"messages": chat, "answer": "hi", "id": 7}])
    (prompt,) = read_prompts(path, split="train", columns=DataColumns(messages="messages"))
    assert (prompt.id, prompt.messages, prompt.text, prompt.answer) == ("7", chat, "hello", "hi")
    jsonl(path, [{"messages": chat, "answer": "a"}, {"messages": [{"role": "user"}], "answer": "b"}])
    with pytest.raises(DataError, match=r"chat.jsonl:2: column 'messages' is not a list of \{role, content\}"):
        read_prompts(path, split="train", columns=DataColumns(messages="messages"))


@pytest.mark.parametrize("kind", ["parquet", "datasets", "jsonl"])
def test_a_missing_column_names_the_column_the_file_and_the_columns_it_has(tmp_path: Path, kind: str):
    rows = [{"question": "1+1?", "solution": "2"}]
    path = {"parquet": lambda: parquet(tmp_path / "d.parquet", rows),
            "datasets": lambda: saved_dataset(tmp_path / "d", rows),
            "jsonl": lambda: jsonl(tmp_path / "d.jsonl", rows)}[kind]()
    data = DataConfig(source=str(path), columns=DataColumns(prompt="question"))  # answer: "answer", missing
    expected = rf"data.columns.answer: {path}(:1)? has no column 'answer' \(its columns: question, solution\)"
    with pytest.raises(ConfigError, match=expected):
        check_columns(data)  # `hpcrl plan`
    with pytest.raises(ConfigError, match=expected):
        PromptStream.from_config(data)  # the start of the run
    nested = DataConfig(source=str(path), columns=DataColumns(prompt="question", answer="solution.value"))
    with pytest.raises(ConfigError, match=r"data.columns.answer: .* column 'solution' has no field 'value'"):
        check_columns(nested)
    check_columns(DataConfig(source=str(path), columns=DataColumns(prompt="question", answer="solution")))
    check_columns(DataConfig(source=str(tmp_path / "on-another-machine.parquet")))  # unreadable here: not checked


def test_prompt_key_and_answer_key_still_name_the_columns_unless_columns_says_otherwise(tmp_path: Path):
    path = jsonl(tmp_path / "old.jsonl", [{"q": "1+1=", "a": "2"}])
    (prompt,) = PromptStream.from_config(DataConfig(source=str(path), prompt_key="q", answer_key="a")).next_batch(1)
    assert (prompt.text, prompt.answer) == ("1+1=", "2")
    with pytest.raises(ConfigError, match=r"prompt_key: says 'q' but columns.prompt says 'question'.*remove prompt_key"):
        DataConfig(source=str(path), prompt_key="q", columns=DataColumns(prompt="question"))


def test_the_data_table_reads_columns_and_refuses_a_fraction_of_a_builtin_task():
    data = build(DataConfig, {"source": "x.parquet", "eval_fraction": 0.1,
                              "columns": {"prompt": "problem", "answer": "solution", "extra": ["tests"]}}, "data")
    assert data.column_names == DataColumns(prompt="problem", answer="solution", extra=["tests"])
    with pytest.raises(ConfigError, match=r"data.eval_fraction: cannot hold out a fraction of builtin:echo.*"
                                          r"eval_source = \"builtin:echo\""):
        build(DataConfig, {"source": "builtin:echo", "eval_fraction": 0.1}, "data")
    with pytest.raises(ConfigError, match=r"data.columns.extr: unknown key 'extr'.*did you mean 'extra'"):
        build(DataConfig, {"source": "x.parquet", "columns": {"extr": ["tests"]}}, "data")


def test_an_unknown_suffix_and_a_value_that_cannot_travel_are_errors_that_say_what_to_do(tmp_path: Path):
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(ConfigError, match=r"data.source: .*d.csv is neither JSONL .* nor Parquet"):
        read_prompts(tmp_path / "d.csv", split="train", columns=DataColumns())
    with pytest.raises(DataError, match=r"held-out.jsonl does not exist \(data.source or data.eval_source\)"):
        PromptStream.from_config(DataConfig(source="builtin:echo", eval_source=str(tmp_path / "held-out.jsonl")))
    import datetime

    path = parquet(tmp_path / "t.parquet", [{"prompt": "p", "answer": "a", "when": datetime.date(2026, 1, 2)}])
    with pytest.raises(DataError, match=r"t.parquet row 0: column 'when' holds a date, which cannot travel"):
        read_prompts(path, split="train", columns=DataColumns(extra=["when"]))
