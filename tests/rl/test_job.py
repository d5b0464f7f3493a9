"""The GRPO loop as a job: every group its own processes, serving the head over the control bus.

Real vLLM (CPU), real trainer ranks (FSDP2 over gloo), the real reward pool, real weight transfer.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.launch.rundir import EXIT_FILE, read_json
from hpcrl.rl.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow]


def submit(run_dir: Path, model: Path, *args: str, env: dict[str, str] | None = None,
           timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**(env or os.environ), "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "hpcrl", "submit", "configs/tiny_grpo.toml", "--set", f"run.run_dir={run_dir}",
         "--set", f"model.path={model}", *args, "--wait"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def local(*args: str) -> tuple[str, ...]:
    return ("--set", 'cluster.executor="local"', *args)


def rows_of(run_dir: Path) -> list[tuple]:
    """What a run produced, step by step, to the bit: rewards, losses, grad norms, weight versions."""
    return [(r["step"], r["weight_version"], r["reward_mean"], r.get("loss"), r.get("grad_norm"), r.get("entropy"))
            for r in read_metrics(run_dir)]


@pytest.mark.timeout(900)
def test_a_job_stopped_and_resubmitted_ends_bitwise_where_an_uninterrupted_one_does(tiny_model, tmp_path):
    """Two trainer ranks over gloo; resume re-pushes the checkpoint's weights and replays nothing."""
    steps = ("--set", "trainer.steps=8", "--set", "trainer.checkpoint_interval=0", "--set", "trainer.nodes=2")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    done = submit(straight, tiny_model, *local(*steps))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    first = submit(resumed, tiny_model, *local(*steps), "--steps", "5")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert [r[0] for r in rows_of(resumed)] == [1, 2, 3, 4, 5]
    assert (resumed / "checkpoints" / "step_5" / "MANIFEST.json").is_file()
    second = submit(resumed, tiny_model, *local(*steps))
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    head_log = (resumed / "logs" / "head" / "rank0.log").read_text()
    assert "resumed from" in head_log and "step_5 (step 5)" in head_log
    assert rows_of(resumed) == rows_of(straight)
    assert len(rows_of(straight)) == 8 and any(r[3] for r in rows_of(straight))  # it trained


@pytest.mark.timeout(600)
def test_a_checkpoint_of_two_trainer_ranks_resumes_on_one(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    base = ("--set", "trainer.steps=6", "--set", "trainer.checkpoint_interval=0")
    first = submit(run_dir, tiny_model, *local(*base, "--set", "trainer.nodes=2"), "--steps", "3")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    second = submit(run_dir, tiny_model, *local(*base, "--set", "trainer.nodes=1"))
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["weight_version"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["logprob_mismatch"] < 1e-3 for r in rows)  # the one rank pushed the resumed weights


@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_the_embedded_default_as_a_hetjob_learns_with_two_trainer_ranks_on_two_nodes(local_slurm, tiny_model,
                                                                                      tmp_path):
    run_dir = tmp_path / "run"
    done = submit(run_dir, tiny_model, "--cluster", "local", "--set", "trainer.nodes=2",
                  "--set", "trainer.checkpoint_interval=0", env=local_slurm, timeout=880)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    ended = read_json(run_dir / EXIT_FILE)
    assert ended["state"] == "COMPLETED"
    where = {(r["group"], r["rank"]): r["node"] for r in ended["reports"]}
    assert set(where) == {("head", 0), ("trainer", 0), ("trainer", 1), ("inference", 0), ("reward", 0)}
    assert len(set(where.values())) == 5  # every task on its own node: the components of one hetjob
    rewards = [r["reward_mean"] for r in read_metrics(run_dir)]
    assert sum(rewards[:10]) / 10 < 0.1, rewards[:10]
    assert max(sum(rewards[i:i + 10]) / 10 for i in range(len(rewards) - 9)) >= 0.8, rewards
    assert all(r["logprob_mismatch"] < 1e-3 for r in read_metrics(run_dir))
