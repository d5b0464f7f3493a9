"""Hostile and broken data files (issue 38: C1, C2, C4, U4): each is one clear error naming the file (and the
line or row), the same from `hpcrl plan`, `hpcrl submit --dry-run` and the start of a run, never a traceback."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from data_files import jsonl, parquet, saved_dataset

from hpcrl.cli.main import main
from hpcrl.config.schema import DataColumns, DataConfig
from hpcrl.data.prompts import DataError, PromptStream, check_data
from hpcrl.data.sources import MAX_NESTING, read_prompts

REPO = Path(__file__).resolve().parents[2]
GOOD = {"prompt": "say 1:", "answer": "1"}


def _utf16(tmp: Path) -> Path:
    path = tmp / "u16.jsonl"
    path.write_bytes((json.dumps(GOOD) + "\n").encode("utf-16"))
    return path


def _latin1_on_line_3(tmp: Path) -> Path:
    path = jsonl(tmp / "latin.jsonl", [GOOD, GOOD])
    path.write_bytes(path.read_bytes() + '{"prompt": "caf\xe9", "answer": "1"}\n'.encode("latin-1"))
    return path


def _utf16_without_bom(tmp: Path) -> Path:
    path = tmp / "u16le.jsonl"
    path.write_bytes((json.dumps(GOOD) + "\n").encode("utf-16-le"))
    return path


def _deep_json_on_line_2(tmp: Path) -> Path:
    path = jsonl(tmp / "deep.jsonl", [GOOD])
    path.write_text(path.read_text() + '{"prompt": "a", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    return path


def _deep_extra_on_line_1(tmp: Path) -> Path:  # json reads it; msgpack (512 levels) would not carry it
    return jsonl(tmp / "deep-extra.jsonl", [{**GOOD, "tree": json.loads("[" * 600 + "]" * 600)}])


def _truncated_parquet(tmp: Path) -> Path:
    path = parquet(tmp / "cut.parquet", [GOOD] * 100)
    path.write_bytes(path.read_bytes()[:300])
    return path


def _corrupt_parquet(tmp: Path) -> Path:
    path = parquet(tmp / "bad.parquet", [{"prompt": "p" * 50, "answer": "1"}] * 1000)
    data = bytearray(path.read_bytes())
    data[100:400] = b"\x07" * 300
    path.write_bytes(bytes(data))
    return path


def _broken_state_json(tmp: Path) -> Path:
    path = saved_dataset(tmp / "state", [GOOD])
    (path / "state.json").write_text("{not json")
    return path


def _corrupt_arrow(tmp: Path) -> Path:
    path = saved_dataset(tmp / "arrow", [GOOD])
    for arrow in path.glob("*.arrow"):
        arrow.write_bytes(b"garbage")
    return path


def _missing_split_directory(tmp: Path) -> Path:
    path = saved_dataset(tmp / "dict", {"train": [GOOD]})
    shutil.rmtree(path / "train")
    return path


def _broken_dataset_dict_json(tmp: Path) -> Path:
    path = saved_dataset(tmp / "dict2", {"train": [GOOD]})
    (path / "dataset_dict.json").write_text('{"splits": ')
    return path


# (name, how to make it, what the message names besides the file)
BROKEN = [
    ("UTF-16 JSONL", _utf16, "is UTF-16 or UTF-32"),
    ("UTF-16 JSONL without a byte order mark", _utf16_without_bom, "u16le.jsonl:1: holds NUL bytes"),
    ("Latin-1 JSONL", _latin1_on_line_3, "latin.jsonl:3: is not UTF-8 (byte 0xe9"),
    ("deeply nested JSON", _deep_json_on_line_2, "deep.jsonl:2: its JSON is nested too deeply"),
    ("JSON nested deeper than msgpack carries", _deep_extra_on_line_1,
     f"deep-extra.jsonl:1: column 'tree' holds lists or objects nested more than {MAX_NESTING} deep"),
    ("truncated Parquet", _truncated_parquet, "cut.parquet: is not a readable Parquet file"),
    ("corrupt Parquet", _corrupt_parquet, "bad.parquet: is not a readable Parquet file"),
    ("broken state.json", _broken_state_json, "state: is not a readable datasets directory"),
    ("corrupt .arrow file", _corrupt_arrow, "arrow: is not a readable datasets directory"),
    ("missing split directory", _missing_split_directory, "dataset_dict.json lists the split 'train' but its directory"),
    ("broken dataset_dict.json", _broken_dataset_dict_json, "dataset_dict.json: is not the JSON that save_to_disk writes"),
]


def _columns(case: str) -> DataColumns:
    return DataColumns(extra=["tree"]) if "msgpack" in case else DataColumns()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("case", "make", "words"), BROKEN, ids=[b[0] for b in BROKEN])
def test_a_malformed_data_file_is_one_error_naming_the_file_from_plan_submit_and_the_runs_start(
        case, make, words, tmp_path: Path, capsys, monkeypatch):
    path = make(tmp_path)
    data = DataConfig(source=str(path), columns=_columns(case))
    with pytest.raises(DataError) as at_start:
        PromptStream.from_config(data)  # the start of a run
    assert str(path) in str(at_start.value) and words in str(at_start.value) and "Fix: " in str(at_start.value)
    with pytest.raises(DataError) as checked:
        check_data(data)  # what plan and submit call
    assert str(checked.value) == str(at_start.value)
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PATH", "/nonexistent")  # no sbatch: submit --dry-run takes the local executor
    sets = ["--set", f"data.source={path}", "--set", f"run.run_dir={tmp_path / 'run'}"]
    if "msgpack" in case:
        sets += ["--set", 'data.columns.extra=["tree"]']
    for command in (["plan", "configs/tiny_grpo.toml"], ["submit", "configs/tiny_grpo.toml", "--dry-run"]):
        assert main([*command, *sets]) == 2, command
        stderr = capsys.readouterr().err
        assert stderr.startswith("hpcrl: error: ") and "Traceback" not in stderr, stderr
        assert str(at_start.value) in stderr, stderr
    assert not (tmp_path / "run").exists()


def test_a_utf8_byte_order_mark_is_read_as_utf8(tmp_path: Path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps(GOOD) + "\n").encode())
    (prompt,) = read_prompts(path, split="train", columns=DataColumns())
    assert (prompt.text, prompt.answer) == ("say 1:", "1")


@pytest.mark.parametrize(("row", "columns", "column"), [
    ({"prompt": "say \ud800:", "answer": "1"}, DataColumns(), "prompt"),
    ({"prompt": "say 1:", "answer": "\udfff"}, DataColumns(), "answer"),
    ({"messages": [{"role": "user", "content": "a\ud83d"}], "answer": "1"}, DataColumns(messages="messages"),
     "messages"),
    ({"prompt": "say 1:", "answer": "1", "meta": {"k\udc80": 1}}, DataColumns(extra=["meta"]), "meta"),
    ({"prompt": "say 1:", "answer": "1", "id": "r\ud800"}, DataColumns(), "id"),
])
def test_a_lone_surrogate_in_a_row_is_refused_at_load_naming_the_file_row_and_column(
        tmp_path: Path, row: dict, columns: DataColumns, column: str):
    path = tmp_path / "s.jsonl"
    hostile = json.dumps(row)  # writes "\ud800" as an escape, as a file with one would hold it
    path.write_text(re.sub(r"\\ud[89a-f][0-9a-f]{2}", "x", hostile) + "\n" + hostile + "\n")  # line 1: the row, mended
    with pytest.raises(DataError, match=rf"s.jsonl:2: column '{column}' holds a lone surrogate \(U\+D[89A-F]"):
        read_prompts(path, split="train", columns=columns)
    fine = jsonl(tmp_path / "pair.jsonl", [{"prompt": "say \U0001F600:", "answer": "1"}])  # a surrogate pair: text
    assert read_prompts(fine, split="train", columns=DataColumns())[0].text == "say \U0001F600:"


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "datasets"])
def test_repeated_ids_are_refused_at_load_naming_the_file_and_both_rows(tmp_path: Path, kind: str):
    rows = [{"prompt": f"p{i}", "answer": "1", "uid": f"u{i % 3}" if i != 4 else "u9"} for i in range(6)]
    path = {"jsonl": lambda: jsonl(tmp_path / "d.jsonl", rows), "parquet": lambda: parquet(tmp_path / "d.parquet", rows),
            "datasets": lambda: saved_dataset(tmp_path / "d", rows)}[kind]()
    first, second = ("d.jsonl:1", "d.jsonl:4") if kind == "jsonl" else (f"{path} row 0", f"{path} row 3")
    with pytest.raises(DataError, match=rf"repeated ids in the id column 'uid': id 'u0' on .*{first} and .*{second}; "
                                        rf"id 'u2' on .*{path.name}.*\. Fix: give every row its own id") as refused:
        PromptStream.from_config(DataConfig(source=str(path), columns=DataColumns(id="uid")))
    assert str(refused.value).startswith(f"{path}: ")
    unique = [{**r, "uid": f"u{i}"} for i, r in enumerate(rows)]
    assert len(read_prompts(jsonl(tmp_path / "ok.jsonl", unique), split="train", columns=DataColumns(id="uid"))) == 6


def test_a_chat_row_with_only_a_system_message_is_refused_naming_the_file_and_row(tmp_path: Path):
    system_only = {"prompt": [{"role": "system", "content": "Be brief."}], "answer": "1"}
    path = jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "1+0?"}], "answer": "1"},
                                           system_only])
    with pytest.raises(DataError, match=r"chat.jsonl:2: column 'prompt' holds only a system message, no turn to "
                                        r"answer. Fix: add the user's message"):
        check_data(DataConfig(source=str(path)))
    table = parquet(tmp_path / "chat.parquet", [system_only])
    with pytest.raises(DataError, match=r"chat.parquet row 0: column 'prompt' holds only a system message"):
        read_prompts(table, split="train", columns=DataColumns())
