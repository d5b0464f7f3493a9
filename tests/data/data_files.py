"""Small data files for the data tests, written where the test says (tmp_path)."""

from __future__ import annotations

import json
from pathlib import Path


def parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def saved_dataset(path: Path, splits: dict[str, list[dict]] | list[dict]) -> Path:
    """A datasets save_to_disk directory: a Dataset from a list of rows, a DatasetDict from {split: rows}."""
    import datasets

    datasets.disable_progress_bars()
    if isinstance(splits, list):
        datasets.Dataset.from_list(splits).save_to_disk(str(path))
    else:
        datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(str(path))
    return path


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
