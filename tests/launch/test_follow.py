"""`hpcrl status` and `cancel` of a local run trust its pid only while it names the run's own controller."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.cli.main import main
from hpcrl.launch import follow


def _write_job(run_dir: Path, pid: int, **extra) -> None:
    record = {"executor": "local", "job_id": str(pid), "layout": "hetjob", "slurm_conf": "",
              "groups": ["head", "trainer", "inference"], **extra}
    (run_dir / "job.json").write_text(json.dumps(record))


@pytest.fixture
def unrelated_sleep():
    """A process that is not the run's: what a pid reused after the run's controller ended points at."""
    sleep = subprocess.Popen(["sleep", "60"])
    yield sleep
    sleep.kill()
    sleep.wait(timeout=10)


@pytest.fixture
def ended_controller_identity() -> dict:
    """The identity job.json recorded for a controller that has since ended (its pid is free for reuse)."""
    controller = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert controller.stdout.readline() == b"up\n"  # its own command line is in place
    stat = Path(f"/proc/{controller.pid}/stat").read_text().rsplit(")", 1)[1].split()
    cmdline = Path(f"/proc/{controller.pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    controller.communicate(b"", timeout=30)
    return {"pid": controller.pid, "start_ticks": int(stat[22 - 3]), "cmdline": cmdline}


def _stays_alive(process: subprocess.Popen) -> bool:
    """An absence (no signal came) can only be shown by waiting: a SIGTERM would end it within this."""
    try:
        process.wait(timeout=0.5)
    except subprocess.TimeoutExpired:
        return True
    return False


@pytest.mark.timeout(30)
def test_cancel_does_not_signal_a_process_that_reused_the_runs_pid(tmp_path: Path, ended_controller_identity,
                                                                   unrelated_sleep):
    # The kernel cannot be made to reuse a pid on demand: job.json names the sleep (started after the
    # controller ended) with the identity its controller had, which is what pid reuse leaves behind.
    _write_job(tmp_path, unrelated_sleep.pid, process={**ended_controller_identity, "pid": unrelated_sleep.pid},
               submitted_at=time.time())
    assert follow.status(tmp_path).state == "ENDED"
    assert main(["cancel", str(tmp_path), "--wait", "0"]) == 0
    assert _stays_alive(unrelated_sleep), f"the unrelated process got signalled ({unrelated_sleep.returncode})"
    assert "ENDED" in follow.status(tmp_path).render()


@pytest.mark.timeout(30)
def test_a_job_json_without_an_identity_trusts_no_process_started_after_the_submission(tmp_path: Path,
                                                                                   unrelated_sleep):
    # A job.json written before the identity was recorded: only a process already running at submit
    # time can be the run's controller.
    _write_job(tmp_path, unrelated_sleep.pid, submitted_at=time.time() - 3600)
    assert follow.status(tmp_path).state == "ENDED"
    follow.cancel(tmp_path)
    assert _stays_alive(unrelated_sleep), f"the unrelated process got signalled ({unrelated_sleep.returncode})"


@pytest.mark.timeout(30)
def test_the_runs_own_controller_is_running_and_cancel_stops_it(tmp_path: Path):
    controller = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        identity = follow.process_identity(controller.pid)
        assert identity is not None and identity["cmdline"][:2] == [sys.executable, "-c"]
        _write_job(tmp_path, controller.pid, process=identity, submitted_at=time.time())
        assert follow.status(tmp_path).state == "RUNNING"
        follow.cancel(tmp_path)
        assert controller.wait(timeout=10) == -15
        assert follow.status(tmp_path).state == "ENDED"
    finally:
        controller.kill()
        controller.wait(timeout=10)


def test_hpcrl_status_lists_each_recovery_inside_the_job_with_its_times(tmp_path):
    from hpcrl.launch.follow import RunStatus, _recoveries, _recovery_entries, _spares_used
    from hpcrl.rundir import RECOVERIES_FILE, write_json

    entry = {"group": "inference", "rank": 1, "lost_on": "n4", "why": "silent for 10.2 s", "restarted_on": "n6",
             "at": 1_700_000_000.0, "registered_after_s": 1.1, "ready_after_s": 24.5}
    write_json(tmp_path / RECOVERIES_FILE, {"recoveries": [entry]})
    lines = _recoveries(_recovery_entries(tmp_path))
    assert len(lines) == 1 and lines[0].startswith("inference rank 1 lost on n4 at ")
    assert "(silent for 10.2 s): started again on n6, registered 1.1 s later, serving 24.5 s later" in lines[0]
    shown = RunStatus(job_id="7", executor="slurm", state="RUNNING", spare_nodes=1, recoveries=lines,
                      spares_used=_spares_used(_recovery_entries(tmp_path))).render()
    assert "spare nodes: 1 (used: 1)" in shown and f"recovered: {lines[0]}" in shown
    assert _recovery_entries(tmp_path / "none") == []


def test_hpcrl_status_lists_a_trainer_group_started_again_and_each_requeue_with_its_times(tmp_path):
    from hpcrl.launch.follow import RunStatus, _recoveries, _recovery_entries, _requeues, _spares_used
    from hpcrl.launch.requeues import note_requeue, note_start
    from hpcrl.rundir import RECOVERIES_FILE, write_json

    entry = {"group": "trainer", "rank": 1, "ranks": [1], "lost_on": "n2", "why": "rank 1: silent for 10.1 s",
             "restarted_on": "n1,n6", "spares_used": ["n6"], "at": 1_700_000_000.0, "stopped_after_s": 0.4,
             "registered_after_s": 9.5, "resumed_from_step": 10, "running_again_after_s": 14.2}
    write_json(tmp_path / RECOVERIES_FILE, {"recoveries": [entry]})
    line, = _recoveries(_recovery_entries(tmp_path))
    assert line.startswith("trainer rank(s) 1 lost on n2 at ")
    assert line.endswith("(rank 1: silent for 10.1 s): the group started again on n1,n6, registered 9.5 s later, "
                         "running again 14.2 s later from step 10")
    assert _spares_used(_recovery_entries(tmp_path)) == 1
    # Requeues: one the head asked for (its word and the next start), one it could not tell (its node lost).
    note_start(tmp_path, restart=0, node="n1", now=1_700_000_000.0)
    note_requeue(tmp_path, restart=0, why="trainer rank 1 lost", now=1_700_000_100.0)
    note_start(tmp_path, restart=1, node="n3", now=1_700_000_160.5)
    note_start(tmp_path, restart=2, node="n1", now=1_700_000_400.0)
    first, second = _requeues(tmp_path)
    assert first.startswith("requeue 1 at ") and ": trainer rank 1 lost; head running again at " in first
    assert first.endswith(" on n3 (60.5 s later)")
    assert second.startswith("requeue 2: the head before it left no word") and second.endswith(" on n1")
    note_requeue(tmp_path, restart=2, why="the time limit is near", now=1_700_000_500.0)
    assert _requeues(tmp_path)[2].endswith(": the time limit is near; not running again yet")
    shown = RunStatus(job_id="7", executor="slurm", state="RUNNING", requeues=_requeues(tmp_path)).render()
    assert shown.count("  requeued: requeue ") == 3
    assert _requeues(tmp_path / "none") == ()
