"""A throw-away local Slurm cluster for tests that bring up their own: tools/local_slurm.sh with a
directory and a port of its own, beside the suite's cluster."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "local_slurm.sh"


def free_port(first: int) -> int:
    """A slurmctld port free on this host, from `first` in steps of 100 (ports +1, +2 and +184.. follow it)."""
    for port in range(first, first + 5000, 100):
        with socket.socket() as probe:
            try:
                probe.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port for a throw-away cluster")


def throwaway_settings(prefix: str, first_port: int, **extra: str) -> tuple[Path, dict[str, str]]:
    """(directory, environment of tools/local_slurm.sh) for a 2-node cluster; `extra` adds HPCRL_LOCAL_SLURM_*."""
    directory = Path(tempfile.mkdtemp(prefix=prefix))  # short: munge's socket path must fit 108 bytes
    settings = {key: value for key, value in os.environ.items() if not key.startswith("HPCRL_LOCAL_SLURM_")}
    settings.pop("SLURM_CONF", None)
    settings |= {"HPCRL_LOCAL_SLURM_DIR": str(directory), "HPCRL_LOCAL_SLURM_PORT": str(free_port(first_port)),
                 "HPCRL_LOCAL_SLURM_NODES": "2", **extra}
    return directory, settings


def run_script(settings: dict[str, str], command: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), command], env=settings, capture_output=True, text=True,
                          timeout=timeout)


def need_fake_gpus() -> None:
    """Skip, saying why, where a cluster with fake GPUs cannot be made."""
    if os.geteuid() != 0:
        pytest.skip("fake GPUs need root: tools/local_slurm.sh makes their device files with mknod")
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        pytest.skip("no Slurm here and no apt-get to install it")


def client_env(settings: dict[str, str], directory: Path) -> dict[str, str]:
    """The environment Slurm's clients need for the throw-away cluster of `settings` in `directory`."""
    return {**{k: v for k, v in settings.items() if not k.startswith("HPCRL_LOCAL_SLURM_")},
            "SLURM_CONF": str(directory / "slurm.conf")}
