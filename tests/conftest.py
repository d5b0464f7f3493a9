"""Shared fixtures: the repository root and the local Slurm clusters of tools/local_slurm.sh."""

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


@pytest.fixture(autouse=True)
def logging_restored():
    """Entry points run in a test (the CLI's main, the head's run_head) set up this process's logging
    and point vLLM at their configuration (hpcrl.logs): put both back after each test."""
    import logging

    root = logging.getLogger()
    loggers = {name: logging.getLogger(name) for name in ("hpcrl", "vllm")}
    saved = (root.level, root.handlers[:], {n: (lg.level, lg.handlers[:], lg.propagate) for n, lg in loggers.items()})
    env = {key: os.environ.get(key) for key in ("VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING")}
    yield
    for handler in root.handlers:
        if handler not in saved[1]:
            handler.close()
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    for name, (level, handlers, propagate) in saved[2].items():
        loggers[name].setLevel(level)
        loggers[name].handlers[:] = handlers
        loggers[name].propagate = propagate
    logging.captureWarnings(False)
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _cluster_up(settings: dict[str, str]) -> dict[str, str]:
    """Run `tools/local_slurm.sh up` with `settings`; the client environment, or skip/fail saying why."""
    script = REPO / "tools" / "local_slurm.sh"
    try:
        done = subprocess.run(["bash", str(script), "up"], capture_output=True, text=True, timeout=300,
                              env={**os.environ, **settings})
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
def local_slurm() -> dict[str, str]:
    """Start (or reuse) the localhost Slurm cluster (no accounting: sacct fails); its client environment.

    Skips, saying why, only where this machine cannot run Slurm (no packages and not root to
    install them). Set HPCRL_REQUIRE_SLURM=1 (as CI does) to fail instead of skipping.
    """
    return _cluster_up({})


@pytest.fixture(scope="session")
def local_slurm_accounting() -> dict[str, str]:
    """A second localhost cluster with MariaDB + slurmdbd, so sacct works (same skip rules).

    Lives beside the first: directory <HPCRL_LOCAL_SLURM_DIR or .local_slurm>_acct, ports +100.
    """
    base_dir = os.environ.get("HPCRL_LOCAL_SLURM_DIR", str(REPO / ".local_slurm"))
    base_port = int(os.environ.get("HPCRL_LOCAL_SLURM_PORT", "16817"))
    return _cluster_up({"HPCRL_LOCAL_SLURM_DIR": f"{base_dir}_acct", "HPCRL_LOCAL_SLURM_PORT": str(base_port + 100),
                        "HPCRL_LOCAL_SLURM_ACCOUNTING": "1"})


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """models/tiny-llama, made by tools/make_tiny_model.py if missing (a few seconds)."""
    import sys
    done = subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny_model.py")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return REPO / "models" / "tiny-llama"


@pytest.fixture(scope="session")
def tiny_moe_model() -> Path:
    """models/tiny-qwen3-moe (a tiny Qwen3-MoE), made by tools/make_tiny_model.py if missing (a few seconds)."""
    import sys
    done = subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny_model.py"), "--preset", "tiny-qwen3-moe"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return REPO / "models" / "tiny-qwen3-moe"
