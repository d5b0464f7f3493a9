"""Helpers of the tests that watch a submitted run: its head's log, and waiting on what it says."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def head_log(run_dir: Path) -> str:
    path = run_dir / "logs" / "head" / "rank0.log"
    return path.read_text() if path.exists() else ""


def wait_for(predicate: Callable[[], object], what: str, timeout_s: float, *, poll_s: float = 0.5) -> float:
    """Poll `predicate` until it holds; the seconds it took. Fails naming `what` after `timeout_s`."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, f"{what} did not happen within {timeout_s} s"
        time.sleep(poll_s)
    return time.monotonic() - started


def cluster_tool(env: dict[str, str], *args: str, timeout_s: float = 300) -> None:
    """tools/local_slurm.sh ARGS on the suite's cluster (the directory of its slurm.conf): cut, mend, poweroff..."""
    script = Path(__file__).resolve().parents[1] / "tools" / "local_slurm.sh"
    done = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=timeout_s,
                          env={**env, "HPCRL_LOCAL_SLURM_DIR": str(Path(env["SLURM_CONF"]).parent)})
    assert done.returncode == 0, done.stderr
