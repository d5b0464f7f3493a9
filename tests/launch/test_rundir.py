"""The run directory: a resolved config that loads back to the same Config, private files, one writer
at a time, and checkpoints continued only with the config that made them."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import multiprocessing
import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcrl.config import load_config
from hpcrl.config.dump import dump_toml
from hpcrl.errors import ConfigError, HpcrlError, SlurmError
from hpcrl.fsio import write_atomic
from hpcrl.launch import follow, head
from hpcrl.launch.head import GroupFailed, run_head
from hpcrl.launch.submit import launch_record, prepare_run_dir, submit_run
from hpcrl.rundir import (
    CONFIG_FILE,
    EXIT_FILE,
    JOB_FILE,
    JOB_ID_FILE,
    LAUNCH_FILE,
    SCRIPT_FILE,
    SECRET_FILE,
    RunDirBusy,
    read_json,
    write_json,
)
from hpcrl.slurm.record import VERSION, read_launch
from hpcrl.slurm.spec import job_spec

REPO = Path(__file__).resolve().parents[2]
HOLDER = """
import sys
from hpcrl.rundir import RunLock
with RunLock(sys.argv[1], "a test's holder"):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin (or kills us)
"""


@contextlib.contextmanager
def lock_held_elsewhere(run_dir: Path) -> Iterator[subprocess.Popen]:
    """Another process holds the run directory's lock while the block runs (it says so on stdout first)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        yield holder
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(10)


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def tiny(run_dir: Path, *overrides: str):
    return load_config(REPO / "configs" / "tiny_grpo.toml", overrides=[f"run.run_dir={run_dir}", *overrides])


def test_the_resolved_config_copy_loads_back_to_an_equal_config(tmp_path: Path):
    for name in ("tiny_grpo", "llama70b_grpo"):
        config = load_config(REPO / "configs" / f"{name}.toml", cluster=str(REPO / "launch" / "generic.toml"),
                             overrides=["trainer.lr=2e-6"])
        copy = tmp_path / f"{name}.toml"
        copy.write_text(dump_toml(config))
        assert load_config(copy) == config


def test_prepare_run_dir_writes_config_launch_and_one_log_folder_per_group(tmp_path: Path):
    config = load_config(REPO / "configs" / "tiny_grpo.toml", overrides=[f"run.run_dir={tmp_path / 'run'}"])
    spec = job_spec(config)
    launch = launch_record(config, spec, executor="local", python="/usr/bin/python3", exit_codes={"reward/0": 5})
    prepare_run_dir(tmp_path / "run", config_toml="x = 1\n", launch=launch, groups=["head", "trainer"])
    assert (tmp_path / "run" / CONFIG_FILE).read_text() == "x = 1\n"
    assert read_launch(tmp_path / "run") == launch  # the typed record survives its JSON file
    assert sorted(p.name for p in (tmp_path / "run" / "logs").iterdir()) == ["head", "trainer"]
    assert not list((tmp_path / "run").glob(".*tmp*"))


def test_a_launch_file_that_is_not_the_record_is_an_error_naming_the_file(tmp_path: Path):
    write_json(tmp_path / LAUNCH_FILE, {"version": VERSION, "program": "rl"})
    with pytest.raises(SlurmError, match=f"{tmp_path / LAUNCH_FILE} does not hold what the head needs"):
        read_launch(tmp_path)


def test_a_launch_file_of_version_1_is_read_as_the_same_record(tmp_path: Path):
    """A job requeued by Slurm after hpcrl was upgraded in its venv reads the launch.json its submit wrote."""
    config = load_config(REPO / "configs" / "tiny_grpo.toml", overrides=[f"run.run_dir={tmp_path}"])
    record = launch_record(config, job_spec(config), executor="local", python="/usr/bin/python3")
    current = record.to_json()
    # version 1 kept each component's fields flat beside the slot's, its index under "component", no role
    flat = [{**{k: v for k, v in g["component"].items() if k not in ("index", "role")},
             **{k: v for k, v in g.items() if k != "component"}, "component": g["component"]["index"],
             "tasks": g["component"]["nodes"] * g["component"]["tasks_per_node"]}
            for g in current["groups"]]
    write_json(tmp_path / LAUNCH_FILE, {**current, "version": 1, "groups": flat})
    read = read_launch(tmp_path)
    unroled = tuple(dataclasses.replace(g, component=dataclasses.replace(g.component, role=""))
                    for g in record.groups)
    assert read == dataclasses.replace(record, groups=unroled)


