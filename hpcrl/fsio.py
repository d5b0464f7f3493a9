"""Durable small writes: a reader sees the old file or the whole new one, never a torn one.

    write_atomic(run_dir / "job_id", "1234\n")      # str or bytes

Through a temp file named after the writing process (two writers never share one), fsync,
rename over the target, and fsync of the directory so the rename itself survives a crash.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | str) -> None:
    """Replace `path` with `data` atomically and durably (see the module docstring)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as handle:
        handle.write(data.encode() if isinstance(data, str) else data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)
