"""`hpcrl run` on its terminal: set-up progress, a line per step, the summary; vLLM's log in the run's file.

Real vLLM (CPU) and the tiny model, for a few steps; stdout and stderr are a pipe here (not a TTY),
so every step gets its own line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def hpcrl_run(*args: str, umask: int | None = None) -> subprocess.CompletedProcess:
    """`python -m hpcrl run configs/tiny_grpo.toml ARGS` from the repository; stdout and stderr in one pipe."""
    argv = [sys.executable, "-m", "hpcrl", "run", "configs/tiny_grpo.toml", *args]
    return subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=580,
                          preexec_fn=None if umask is None else lambda: os.umask(umask))


def test_hpcrl_run_prints_no_vllm_info_line_while_its_log_file_keeps_vllms_whole_log(tiny_model, tmp_path: Path):
    """Under umask 002 (common on HPC project directories), as its run directory must stay private."""
    run_dir = tmp_path / "run"
    sets = ["--set", f"run.run_dir={run_dir}", "--set", f"model.path={tiny_model}", "--set", "trainer.checkpoint_interval=0"]
    done = hpcrl_run("--steps", "3", *sets, umask=0o002)
    terminal = done.stdout
    assert done.returncode == 0, terminal[-3000:]
    # its config, logs, metrics and the step-3 checkpoint: no bit for group or others
    written = [run_dir, *run_dir.rglob("*")]
    assert {"config.toml", "rank0.log", "metrics.jsonl", "MANIFEST.json"} <= {p.name for p in written}
    assert [str(p) for p in written if not p.is_symlink() and p.lstat().st_mode & 0o077] == []  # a link's mode is unused
    assert not re.search(r"\bINFO\b", terminal), terminal  # vLLM's INFO lines, in its format or ours
    assert "reset prefix cache" not in terminal
    steps = [line for line in terminal.splitlines() if line.startswith("step ")]
    assert [line.split("/")[0] for line in steps] == ["step    1", "step    2", "step    3"]
    assert "reward curve" in terminal and "done in" in terminal
    log = (run_dir / "logs" / "run" / "rank0.log").read_text()
    assert "run: INFO vllm." in log  # vLLM's own lines, at INFO
    assert re.search(r"run: INFO vllm\.\S+ \(EngineCore\S* pid \d+\): ", log), log[-3000:]  # and its engine process's
    assert "run: step    3/200" in log and "run: done in" in log
    # The weight-transfer plan the run executed is the one `hpcrl plan --transfer` describes (issue #27).
    plan = subprocess.run([sys.executable, "-m", "hpcrl", "plan", "--transfer", "configs/tiny_grpo.toml", *sets],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0, plan.stderr
    printed = plan.stdout.splitlines()[0]
    assert printed.startswith("weight transfer plan ") and f" run: {printed}\n" in log, log[-3000:]


def test_hpcrl_run_reports_its_start_up_parts_in_the_log_and_the_first_steps_metrics(tiny_model, tmp_path: Path):
    """Issue #19: vLLM, the trainer and the reward pool start at once; each part's seconds, the weight-transfer
    group's and the first sync's go with the first step, and startup_total_s is the launch -> first step."""
    run_dir = tmp_path / "run"
    done = hpcrl_run("--steps", "2", "--set", f"run.run_dir={run_dir}", "--set", f"model.path={tiny_model}",
                     "--set", "trainer.checkpoint_interval=0")
    assert done.returncode == 0, done.stdout[-3000:]
    first, second = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    parts = ["inference", "trainer", "reward", "weights", "first_sync", "first_generate"]
    assert sorted(k for k in first if k.startswith("startup_")) == sorted([f"startup_{p}_s" for p in parts]
                                                                         + ["startup_total_s"])
    assert not any(k.startswith("startup_") for k in second)
    assert all(first[f"startup_{p}_s"] > 0 for p in parts), first
    assert first["startup_total_s"] > max(first[f"startup_{p}_s"] for p in parts)  # that they overlap: test_inprocess
    line = re.search(r"start-up: ([\d.]+) s from launch to the first step \(([^)]*)\)", done.stdout)
    assert line is not None, done.stdout[-3000:]
    assert float(line.group(1)) == pytest.approx(first["startup_total_s"], abs=0.05)
    assert "inference" in line.group(2) and "first sync" in line.group(2)


@pytest.mark.timeout(420)
def test_hpcrl_run_exits_0_five_times_in_a_row_and_never_aborts_at_exit(tiny_model, tmp_path: Path):
    """Issue #19: a run printed "done in", then died of SIGABRT in the interpreter's teardown (exit code 134,
    "terminate called without an active exception"; docs/FACTS.md, "Teardown"). One step is the cheapest
    run that makes and closes every part (about 35 s here)."""
    for attempt in range(5):
        done = hpcrl_run("--steps", "1", "--set", f"run.run_dir={tmp_path / f'run{attempt}'}",
                         "--set", f"model.path={tiny_model}", "--set", "trainer.checkpoint_interval=0")
        assert "terminate called" not in done.stdout, f"run {attempt + 1}:\n{done.stdout[-3000:]}"
        assert done.returncode == 0, f"run {attempt + 1} exited {done.returncode}:\n{done.stdout[-3000:]}"
        assert "done in" in done.stdout
