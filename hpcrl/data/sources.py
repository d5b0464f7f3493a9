"""Reading prompt rows from the files users keep: JSONL, Parquet, and `datasets` directories.

    prompts = read_prompts(Path("gsm8k.parquet"), split="train", columns=config.data.column_names)
    check_columns(config.data)       # `hpcrl plan`: a missing column is a ConfigError, before any job

The kind is chosen by the path: a directory is a `datasets` save_to_disk directory (state.json, or
dataset_dict.json for a DatasetDict, whose `split` is loaded), *.parquet is read with pyarrow, and
*.jsonl / *.ndjson / *.json hold one JSON object per line. `data.columns` says which column holds the
prompt (a string, or an OpenAI-style list of {role, content} messages), the messages, the answer, the
id and the extra fields; a dotted name reaches into a struct or object column (veRL's Parquet keeps
the answer in reward_model.ground_truth).

Every way a file can be unreadable is a DataError naming the file (and the line or row): a JSONL file
not in UTF-8 (UTF-16, Latin-1), JSON nested deeper than MAX_NESTING, a corrupt or truncated Parquet file,
a `datasets` directory with a broken state.json or .arrow file or a missing split directory, a string
holding a lone surrogate (a "\\ud800" escape without its pair, which no tokenizer or msgpack takes), and
an id repeated in the id column. `hpcrl plan`, `hpcrl submit` and the start of a run read the files the
same way (hpcrl.data.prompts.check_data).

pyarrow and datasets (the `data` extra; vLLM brings both) are imported only when such a file is read.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from hpcrl.config.schema import DataColumns, DataConfig
from hpcrl.data.types import DataError, Prompt
from hpcrl.errors import ConfigError

Kind = Literal["jsonl", "parquet", "datasets"]
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")

# What each role's column holds, for the fix of an error about it.
_WHAT = {"prompt": "prompt (a string or a list of messages), or set data.columns.messages",
         "messages": "list of {role, content} messages", "answer": 'reference answer, or "" for none',
         "id": "prompt ids", "extra": "field, or leave it out of data.columns.extra"}

#: Deepest nesting of lists and objects in a value a prompt carries (messages, extra fields): msgpack
#: refuses values nested deeper than 512 on the bus, and no prompt's value needs more than a few levels.
MAX_NESTING = 100
_SURROGATE = re.compile("[\ud800-\udfff]")


@contextmanager
def _reading(path: Path, what: str, fix: str) -> Iterator[None]:
    """Turn what pyarrow or datasets raise on a damaged file (ArrowInvalid, OSError, a JSON or Unicode
    error) into a DataError: "{path}: {what} (the library's words). Fix: {fix}"."""
    import pyarrow as pa

    try:
        yield
    except (OSError, ValueError, TypeError, KeyError, NotImplementedError, pa.ArrowException) as err:
        raise DataError(f"{path}: {what} ({type(err).__name__}: {str(err).strip()[:300]}). Fix: {fix}") from None


_PARQUET_FIX = ("write it again (pyarrow.parquet.write_table or DataFrame.to_parquet); a file cut short by a copy "
                "lacks its footer")
_DATASETS_FIX = ("save it again with save_to_disk, or copy the whole directory (state.json, dataset_info.json and "
                 "every .arrow file)")


def source_kind(path: Path) -> Kind:
    """Which reader a data path takes (see the module docstring); a ConfigError for anything else."""
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return "datasets"
        raise ConfigError(key="data.source", problem=f"{path} is a directory without state.json or "
                          "dataset_dict.json, so not one that datasets' save_to_disk wrote",
                          fix="point data.source at such a directory, a .parquet file or a .jsonl file")
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    raise ConfigError(key="data.source", problem=f"{path} is neither JSONL ({', '.join(JSONL_SUFFIXES)}) nor "
                      f"Parquet ({', '.join(PARQUET_SUFFIXES)}), by its name",
                      fix="rename the file to its format, or save it with datasets' save_to_disk")


def _dataset(path: Path, split: str) -> Any:
    """The `datasets.Dataset` of a save_to_disk directory; of a DatasetDict, its split `split` only."""
    dict_file = path / "dataset_dict.json"
    if dict_file.is_file():
        with _reading(dict_file, "is not the JSON that save_to_disk writes", _DATASETS_FIX):
            splits = json.loads(dict_file.read_text(encoding="utf-8"))["splits"]
            if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
                raise ValueError(f"its splits are {str(splits)[:80]}, not a list of names")
        if split not in splits:
            raise ConfigError(key="data.split", problem=f"{path} has no split {split!r} (its splits: "
                              f"{', '.join(splits)})", fix="set data.split (data.eval_split for "
                              "data.eval_source) to one of them")
        if not (path / split).is_dir():
            raise DataError(f"{path}: dataset_dict.json lists the split {split!r} but its directory {path / split} "
                            f"is missing. Fix: {_DATASETS_FIX}")
        path = path / split
    with _reading(path, "is not a readable datasets directory", _DATASETS_FIX):
        from datasets import load_from_disk

        return load_from_disk(str(path))


def _arrow_fields(arrow_type: Any) -> dict[str, Any] | None:
    """{name: sub-fields or None} of an Arrow schema or struct type; None for any other type."""
    import pyarrow as pa

    if isinstance(arrow_type, pa.Schema) or pa.types.is_struct(arrow_type):
        return {f.name: _arrow_fields(f.type) for f in arrow_type}
    return None


def _object_fields(value: Any, where: str, depth: int = 0) -> dict[str, Any] | None:
    """{name: sub-fields or None} of a JSON row's objects (`where` names the row in errors)."""
    if not isinstance(value, dict):
        return None
    if depth >= MAX_NESTING:
        raise DataError(f"{where}: objects nested more than {MAX_NESTING} deep. Fix: flatten them")
    return {k: _object_fields(v, where, depth + 1) for k, v in value.items()}


