"""Durable small writes: a reader sees the old file or the whole new one, never a torn one.

    write_atomic(run_dir / "job_id", "1234\n")      # str or bytes; the file is 0600
    with private_umask():                            # files 0600, directories 0700, whatever the user's umask
        ...

Through a temporary file in the same directory with an unpredictable name, created with O_EXCL and
mode 0600 (tempfile.mkstemp: nobody can plant a file or a symlink there in advance), fsync, rename
over the target, and fsync of the directory so the rename itself survives a crash. Every file
written this way is the owner's only: run directories hold a secret and code that runs as the
owner (config.toml, launch.json, job.sbatch), and a group member who can write one of them runs
code as the owner at the next start.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

PRIVATE_UMASK = 0o077
"""Files 0600, directories 0700: what every process that writes a run directory runs under."""


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | str) -> None:
    """Replace `path` with `data` atomically and durably, mode 0600 (see the module docstring)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_path(path.parent)


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """Run the block under umask 077, then restore the caller's (the umask is per process: not for threads)."""
    previous = os.umask(PRIVATE_UMASK)
    try:
        yield
    finally:
        os.umask(previous)
