"""The head on its own (local executor, in this process): every task registers on the bus, failures
are named, no hangs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.config import load_config
from hpcrl.errors import SlurmError
from hpcrl.launch.head import GroupFailed, InterpreterMissing, check_interpreter, run_head
from hpcrl.launch.submit import launch_record, prepare_run_dir, refuse_live_run
from hpcrl.rundir import EXIT_FILE, JOB_FILE, read_json, write_json
from hpcrl.slurm.spec import job_spec

REPO = Path(__file__).resolve().parents[2]


def prepared(tmp_path: Path, *overrides: str, **launch_options) -> Path:
    config = load_config(REPO / "configs" / "tiny_grpo.toml", overrides=[f"run.run_dir={tmp_path}", *overrides])
    spec = job_spec(config)
    launch = launch_record(config, spec, executor="local", python=sys.executable,
                           **{"program": "check", **launch_options})
    prepare_run_dir(tmp_path, config_toml="", launch=launch, groups=[g.name for g in spec.groups])
    return tmp_path


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))


@pytest.mark.timeout(60)
def test_every_task_registers_with_the_head_and_the_run_records_completion(tmp_path: Path):
    run_dir = prepared(tmp_path, "trainer.nodes=2")
    result = run_head(run_dir)
    assert result["state"] == "COMPLETED"
    assert sorted((r["group"], r["rank"]) for r in result["tasks"]) == [
        ("head", 0), ("inference", 0), ("reward", 0), ("trainer", 0), ("trainer", 1)]
    assert read_json(run_dir / EXIT_FILE)["step_codes"] == {"trainer": 0, "inference": 0, "reward": 0}


@pytest.mark.timeout(60)
def test_tasks_that_die_before_registering_are_named_as_never_registered(tmp_path: Path):
    run_dir = prepared(tmp_path)
    launch = read_json(run_dir / "launch.json")
    launch["groups"][2]["module"] = "hpcrl.no_such_role"  # python -m fails at once, exit 1
    write_json(run_dir / "launch.json", launch)
    with pytest.raises(GroupFailed, match="group inference rank 0 never registered with the head") as failed:
        run_head(run_dir)
    # its own last words come with it (under Slurm: srun's execve error when the interpreter is missing there)
    assert "its log ends:" in str(failed.value) and "No module named hpcrl.no_such_role" in str(failed.value)
    record = read_json(run_dir / EXIT_FILE)
    assert record["state"] == "FAILED" and record["failures"][0]["group"] == "inference"


@pytest.mark.timeout(60)
def test_a_group_ending_cleanly_before_registering_fails_the_run_instead_of_waiting(tmp_path: Path):
    run_dir = prepared(tmp_path)
    launch = read_json(run_dir / "launch.json")
    launch["groups"][3]["module"] = "this"  # prints the Zen of Python, exits 0 without registering
    write_json(run_dir / "launch.json", launch)
    with pytest.raises(GroupFailed, match="group reward ended before ranks \\[0\\] registered"):
        run_head(run_dir)


@pytest.mark.timeout(60)
def test_a_nonzero_exit_code_is_named_with_group_rank_and_node(tmp_path: Path):
    run_dir = prepared(tmp_path, exit_codes={"reward/0": 5})
    with pytest.raises(GroupFailed, match="group reward rank 0 on node .* exited with code 5"):
        run_head(run_dir)


def test_a_run_directory_with_a_live_job_is_not_overwritten(tmp_path: Path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        write_json(tmp_path / JOB_FILE, {"executor": "local", "job_id": str(sleeper.pid)})
        with pytest.raises(SlurmError, match="still RUNNING"):
            refuse_live_run(tmp_path)
    finally:
        sleeper.kill()
        sleeper.wait()
    refuse_live_run(tmp_path)  # ended: resubmitting is fine


def test_planning_and_the_cli_modules_do_not_import_submitit():
    code = ("import sys, hpcrl.cli.main, hpcrl.launch.submit, hpcrl.launch.follow, hpcrl.slurm.render; "
            "hpcrl.cli.main.build_parser(); assert 'submitit' not in sys.modules, 'submitit imported'")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


@pytest.mark.timeout(60)
def test_cluster_environment_reaches_every_group_task(tmp_path: Path, monkeypatch):
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "envdump.py").write_text(
        "import os, sys\nfrom hpcrl.roles.serve import task_main\n"
        "open(os.path.join(os.environ['HPCRL_RUN_DIR'], 'mark'), 'w').write(os.environ['HPCRL_TEST_MARK'])\n"
        "sys.exit(task_main(sys.argv[1], sys.argv[2:]))\n")
    monkeypatch.setenv("PYTHONPATH", f"{REPO}:{tmp_path / 'mods'}")
    run_dir = prepared(tmp_path / "run", 'cluster.env.HPCRL_TEST_MARK="seen"')
    launch = read_json(run_dir / "launch.json")
    launch["groups"][1]["module"] = "envdump"
    write_json(run_dir / "launch.json", launch)
    assert run_head(run_dir)["state"] == "COMPLETED"
    assert (run_dir / "mark").read_text() == "seen"


@pytest.mark.parametrize("make, problem", [
    (lambda d: d / "venv" / "bin" / "python", "does not exist"),
    (lambda d: (d / "python").write_text("") or d / "python", "is not executable"),
    (lambda d: d, "is not a file"),
])
def test_an_interpreter_the_node_cannot_run_is_named_with_the_node_and_the_fix(tmp_path: Path, make, problem):
    path = make(tmp_path)
    with pytest.raises(InterpreterMissing) as caught:
        check_interpreter(str(path), "gpu-node-7")
    assert str(caught.value).startswith(f"the run's interpreter {path} {problem} on node gpu-node-7")
    assert "set cluster.python" in str(caught.value) and "a filesystem the nodes share" in str(caught.value)
    check_interpreter(sys.executable, "gpu-node-7")  # the one running this test is fine


@pytest.mark.timeout(30)
def test_a_missing_interpreter_fails_the_run_before_any_group_starts(tmp_path: Path):
    run_dir = prepared(tmp_path)
    launch = read_json(run_dir / "launch.json")
    launch["python"] = "/login-node-only/venv/bin/python"
    write_json(run_dir / "launch.json", launch)
    with pytest.raises(GroupFailed, match="the run's interpreter /login-node-only/venv/bin/python does not exist "
                                          "on node "):
        run_head(run_dir)
    record = read_json(run_dir / EXIT_FILE)
    assert record["state"] == "FAILED" and "set cluster.python" in record["error"]
    assert [t["group"] for t in record["tasks"]] == ["head"] and record["step_codes"] == {}


def test_the_runs_heartbeat_timeout_is_the_heads_and_so_every_tasks(tmp_path: Path):
    """cluster.heartbeat_timeout_s sets the head's bus, which sends it to every task in its welcome."""
    from hpcrl.launch.head import _bus_config
    from hpcrl.rundir import CONFIG_FILE

    text = (REPO / "configs" / "tiny_grpo.toml").read_text()
    (tmp_path / CONFIG_FILE).write_text(text + "\n[cluster]\nheartbeat_timeout_s = 12.5\n")
    assert _bus_config(tmp_path, "rl").heartbeat_timeout == 12.5
    (tmp_path / CONFIG_FILE).write_text(text)
    assert _bus_config(tmp_path, "rl").heartbeat_timeout == 30.0  # the default
    assert _bus_config(tmp_path, "check").heartbeat_timeout == 30.0  # a check run has no RL config