def _parquet_fields(path: Path) -> dict[str, Any]:
    """The column tree of a Parquet file, from its footer."""
    import pyarrow.parquet as pq

    with _reading(path, "is not a readable Parquet file", _PARQUET_FIX):
        return _arrow_fields(pq.read_schema(path)) or {}


def _first_json_row(path: Path) -> tuple[dict | None, int]:
    """The first object of a JSONL file and its line number ((None, 0) if the file has none)."""
    for number, line in _json_lines(path):
        return _json_row(line, path, number), number
    return None, 0


def _json_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line of a JSONL file that is not blank; a DataError naming the line
    for one that is not UTF-8 (a UTF-8 byte order mark is taken; UTF-16 and UTF-32 are refused)."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            if number == 1 and raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
                raise DataError(f"{path}: is UTF-16 or UTF-32 (it starts with that byte order mark), but JSONL is "
                                "UTF-8. Fix: convert it, e.g. iconv -f UTF-16 -t UTF-8 FILE > FILE.utf8.jsonl")
            if b"\0" in raw:
                raise DataError(f"{path}:{number}: holds NUL bytes, so it is not UTF-8 text (UTF-16 or UTF-32 without "
                                "a byte order mark, or a binary file). Fix: write the file as UTF-8 JSON lines")
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}:{number}: is not UTF-8 (byte {raw[err.start]:#04x} at byte {err.start + 1} "
                                "of the line). Fix: convert the file to UTF-8, e.g. iconv -f LATIN1 -t UTF-8") from None
            if line.strip():
                yield number, line


def _json_row(line: str, path: Path, number: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{number}: not valid JSON ({err}). Fix: one JSON object per line") from None
    except RecursionError:
        raise DataError(f"{path}:{number}: its JSON is nested too deeply to read (lists or objects inside each "
                        f"other about a thousand levels deep). Fix: keep values under {MAX_NESTING} levels") from None
    if not isinstance(row, dict):
        raise DataError(f"{path}:{number}: holds {type(row).__name__}, not a JSON object. Fix: one "
                        '{"prompt": ..., "answer": ...} object per line')
    return row


def wanted_columns(columns: DataColumns) -> list[tuple[str, str]]:
    """(role, column) for every column a row must have: prompt or messages, answer, extra, and an id
    column named other than the default "id" (whose absence just means ids FILE-ROW)."""
    wanted = [("messages", columns.messages) if columns.messages else ("prompt", columns.prompt)]
    if columns.answer:
        wanted.append(("answer", columns.answer))
    if columns.id != DataColumns().id:
        wanted.append(("id", columns.id))
    return wanted + [("extra", name) for name in columns.extra]


def missing_column(fields: dict[str, Any], role: str, column: str, where: str) -> ConfigError | None:
    """The error for `column` (dotted) of role `role` missing from `fields` ({name: sub-fields}), or None.
    Names the column, the file (`where`) and the columns (or a struct's fields) it does have."""
    level: dict[str, Any] | None = fields
    parts = column.split(".")
    for depth, part in enumerate(parts):
        if level is None or part not in level:
            inside = ".".join(parts[:depth])
            have = ", ".join(level) if level else "none"
            problem = (f"{where} has no column {column!r} (its columns: {have})" if not inside else
                       f"{where}: column {inside!r} has no field {part!r} (its fields: {have})")
            return ConfigError(key=f"data.columns.{role}", problem=problem,
                               fix=f"set data.columns.{role} to the column holding the {_WHAT[role]}")
        level = level[part]
    return None


def require_columns(fields: dict[str, Any], where: str, columns: DataColumns) -> None:
    """Raise the ConfigError of the first column of `columns` missing from `fields` (see missing_column)."""
    for role, column in wanted_columns(columns):
        error = missing_column(fields, role, column, where)
        if error is not None:
            raise error


def source_fields(path: Path, split: str) -> tuple[dict[str, Any], str] | None:
    """The column tree ({name: sub-fields or None}) of a data source and how to name it in errors; None
    for a JSONL file with no rows. For JSONL, the first row's keys stand for the file's."""
    kind = source_kind(path)
    if kind == "parquet":
        return _parquet_fields(path), str(path)
    if kind == "datasets":
        dataset = _dataset(path, split)
        return _arrow_fields(dataset.data.schema) or {}, _name(path, split)
    row, number = _first_json_row(path)
    where = f"{path}:{number}"
    return (_object_fields(row, where) or {}, where) if row is not None else None


def _name(path: Path, split: str) -> str:
    return f"{path} (split {split!r})" if (path / "dataset_dict.json").is_file() else str(path)


def check_columns(data: DataConfig) -> None:
    """Check that the data files hold the columns data.columns names, where they can be read here
    (`hpcrl plan` on a login node may not see the compute nodes' file system: then nothing is checked;
    PromptStream checks again at start). Raises the ConfigError of the first missing column."""
    for source, split in ((data.source, data.split), (data.eval_source, data.eval_split)):
        if not source or source.startswith("builtin:"):
            continue
        path = Path(source)
        if not os.access(path, os.R_OK):
            continue
        found = source_fields(path, split)
        if found is None:
            continue  # an empty file: PromptStream says so
        require_columns(*found, data.column_names)


# -- reading rows --------------------------------------------------------------------------------
_MISSING = object()


def _lookup(row: dict, column: str) -> Any:
    value: Any = row
    for part in column.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _plain(value: Any, where: str, column: str, depth: int = 0) -> Any:
    """`value` if it is made only of what msgpack and JSON carry alike (strings of Unicode text, nested at
    most MAX_NESTING deep); else a DataError."""
    if isinstance(value, str):
        _text_only(value, where, column)
        return value
    if value is None or isinstance(value, int | float | bool):
        return value
    if depth >= MAX_NESTING:
        raise DataError(f"{where}: column {column!r} holds lists or objects nested more than {MAX_NESTING} deep. "
                        "Fix: flatten the value, or leave the column out")
    if isinstance(value, list | tuple):
        return [_plain(v, where, column, depth + 1) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        for key in value:
            _text_only(key, where, column)
        return {k: _plain(v, where, column, depth + 1) for k, v in value.items()}
    raise DataError(f"{where}: column {column!r} holds a {type(value).__name__}, which cannot travel with "
                    "the prompt. Fix: convert it to a string or number in the file, or leave the column out")


def _text_only(value: str, where: str, column: str) -> None:
    """A DataError for a string holding a lone surrogate (JSON's "\\ud800" without its pair)."""
    found = _SURROGATE.search(value)
    if found:
        raise DataError(f"{where}: column {column!r} holds a lone surrogate (U+{ord(found.group()):04X}, a "
                        f"\\u{ord(found.group()):04x} escape without its pair) at character {found.start()}, which is "
                        "not Unicode text: no tokenizer or msgpack takes it. Fix: remove or replace it in the file")


def _messages(value: Any, where: str, column: str) -> list[dict[str, str]]:
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise DataError(f"{where}: column {column!r} is not a list of {{role, content}} messages (got "
                        f"{str(value)[:80]!r}). Fix: write it as [{{\"role\": \"user\", \"content\": \"...\"}}]")
    if all(m["role"] == "system" for m in value):
        raise DataError(f"{where}: column {column!r} holds only a system message, no turn to answer. Fix: add the "
                        "user's message after it, or remove the row")
    return _plain(value, where, column)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def row_prompt(row: dict, *, columns: DataColumns, where: str, default_id: str) -> Prompt:
    """The Prompt of one row (`where` names it in errors: FILE:LINE or FILE row N); the row holds
    every wanted column (checked before)."""
    def value(role: str, column: str) -> Any:
        found = _lookup(row, column)
        if found is _MISSING or found is None:
            raise DataError(f"{where}: column {column!r} (data.columns.{role}) is empty. Fix: give every row "
                            f"a {_WHAT[role].split(',')[0]}, or remove the row")
        return found

    messages: list[dict[str, str]] | None
    if columns.messages:
        messages = _messages(value("messages", columns.messages), where, columns.messages)
    else:
        prompt = value("prompt", columns.prompt)
        messages = None if isinstance(prompt, str) else _messages(prompt, where, columns.prompt)
    text = _plain(prompt, where, columns.prompt) if messages is None else "\n".join(m["content"] for m in messages)
    answer = _text(_plain(value("answer", columns.answer), where, columns.answer)) if columns.answer else ""
    found_id = _lookup(row, columns.id)
    if found_id is not _MISSING:
        _plain(found_id, where, columns.id)
    extra = {name: _plain(None if (v := _lookup(row, name)) is _MISSING else v, where, name)
             for name in columns.extra}
    return Prompt(id=default_id if found_id is _MISSING or found_id is None else str(found_id), text=text,
                  answer=answer, messages=messages, extra=extra)


def _top_level(columns: DataColumns, have: list[str]) -> list[str]:
    """The top-level columns to read: those the wanted ones start with, and "id" if the file has it."""
    names = {column.split(".")[0] for _, column in wanted_columns(columns)}
    if columns.id in have:
        names.add(columns.id)
    return sorted(names)


def _read_jsonl(path: Path, columns: DataColumns) -> list[tuple[str, Prompt]]:
    prompts = []
    for number, line in _json_lines(path):
        row, where = _json_row(line, path, number), f"{path}:{number}"
        require_columns(_object_fields(row, where) or {}, where, columns)
        prompts.append((where, row_prompt(row, columns=columns, where=where, default_id=f"{path.stem}-{number}")))
    return prompts


def _table_prompts(rows: list[dict], columns: DataColumns, where: str, stem: str) -> list[tuple[str, Prompt]]:
    return [(f"{where} row {i}", row_prompt(row, columns=columns, where=f"{where} row {i}", default_id=f"{stem}-{i}"))
            for i, row in enumerate(rows)]


def _refuse_repeated_ids(path: Path, located: list[tuple[str, Prompt]], columns: DataColumns) -> None:
    """A DataError naming the rows of the first ids that come twice: every prompt of a batch (and each of
    its completions, scored together) is known by its id."""
    first: dict[str, str] = {}
    repeats: list[str] = []
    for where, prompt in located:
        if prompt.id in first:
            repeats.append(f"id {prompt.id!r} on {first[prompt.id]} and {where}")
        else:
            first[prompt.id] = where
    if repeats:
        more = f" (and {len(repeats) - 3} more repeats)" if len(repeats) > 3 else ""
        raise DataError(f"{path}: repeated ids in the id column {columns.id!r}: {'; '.join(repeats[:3])}{more}. "
                        "Fix: give every row its own id, remove the repeated rows, or set data.columns.id to a "
                        "column of unique values")


def read_prompts(path: Path, *, split: str, columns: DataColumns) -> list[Prompt]:
    """Every row of a data source as a Prompt, in file order; an error names the file, row and column."""
    if not path.exists():
        raise DataError(f"{path} does not exist (data.source or data.eval_source). Fix: give the path of a JSONL "
                        "or Parquet file or a datasets save_to_disk directory, as seen from the head's node")
    kind = source_kind(path)
    if kind == "jsonl":
        located = _read_jsonl(path, columns)
    elif kind == "parquet":
        import pyarrow.parquet as pq

        fields = _parquet_fields(path)
        require_columns(fields, str(path), columns)
        with _reading(path, "is not a readable Parquet file", _PARQUET_FIX):
            rows = pq.read_table(path, columns=_top_level(columns, list(fields))).to_pylist()
        located = _table_prompts(rows, columns, str(path), path.stem)
    else:
        dataset = _dataset(path, split)
        fields, where = _arrow_fields(dataset.data.schema) or {}, _name(path, split)
        require_columns(fields, where, columns)
        with _reading(path, "is not a readable datasets directory", _DATASETS_FIX):
            rows = dataset.select_columns(_top_level(columns, list(fields))).to_list()
        stem = f"{path.name}-{split}" if (path / "dataset_dict.json").is_file() else path.name
        located = _table_prompts(rows, columns, where, stem)
    if not located:
        raise DataError(f"{path}: holds no prompts. Fix: add rows, or point data.source elsewhere")
    _refuse_repeated_ids(path, located, columns)
    return [prompt for _, prompt in located]
