"""Without Slurm, `hpcrl submit` runs the same head and groups as local process trees."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.launch import follow
from hpcrl.rundir import EXIT_FILE, log_path, read_json

REPO = Path(__file__).resolve().parents[2]


def hpcrl(*args: str, timeout: float = 60, umask: int | None = None) -> subprocess.CompletedProcess:
    """The CLI with a PATH that has no sbatch (nor anything else), under `umask` if given."""
    env = {**os.environ, "PATH": "/nonexistent", "PYTHONPATH": str(REPO)}
    env.pop("SLURM_CONF", None)
    return subprocess.run([sys.executable, "-m", "hpcrl", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, preexec_fn=None if umask is None else lambda: os.umask(umask))


@pytest.mark.timeout(60)
def test_submit_without_sbatch_says_so_in_one_line_and_runs_every_group_locally(tmp_path: Path):
    """Under umask 002 (common on HPC project directories), as the run directory must stay private."""
    run_dir = tmp_path / "runs" / "tiny"
    done = hpcrl("submit", "configs/tiny_grpo.toml", "--set", f"run.run_dir={run_dir}", "--check", "--wait",
                 umask=0o002)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == ("hpcrl: no sbatch found: running with the local executor "
                                   "(each group a process tree on this machine)")
    assert "[local]" in done.stdout and "COMPLETED" in done.stdout
    reports = read_json(run_dir / EXIT_FILE)["tasks"]
    assert sorted((r["group"], r["rank"]) for r in reports) == [
        ("head", 0), ("inference", 0), ("reward", 0), ("trainer", 0)]
    # every file the submit, submitit, the head and the tasks wrote: no bit for group or others
    written = [run_dir, *run_dir.rglob("*")]
    assert {"rank0.log", "exit.json", "controller.log"} <= {p.name for p in written}
    assert any(p.suffix == ".pkl" for p in written)  # submitit's pickles
    assert [str(p) for p in written if not p.is_symlink() and p.lstat().st_mode & 0o077] == []  # a link's mode is unused


@pytest.mark.timeout(60)
def test_a_failing_local_task_fails_the_run_naming_group_and_rank(tmp_path: Path):
    done = hpcrl("submit", "configs/tiny_grpo.toml", "--set", f"run.run_dir={tmp_path}",
                 "--set", "trainer.nodes=2", "--check", "--debug-exit", "trainer/1=3", "--wait")
    assert done.returncode == 1
    assert "failed: group trainer rank 1 on node" in done.stdout and "exited with code 3" in done.stdout
    assert "FAILED" in done.stdout


@pytest.mark.timeout(60)
def test_cancelling_a_local_run_stops_every_process_within_15_s(tmp_path: Path):
    done = hpcrl("submit", "configs/tiny_grpo.toml", "--set", f"run.run_dir={tmp_path}", "--check", "--hold", "300")
    assert done.returncode == 0, done.stderr
    head_log = log_path(tmp_path, "head", 0)
    deadline = time.monotonic() + 30
    try:
        while "tasks registered" not in (head_log.read_text() if head_log.exists() else ""):
            assert time.monotonic() < deadline, "the groups never registered"
            time.sleep(0.2)
        assert follow.status(tmp_path).state == "RUNNING"
        started = time.monotonic()
        cancelled = hpcrl("cancel", str(tmp_path), "--wait", "15")
        assert cancelled.returncode == 0, cancelled.stderr
        assert follow.status(tmp_path).state == "CANCELLED" and time.monotonic() - started < 15
        pids = [r["pid"] for r in read_json(tmp_path / EXIT_FILE)["tasks"]]
        assert len(pids) == 4 and not any(follow._local_alive(pid) for pid in pids)
    finally:
        job = read_json(tmp_path / "job.json")
        if follow._local_alive(int(job["job_id"])):
            os.kill(int(job["job_id"]), 9)


@pytest.mark.timeout(30)
def test_a_broken_group_spec_is_one_line_on_stderr_and_nothing_is_written(tmp_path: Path):
    done = hpcrl("submit", "configs/tiny_grpo.toml", "--set", f"run.run_dir={tmp_path / 'run'}",
                 "--set", 'groups.trainer.partiton="debug"')
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("hpcrl: error: --set: groups.trainer.partiton: unknown key")
    assert "did you mean 'partition'?" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(30)
def test_dry_run_with_the_local_executor_prepares_the_run_directory_only(tmp_path: Path):
    done = hpcrl("submit", "configs/tiny_grpo.toml", "--set", f"run.run_dir={tmp_path}", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "launch.json").is_file() and (tmp_path / "config.toml").is_file()
    assert not (tmp_path / "job.json").exists()
    status = hpcrl("status", str(tmp_path))
    assert status.returncode == 2 and "prepared by --dry-run but never submitted" in status.stderr


@pytest.mark.timeout(60)
def test_logs_follow_a_live_run_and_return_when_it_ends(tmp_path: Path):
    assert hpcrl("submit", "configs/tiny_grpo.toml", "--set", f"run.run_dir={tmp_path}", "--check", "--hold", "2").returncode == 0
    started = time.monotonic()
    followed = hpcrl("logs", str(tmp_path), "-f")
    assert followed.returncode == 0, followed.stderr
    # every line: "[group/rank] " and the task's log line, "<time> <group>: <message>" (hpcrl.logs)
    assert re.search(r"^\[trainer/0\] \S+ \S+ trainer: trainer rank 0: exiting with code 0$", followed.stdout, re.M)
    assert "head: run COMPLETED" in followed.stdout
    assert time.monotonic() - started > 1.5  # it waited for the hold, then stopped by itself
