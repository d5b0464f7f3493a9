"""Fixtures of the bus tests: a run directory with its secret, bus addresses (tcp and ipc),
and clean-up of worker processes. Helpers live in bus_helpers.py."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    from hpcrl.bus import create_secret
    create_secret(tmp_path)
    return tmp_path


@pytest.fixture
def secret(run_dir: Path):
    from hpcrl.bus import load_secret
    return load_secret(run_dir)


@pytest.fixture
def short_dir():
    """A short directory for ipc socket paths (they must stay under ~100 characters)."""
    path = tempfile.mkdtemp(prefix="hb-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["tcp", "ipc"])
def address(request, short_dir: str) -> str:
    """Where the head binds: a random loopback port, or an ipc socket."""
    return "tcp://127.0.0.1:0" if request.param == "tcp" else f"ipc://{short_dir}/bus.sock"


@pytest.fixture
def procs():
    """Processes a test starts; whatever is still running at the end is killed."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)
