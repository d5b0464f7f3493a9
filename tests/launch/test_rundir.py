"""The run directory keeps a resolved config that loads back to the same Config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hpcrl.config import load_config
from hpcrl.config.dump import dump_toml
from hpcrl.errors import SlurmError
from hpcrl.launch.submit import launch_record, prepare_run_dir, submit_run
from hpcrl.rundir import CONFIG_FILE, LAUNCH_FILE, SCRIPT_FILE, write_json
from hpcrl.slurm.record import VERSION, read_launch
from hpcrl.slurm.spec import job_spec

REPO = Path(__file__).resolve().parents[2]


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
