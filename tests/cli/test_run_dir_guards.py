"""What `hpcrl submit`, `hpcrl resume` and `hpcrl run` refuse in a run directory, on the command line: a
directory another process writes (naming it), and checkpoints continued with a changed config. Each
refusal comes before anything starts, in a second or two."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.rundir import CONFIG_FILE

REPO = Path(__file__).resolve().parents[2]
HOLDER = """
import sys
from hpcrl.rundir import RunLock
with RunLock(sys.argv[1], "a test's holder"):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin
"""


def hpcrl(*args: str) -> subprocess.CompletedProcess:
    """The CLI with a PATH that has no sbatch: the local executor."""
    env = {**os.environ, "PATH": "/nonexistent", "PYTHONPATH": str(REPO)}
    env.pop("SLURM_CONF", None)
    return subprocess.run([sys.executable, "-m", "hpcrl", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.timeout(60)
def test_submit_resume_and_run_are_refused_in_a_run_directory_another_process_writes_naming_it(tmp_path: Path):
    sets = ["--set", f"run.run_dir={tmp_path}"]
    assert hpcrl("submit", "configs/tiny_grpo.toml", *sets, "--dry-run").returncode == 0
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        named = f"{tmp_path} is in use by a test's holder (pid {holder.pid} on host {socket.gethostname()}, since "
        for argv, command in ((["submit", "configs/tiny_grpo.toml", *sets, "--check"], "hpcrl submit"),
                              (["resume", str(tmp_path)], "hpcrl resume"),
                              (["run", "configs/tiny_grpo.toml", *sets], "hpcrl run")):
            done = hpcrl(*argv)
            assert done.returncode == 2, done.stderr
            assert done.stderr.startswith(f"hpcrl: error: {named}") and f"; {command} refuses" in done.stderr
            assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    finally:
        holder.kill()
        holder.wait(10)
    assert not (tmp_path / "job.json").exists() and not (tmp_path / "logs" / "run").exists()


@pytest.mark.timeout(60)
def test_hpcrl_run_refuses_to_continue_checkpoints_with_a_changed_config_naming_the_keys(tmp_path: Path):
    sets = ["--set", f"run.run_dir={tmp_path}"]
    assert hpcrl("submit", "configs/tiny_grpo.toml", *sets, "--dry-run").returncode == 0
    (tmp_path / "checkpoints" / "step_50").mkdir(parents=True)
    made_with = (tmp_path / CONFIG_FILE).read_text()
    done = hpcrl("run", "configs/tiny_grpo.toml", *sets, "--set", "trainer.lr=2e-3", "--set", "trainer.steps=60")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "hpcrl run would continue them with 1 key(s) changed: trainer.lr: 0.001 -> 0.002." in done.stderr
    assert "(hpcrl run: add --resume)" in done.stderr
    assert (tmp_path / CONFIG_FILE).read_text() == made_with and not (tmp_path / "logs" / "run").exists()


@pytest.mark.timeout(60)
def test_resume_of_a_directory_that_is_no_run_says_so_and_what_to_give(tmp_path: Path):
    (tmp_path / "stray.txt").write_text("not a run")
    refused = hpcrl("resume", str(tmp_path))
    assert refused.returncode == 2, refused.stderr
    assert f"{tmp_path} is not a run directory (no {CONFIG_FILE})" in refused.stderr
    assert "runs/<name>" in refused.stderr
    assert (tmp_path / "stray.txt").read_text() == "not a run"  # nothing written, nothing lost
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stray.txt"]