def test_a_launch_file_of_an_unknown_version_is_refused_with_the_command_that_writes_it_again(tmp_path: Path):
    config = load_config(REPO / "configs" / "tiny_grpo.toml", overrides=[f"run.run_dir={tmp_path}"])
    current = launch_record(config, job_spec(config), executor="local", python="/usr/bin/python3").to_json()
    write_json(tmp_path / LAUNCH_FILE, {**current, "version": 99})
    with pytest.raises(SlurmError, match=f"{tmp_path / LAUNCH_FILE} is not a launch record of version {VERSION} "
                                         r"\(it says 99; .*`hpcrl resume RUN_DIR`"):
        read_launch(tmp_path)


def test_cluster_python_is_the_interpreter_of_the_head_and_of_every_task(tmp_path: Path):
    venv = "/shared/venvs/hpcrl/bin/python"
    config = load_config(REPO / "configs" / "tiny_grpo.toml", cluster=str(REPO / "launch" / "generic.toml"),
                         overrides=[f"run.run_dir={tmp_path / 'run'}", 'cluster.executor="slurm"',
                                    f'cluster.python="{venv}"'])
    dry = submit_run(config, dry_run=True, program="check")
    assert read_launch(dry.run_dir).python == venv  # the head starts every group task with it
    assert f"SUBMITIT_EXECUTOR=slurm {venv} -u -m submitit.core._submit" in (dry.run_dir / SCRIPT_FILE).read_text()


def test_write_atomic_makes_a_0600_file_through_a_temporary_name_nobody_can_plant(tmp_path: Path):
    victim = tmp_path / "victim"
    victim.write_text("mine")
    (tmp_path / f".job_id.tmp{os.getpid()}").symlink_to(victim)  # where the temporary file used to be
    with umask(0o002):
        write_atomic(tmp_path / "job_id", "1234\n")
    assert victim.read_text() == "mine"
    target = tmp_path / "job_id"
    assert not target.is_symlink() and target.read_text() == "1234\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


def test_under_umask_002_a_dry_run_leaves_the_run_directory_0700_and_every_file_in_it_0600(tmp_path: Path):
    """Also what an older hpcrl left there under that umask: a group member could rewrite launch.json."""
    run_dir = tmp_path / "runs" / "tiny"
    config = tiny(run_dir, 'cluster.executor="slurm"')
    with umask(0o002):
        (run_dir / "logs" / "trainer").mkdir(parents=True)
        (run_dir / LAUNCH_FILE).write_text("{}")
        submit_run(config, dry_run=True, program="check")
        assert os.umask(0o002) == 0o002  # and the caller's umask is back
    modes = {p.relative_to(tmp_path): stat.S_IMODE(p.lstat().st_mode) for p in [run_dir, *run_dir.rglob("*")]}
    assert {Path("runs/tiny") / n for n in (SCRIPT_FILE, CONFIG_FILE, LAUNCH_FILE, SECRET_FILE)} <= set(modes)
    assert {p: m for p, m in modes.items() if m not in (0o600, 0o700)} == {}
    assert modes[Path("runs/tiny")] == modes[Path("runs/tiny/logs/trainer")] == 0o700
    assert modes[Path("runs/tiny") / SCRIPT_FILE] == modes[Path("runs/tiny") / LAUNCH_FILE] == 0o600


def test_a_dry_run_into_a_finished_run_keeps_its_exit_and_job_records(tmp_path: Path):
    config = tiny(tmp_path)
    submit_run(config, dry_run=True)
    ended = subprocess.Popen(["true"])
    ended.wait()
    write_json(tmp_path / JOB_FILE, {"executor": "local", "job_id": str(ended.pid), "layout": "hetjob",
                                     "slurm_conf": "", "submitted_at": 0.0, "groups": ["head", "trainer"]})
    write_atomic(tmp_path / JOB_ID_FILE, f"{ended.pid}\n")
    write_json(tmp_path / EXIT_FILE, {"state": "COMPLETED", "error": "", "failures": [], "tasks": []})
    submit_run(config, dry_run=True)
    assert read_json(tmp_path / JOB_FILE)["job_id"] == str(ended.pid)
    assert (tmp_path / JOB_ID_FILE).is_file() and read_json(tmp_path / EXIT_FILE)["state"] == "COMPLETED"
    assert follow.status(tmp_path).state == "COMPLETED"


