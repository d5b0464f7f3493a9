"""The batch script's guard (hpcrl.launch.guard): a head that died by a signal while its node lived is requeued,
up to max_requeues; any other end is the head's own and passes through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcrl.launch import guard
from hpcrl.launch.guard import judge
from hpcrl.slurm.record import LaunchRecord, write_launch


@pytest.mark.parametrize("code", [0, 1, 2, 75, 128, 255, 128 + 15, 128 + 2, 128 + 12])
def test_the_heads_own_exit_codes_and_a_cancel_pass_through(code):
    assert judge(code, restarts=0, max_requeues=3, node="n1").action == "pass"


@pytest.mark.parametrize("code, name", [(137, "SIGKILL"), (139, "SIGSEGV"), (134, "SIGABRT")])
def test_a_head_killed_outright_is_requeued_while_requeues_are_left(code, name):
    verdict = judge(code, restarts=1, max_requeues=3, node="n1")
    assert verdict.action == "requeue"
    assert f"killed by {name} on node n1" in verdict.message and "restart 2 of at most 3" in verdict.message


def test_a_head_killed_on_every_start_stops_at_max_requeues_naming_the_cause():
    verdict = judge(137, restarts=3, max_requeues=3, node="n1")
    assert verdict.action == "fail"
    assert "killed by SIGKILL on node n1" in verdict.message and "4 starts" in verdict.message


def test_at_the_bound_the_guard_writes_exit_json_failed_and_keeps_the_heads_code(tmp_path: Path, monkeypatch):
    write_launch(tmp_path, LaunchRecord(run_name="r", run_dir=str(tmp_path), executor="slurm", layout="hetjob",
                                        cluster="local", python="/usr/bin/python3", groups=(), max_requeues=0))
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert guard.main([str(tmp_path), "137"]) == 137
    ended = json.loads((tmp_path / "exit.json").read_text())
    assert ended["state"] == "FAILED" and "killed by SIGKILL on node n1" in ended["error"]
    assert "run FAILED: the head's process was killed by SIGKILL" in (tmp_path / "logs/head/rank0.log").read_text()


def test_a_bad_command_line_is_a_usage_error(capsys):
    assert guard.main(["only-one"]) == 2
    assert "usage" in capsys.readouterr().err
