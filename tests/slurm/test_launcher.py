"""The launcher against the real local Slurm clusters of tools/local_slurm.sh.

`cluster` is the cluster without accounting (sacct fails, state comes from squeue);
`any_cluster` runs a test on it and on the accounting cluster (MariaDB + slurmdbd: sacct works).

Hetjob components never share nodes on Slurm 22.05 (measured), so the 4-component acceptance
job (head 1 task, trainer 2 nodes, inference 1, reward 1) needs 5 nodes: tools/local_slurm.sh
starts 5 by default.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.cli.main import main as cli
from hpcrl.config import load_config
from hpcrl.errors import ConfigError
from hpcrl.launch import follow
from hpcrl.launch.submit import submit_run
from hpcrl.rundir import EXIT_FILE, JOB_FILE, SCRIPT_FILE, log_path, read_json
from hpcrl.slurm import tracking

pytestmark = [pytest.mark.slurm]
REPO = Path(__file__).resolve().parents[2]


def _use(env: dict[str, str], monkeypatch, tmp_path: Path):
    """Point this process at the cluster of `env`; cancel whatever the test left queued."""
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], env=env, capture_output=True,
                           text=True, timeout=30).stdout.split()
    if len(set(nodes)) < 5:
        pytest.fail(f"the local cluster has {len(set(nodes))} nodes, these tests need 5: "
                    "tools/local_slurm.sh down && tools/local_slurm.sh up")
    monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    yield env
    for job in tmp_path.glob("*/job.json"):
        subprocess.run(["scancel", str(read_json(job)["job_id"])], env=env, capture_output=True, timeout=30)


@pytest.fixture
def cluster(local_slurm, monkeypatch, tmp_path):
    yield from _use(local_slurm, monkeypatch, tmp_path)


@pytest.fixture(params=["without-sacct", "with-sacct"])
def any_cluster(request, monkeypatch, tmp_path):
    name = "local_slurm" if request.param == "without-sacct" else "local_slurm_accounting"
    env = request.getfixturevalue(name)
    yield from _use(env, monkeypatch, tmp_path)


def settled(job_id: str, env: dict[str, str]) -> tracking.JobState:
    """The job's final state once the source that should say it does: sacct on the accounting
    cluster (slurmdbd records asynchronously, so it may trail squeue by a moment), else squeue."""
    want = "sacct" if "_acct" in env["SLURM_CONF"] else "squeue"
    deadline = time.monotonic() + 15
    while True:
        state = tracking.query(job_id)
        if (state.done and state.source == want) or time.monotonic() > deadline:
            assert state.source == want, state
            return state
        time.sleep(0.3)


def tiny(tmp_path: Path, name: str, local_slurm: dict, *overrides: str):
    return load_config(REPO / "configs" / "tiny_grpo.toml", cluster=str(REPO / "launch" / "local.toml"),
                       overrides=[f"run.run_dir={tmp_path / name}", f"cluster.slurm_conf={local_slurm['SLURM_CONF']}",
                                  "trainer.nodes=2", *overrides])


def reported(run_dir: Path) -> list[tuple[str, int, str]]:
    return sorted((r["group"], r["rank"], r["node"]) for r in read_json(run_dir / EXIT_FILE)["tasks"])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("layout, expected", [
    ("hetjob", [("head", 0, "n1"), ("inference", 0, "n4"), ("reward", 0, "n5"),
                ("trainer", 0, "n2"), ("trainer", 1, "n3")]),
    ("split", [("head", 0, "n1"), ("inference", 0, "n3"), ("reward", 0, "n4"),
               ("trainer", 0, "n1"), ("trainer", 1, "n2")]),
])
def test_every_task_of_every_group_registers_with_the_head_and_the_submitit_result_comes_back(
        any_cluster, tmp_path, layout, expected):
    """Submitted under umask 002 (common on HPC project directories): the job's files stay private too."""
    started = time.monotonic()
    mask = os.umask(0o002)
    try:
        done = submit_run(tiny(tmp_path, layout, any_cluster, f'cluster.layout="{layout}"'), program="check")
    finally:
        os.umask(mask)
    result = done.job.result()
    elapsed = time.monotonic() - started
    assert result["state"] == "COMPLETED"
    assert sorted((r["group"], r["rank"], r["node"]) for r in result["tasks"]) == expected
    assert {r["group"]: r["replica"] for r in result["tasks"]} == {"head": 0, "trainer": 0, "inference": 0, "reward": 0}
    final = follow.wait(done.run_dir, timeout_s=30)
    recorded = settled(done.job_id, any_cluster)
    assert final.state == "COMPLETED" and recorded.state == "COMPLETED"
    assert len(final.rows) == (4 if layout == "hetjob" else 1)
    assert "registered with the head as trainer/0/1" in log_path(done.run_dir, "trainer", 1).read_text()
    # what submit, submitit, slurmstepd (the steps' --output files: SLURM_UMASK), the head and the tasks wrote
    written = [done.run_dir, *done.run_dir.rglob("*")]
    assert [str(p) for p in written if not p.is_symlink() and p.lstat().st_mode & 0o077] == []  # a link's mode is unused
    print(f"{layout} (final state from {recorded.source}): submit -> result {elapsed:.1f} s")


