"""Shared fixtures: the repository root and the local Slurm cluster of tools/local_slurm.sh."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def local_slurm() -> dict[str, str]:
    """Start (or reuse) the localhost Slurm cluster; the environment clients need.

    Skips, saying why, only where this machine cannot run Slurm (no packages and not root to
    install them). Set HPCRL_REQUIRE_SLURM=1 (as CI does) to fail instead of skipping.
    """
    script = REPO / "tools" / "local_slurm.sh"
    try:
        done = subprocess.run(["bash", str(script), "up"], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        done = None
    if done is None or done.returncode != 0:
        reason = "tools/local_slurm.sh up failed: " + (done.stderr.strip()[-800:] if done else "timed out")
        if os.environ.get("HPCRL_REQUIRE_SLURM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    conf = done.stdout.strip().rpartition("SLURM_CONF=")[2]
    assert conf and Path(conf).is_file(), done.stdout
    if not shutil.which("sbatch"):
        pytest.fail("local_slurm.sh reported success but sbatch is not on PATH")
    return {**os.environ, "SLURM_CONF": conf}


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """models/tiny-llama, made by tools/make_tiny_model.py if missing (a few seconds)."""
    import sys
    done = subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny_model.py")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return REPO / "models" / "tiny-llama"
