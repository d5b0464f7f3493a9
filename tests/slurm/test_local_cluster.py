"""The local Slurm cluster of tools/local_slurm.sh runs real jobs."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm]


def _wait_for_job_end(job_id: str, env: dict[str, str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=env,
                                capture_output=True, text=True, timeout=10).stdout.strip()
        if queued in ("", "COMPLETED"):
            return
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still in the queue after {timeout} s")


@pytest.mark.timeout(120)
def test_trivial_two_node_job_runs_and_its_output_is_read_back(local_slurm, tmp_path: Path):
    out = tmp_path / "job.out"
    job_id = subprocess.run(
        ["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", f"--output={out}",
         "--wrap", 'srun bash -c \'echo task $SLURM_PROCID on $SLURMD_NODENAME\''],
        env=local_slurm, capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    _wait_for_job_end(job_id.split(";")[0], local_slurm, timeout=60)
    deadline = time.monotonic() + 10  # the output file is closed just after the job leaves squeue
    while time.monotonic() < deadline and len(out.read_text().splitlines() if out.exists() else []) < 2:
        time.sleep(0.1)
    lines = sorted(out.read_text().split("\n")) if out.exists() else []
    assert [line for line in lines if line] == ["task 0 on n1", "task 1 on n2"]


@pytest.mark.timeout(120)
def test_heterogeneous_job_starts_every_component(local_slurm, tmp_path: Path):
    out = tmp_path / "het.out"
    script = tmp_path / "het.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"#SBATCH --nodes=1 --ntasks=1 --output={out}\n"
        "#SBATCH hetjob\n"
        "#SBATCH --nodes=2 --ntasks-per-node=1\n"
        'echo "het size $SLURM_HET_SIZE"\n'
        'srun --het-group=1 bash -c \'echo "group 1 task $SLURM_PROCID"\'\n')
    job_id = subprocess.run(["sbatch", "--parsable", str(script)], env=local_slurm,
                            capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    _wait_for_job_end(job_id.split(";")[0], local_slurm, timeout=60)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "task 1" not in (out.read_text() if out.exists() else ""):
        time.sleep(0.1)
    text = out.read_text()
    assert "het size 2" in text
    assert "group 1 task 0" in text and "group 1 task 1" in text
