"""Reading prompt rows from the files users keep: JSONL, Parquet, and `datasets` directories.

    prompts = read_prompts(Path("gsm8k.parquet"), split="train", columns=config.data.column_names)
    check_columns(config.data)       # `hpcrl plan`: a missing column is a ConfigError, before any job

The kind is chosen by the path: a directory is a `datasets` save_to_disk directory (state.json, or
dataset_dict.json for a DatasetDict, whose `split` is loaded), *.parquet is read with pyarrow, and
*.jsonl / *.ndjson / *.json hold one JSON object per line. `data.columns` says which column holds the
prompt (a string, or an OpenAI-style list of {role, content} messages), the messages, the answer, the
id and the extra fields; a dotted name reaches into a struct or object column (veRL's Parquet keeps
the answer in reward_model.ground_truth).

pyarrow and datasets (the `data` extra; vLLM brings both) are imported only when such a file is read.
"""

from __future__ import annotations

import json
import os
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
    from datasets import load_from_disk

    dict_file = path / "dataset_dict.json"
    if dict_file.is_file():
        splits = json.loads(dict_file.read_text()).get("splits", [])
        if split not in splits:
            raise ConfigError(key="data.split", problem=f"{path} has no split {split!r} (its splits: "
                              f"{', '.join(splits)})", fix="set data.split (data.eval_split for "
                              "data.eval_source) to one of them")
        path = path / split
    return load_from_disk(str(path))


def _arrow_fields(arrow_type: Any) -> dict[str, Any] | None:
    """{name: sub-fields or None} of an Arrow schema or struct type; None for any other type."""
    import pyarrow as pa

    if isinstance(arrow_type, pa.Schema) or pa.types.is_struct(arrow_type):
        return {f.name: _arrow_fields(f.type) for f in arrow_type}
    return None


def _object_fields(value: Any) -> dict[str, Any] | None:
    return {k: _object_fields(v) for k, v in value.items()} if isinstance(value, dict) else None


def _first_json_row(path: Path) -> tuple[dict | None, int]:
    """The first object of a JSONL file and its line number ((None, 0) if the file has none)."""
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                return _json_row(line, path, number), number
    return None, 0


def _json_row(line: str, path: Path, number: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{number}: not valid JSON ({err}). Fix: one JSON object per line") from None
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
        import pyarrow.parquet as pq

        return _arrow_fields(pq.read_schema(path)) or {}, str(path)
    if kind == "datasets":
        dataset = _dataset(path, split)
        return _arrow_fields(dataset.data.schema) or {}, _name(path, split)
    row, number = _first_json_row(path)
    return (_object_fields(row) or {}, f"{path}:{number}") if row is not None else None


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


def _plain(value: Any, where: str, column: str) -> Any:
    """`value` if it is made only of what msgpack and JSON carry alike; else a DataError."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v, where, column) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v, where, column) for k, v in value.items()}
    raise DataError(f"{where}: column {column!r} holds a {type(value).__name__}, which cannot travel with "
                    "the prompt. Fix: convert it to a string or number in the file, or leave the column out")


def _messages(value: Any, where: str, column: str) -> list[dict[str, str]]:
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise DataError(f"{where}: column {column!r} is not a list of {{role, content}} messages (got "
                        f"{str(value)[:80]!r}). Fix: write it as [{{\"role\": \"user\", \"content\": \"...\"}}]")
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
    text = prompt if messages is None else "\n".join(m["content"] for m in messages)
    answer = _text(_plain(value("answer", columns.answer), where, columns.answer)) if columns.answer else ""
    found_id = _lookup(row, columns.id)
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


def _read_jsonl(path: Path, columns: DataColumns) -> list[Prompt]:
    prompts = []
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            row, where = _json_row(line, path, number), f"{path}:{number}"
            require_columns(_object_fields(row) or {}, where, columns)
            prompts.append(row_prompt(row, columns=columns, where=where, default_id=f"{path.stem}-{number}"))
    return prompts


def _table_prompts(rows: list[dict], columns: DataColumns, where: str, stem: str) -> list[Prompt]:
    return [row_prompt(row, columns=columns, where=f"{where} row {i}", default_id=f"{stem}-{i}")
            for i, row in enumerate(rows)]


def read_prompts(path: Path, *, split: str, columns: DataColumns) -> list[Prompt]:
    """Every row of a data source as a Prompt, in file order; an error names the file, row and column."""
    if not path.exists():
        raise DataError(f"{path} does not exist (data.source or data.eval_source). Fix: give the path of a JSONL "
                        "or Parquet file or a datasets save_to_disk directory, as seen from the head's node")
    kind = source_kind(path)
    if kind == "jsonl":
        prompts = _read_jsonl(path, columns)
    elif kind == "parquet":
        import pyarrow.parquet as pq

        fields = _arrow_fields(pq.read_schema(path)) or {}
        require_columns(fields, str(path), columns)
        rows = pq.read_table(path, columns=_top_level(columns, list(fields))).to_pylist()
        prompts = _table_prompts(rows, columns, str(path), path.stem)
    else:
        dataset = _dataset(path, split)
        fields, where = _arrow_fields(dataset.data.schema) or {}, _name(path, split)
        require_columns(fields, where, columns)
        rows = dataset.select_columns(_top_level(columns, list(fields))).to_list()
        stem = f"{path.name}-{split}" if (path / "dataset_dict.json").is_file() else path.name
        prompts = _table_prompts(rows, columns, where, stem)
    if not prompts:
        raise DataError(f"{path}: holds no prompts. Fix: add rows, or point data.source elsewhere")
    return prompts