@pytest.mark.timeout(90)
def test_a_task_exiting_3_fails_the_run_naming_its_group_and_rank(any_cluster, tmp_path):
    done = submit_run(tiny(tmp_path, "fail", any_cluster), exit_codes={"trainer/1": 3}, program="check")
    with pytest.raises(Exception, match="group trainer rank 1 on node n3 exited with code 3"):
        done.job.result()
    final = follow.wait(done.run_dir, timeout_s=30)
    assert final.state == "FAILED" and settled(done.job_id, any_cluster).state == "FAILED"
    assert final.failures == ("group trainer rank 1 on node n3: exited with code 3",)
    assert "run FAILED: group trainer rank 1" in log_path(done.run_dir, "head", 0).read_text()


@pytest.mark.timeout(90)
def test_hpcrl_cancel_ends_every_component_and_status_says_cancelled_within_15_s(any_cluster, tmp_path):
    done = submit_run(tiny(tmp_path, "cancel", any_cluster), hold_s=300, program="check")
    head_log = log_path(done.run_dir, "head", 0)
    deadline = time.monotonic() + 60
    while "tasks registered" not in (head_log.read_text() if head_log.exists() else ""):
        assert time.monotonic() < deadline, "the groups never registered"
        time.sleep(0.2)
    assert follow.status(done.run_dir).state == "RUNNING"
    started = time.monotonic()
    assert cli(["cancel", str(done.run_dir), "--wait", "15"]) == 0
    elapsed = time.monotonic() - started
    final = follow.status(done.run_dir)
    assert final.state == "CANCELLED" and elapsed < 15
    recorded = settled(done.job_id, any_cluster)
    assert recorded.state == "CANCELLED"
    assert all(row.state == "CANCELLED" for row in final.rows) and len(final.rows) == 4
    with pytest.raises(Exception):  # noqa: B017 - submitit's result() ends too (with whichever error): no waiting for ever
        done.job.result()
    print(f"cancel (final state from {recorded.source}) -> every component CANCELLED in {elapsed:.1f} s")


@pytest.mark.timeout(60)
def test_dry_run_writes_exactly_the_script_that_is_submitted(cluster, tmp_path):
    config = tiny(tmp_path, "same", cluster)
    dry = submit_run(config, dry_run=True, program="check")
    assert dry.job_id == "" and not (dry.run_dir / JOB_FILE).exists()
    planned = (dry.run_dir / SCRIPT_FILE).read_text()
    done = submit_run(config, program="check")
    submitted = (done.run_dir / "submitit" / f"{done.job_id}_submission.sh").read_text()
    assert submitted == planned
    done.job.result()


@pytest.mark.timeout(60)
def test_the_hetjob_template_runs_by_hand_with_plain_sbatch(cluster, tmp_path):
    config = load_config(REPO / "configs" / "tiny_grpo.toml", cluster=str(REPO / "launch" / "local.toml"),
                         overrides=[f"run.run_dir={tmp_path / 'hand'}"])
    run_dir = submit_run(config, dry_run=True, program="check").run_dir
    env = {**cluster, "HPCRL_RUN_DIR": str(run_dir), "HPCRL_PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    out = subprocess.run(["sbatch", "--parsable", str(REPO / "sbatch" / "hetjob.sbatch")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    (run_dir / JOB_FILE).write_text(f'{{"executor": "slurm", "job_id": "{out}", "groups": []}}')
    assert follow.wait(run_dir, timeout_s=40).state == "COMPLETED"
    assert [g for g, _, _ in reported(run_dir)] == ["head", "inference", "reward", "trainer"]


@pytest.mark.timeout(30)
def test_a_partition_the_cluster_lacks_is_refused_before_sbatch(cluster, tmp_path):
    config = tiny(tmp_path, "nopart", cluster, 'groups.trainer.partition="gpu"')
    with pytest.raises(ConfigError) as err:
        submit_run(config)
    assert err.value.key == "groups.trainer.partition" and "debug" in err.value.fix
    assert not (tmp_path / "nopart").exists()


@pytest.mark.timeout(60)
def test_status_by_job_id_and_logs_of_one_rank_from_the_command_line(cluster, tmp_path, capsys):
    done = submit_run(tiny(tmp_path, "cli", cluster), program="check")
    done.job.result()
    follow.wait(done.run_dir, timeout_s=30)
    capsys.readouterr()
    assert cli(["status", done.job_id]) == 0
    out = capsys.readouterr().out
    assert f"job {done.job_id} [slurm]: COMPLETED" in out and f"{done.job_id}+3" in out
    assert cli(["logs", str(done.run_dir), "--group", "trainer", "--rank", "1"]) == 0
    assert "trainer: trainer rank 1/2 replica 0 on n3" in capsys.readouterr().out.splitlines()[0]
    assert cli(["logs", str(done.run_dir), "-f"]) == 0  # the run has ended: follow returns
    assert re.search(r"^\[reward/0\] \S+ \S+ reward: reward rank 0/1", capsys.readouterr().out, re.M)


@pytest.mark.timeout(30)
def test_a_job_the_controller_has_forgotten_is_ended_and_the_head_record_says_how(cluster, tmp_path):
    assert tracking.query("987654").state == "ENDED"
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    (run_dir / JOB_FILE).write_text('{"executor": "slurm", "job_id": "987654", "groups": ["head"]}')
    (run_dir / EXIT_FILE).write_text('{"state": "FAILED", "error": "x", "failures": '
                                     '[{"group": "trainer", "rank": 0, "node": "n2", "why": "exited with code 3"}]}')
    final = follow.wait(run_dir, timeout_s=10)
    assert final.state == "FAILED" and final.failures == ("group trainer rank 0 on node n2: exited with code 3",)