def test_checkpoints_are_continued_only_with_their_config_but_for_run_keys_or_through_resume(tmp_path: Path):
    submit_run(tiny(tmp_path), dry_run=True)
    (tmp_path / "checkpoints" / "step_50").mkdir(parents=True)
    made_with = (tmp_path / CONFIG_FILE).read_text()
    changed = tiny(tmp_path, "trainer.lr=2e-3", "algorithm.group_size=4", "trainer.steps=300")
    with pytest.raises(ConfigError) as refused:
        submit_run(changed, dry_run=True)
    message = str(refused.value)
    assert "would continue them with 2 key(s) changed: algorithm.group_size: 16 -> 4; trainer.lr: 0.001 -> 0.002." in message
    assert f"`hpcrl resume {tmp_path} --set KEY=VALUE`" in message and "trainer.steps" not in message
    assert (tmp_path / CONFIG_FILE).read_text() == made_with  # nothing was written
    # keys a user may change between runs of one run directory
    submit_run(tiny(tmp_path, "trainer.steps=300", "trainer.checkpoint_interval=10", "trainer.keep_last=3",
                    "run.start_timeout_s=900", 'cluster.executor="local"'), dry_run=True)
    submit_run(changed, dry_run=True, resume=True)  # hpcrl resume: the explicit way
    assert load_config(tmp_path / CONFIG_FILE).trainer.lr == 2e-3


@pytest.mark.timeout(60)
def test_a_second_writer_is_refused_naming_the_holder_and_a_killed_holder_leaves_no_stale_lock(
        tmp_path: Path, monkeypatch):
    config = tiny(tmp_path)
    submit_run(config, dry_run=True, program="check")
    monkeypatch.setattr(head, "HEAD_LOCK_WAIT_S", 0.5)
    with lock_held_elsewhere(tmp_path) as holder:
        named = (rf"{tmp_path} is in use by a test's holder \(pid {holder.pid} on host {socket.gethostname()}, "
                 r"since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC\)")
        with pytest.raises(RunDirBusy, match=named + "; hpcrl submit refuses"):
            submit_run(config, dry_run=True)
        with pytest.raises(GroupFailed, match=named + r" \(waited 0 s\); the head of a job refuses"):
            run_head(tmp_path)  # a job that starts meanwhile waits a while, then fails before writing anything
        assert not (tmp_path / EXIT_FILE).exists()
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    submit_run(config, dry_run=True)  # the kernel dropped the dead holder's lock


def _submit_at_once(config, barrier, results) -> None:
    """One of two racing `hpcrl submit`s (a forked process): submit when both are ready, report how it went."""
    try:
        barrier.wait(30)
        done = submit_run(config, program="check")
        secret = hashlib.sha256((done.run_dir / SECRET_FILE).read_bytes()).hexdigest()
        results.put(("submitted", os.getpid(), done.job_id, secret))
    except HpcrlError as err:
        results.put(("refused", os.getpid(), str(err), ""))


@pytest.mark.timeout(90)
def test_of_two_submits_racing_into_one_run_directory_one_wins_and_the_other_is_refused_naming_it(
        tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    config = tiny(tmp_path, 'cluster.executor="local"')
    from hpcrl.slurm import executor  # noqa: F401 - imported before the race, as a warm CLI would have it
    fork = multiprocessing.get_context("fork")
    barrier, results = fork.Barrier(2), fork.Queue()
    racers = [fork.Process(target=_submit_at_once, args=(config, barrier, results)) for _ in range(2)]
    for racer in racers:
        racer.start()
    outcomes = sorted(results.get(timeout=60) for _ in racers)
    for racer in racers:
        racer.join(30)
    (lost, loser_pid, why, _), (won, winner_pid, job_id, secret) = outcomes
    assert (lost, won) == ("refused", "submitted"), outcomes
    # refused by the winner's lock while it submits, or by its live job once it has: either way named
    assert (f"in use by hpcrl submit (pid {winner_pid} on host {socket.gethostname()}" in why
            or f"belongs to local job {job_id}, still" in why), why
    assert read_json(tmp_path / JOB_FILE)["job_id"] == job_id
    assert follow.wait(tmp_path, timeout_s=60).state == "COMPLETED"  # every task authenticated with that secret
    assert hashlib.sha256((tmp_path / SECRET_FILE).read_bytes()).hexdigest() == secret
