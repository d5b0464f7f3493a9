"""A task knows its group, replica, rank and node from environments recorded on Slurm 22.05.

The .env files in data/env were captured from a real 4-component hetjob on tools/local_slurm.sh
(head 1 task on n1, trainer 2 nodes n[2-3], inference n4, reward n5): `hetjob_g1_*` from
`srun --het-group=1`, `hetjob_g2_0` from `srun --het-group=2`, `hetjob_m13_*` from one step
spanning het groups 1 and 3 (`srun --het-group=1,3`), `hetjob_batch` from the batch step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcrl.config import load_config
from hpcrl.errors import SlurmError
from hpcrl.slurm.identity import identify_task, layout_env, step_components
from hpcrl.slurm.nodelist import expand_nodelist
from hpcrl.slurm.spec import job_spec

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data" / "env"
LAYOUT = json.dumps({"groups": [
    {"name": "head", "component": 0, "tasks": 1, "ranks_per_replica": 1},
    {"name": "trainer", "component": 1, "tasks": 2, "ranks_per_replica": 1},
    {"name": "inference", "component": 2, "tasks": 1, "ranks_per_replica": 1},
    {"name": "reward", "component": 3, "tasks": 1, "ranks_per_replica": 1},
]})


def recorded(name: str, **extra: str) -> dict[str, str]:
    env = dict(line.split("=", 1) for line in (DATA / f"{name}.env").read_text().splitlines() if "=" in line)
    return {**env, "HPCRL_LAYOUT": LAYOUT, **extra}


@pytest.mark.parametrize("name, group, rank, node, node_index", [
    ("hetjob_g1_0", "trainer", 0, "n2", 0),
    ("hetjob_g1_1", "trainer", 1, "n3", 1),
    ("hetjob_g2_0", "inference", 0, "n4", 0),
])
def test_a_single_group_step_is_recognised_from_its_nodes_alone(name, group, rank, node, node_index):
    who = identify_task(recorded(name))
    assert (who.group, who.rank, who.node, who.node_index) == (group, rank, node, node_index)


def test_the_step_groups_set_by_the_head_win_over_node_matching():
    assert step_components(recorded("hetjob_g2_0", HPCRL_STEP_COMPONENTS="2")) == [2]
    assert identify_task(recorded("hetjob_g1_1", HPCRL_STEP_COMPONENTS="1")).rank == 1


@pytest.mark.parametrize("name, group, rank, node", [
    ("hetjob_m13_0", "trainer", 0, "n2"),
    ("hetjob_m13_1", "trainer", 1, "n3"),
    ("hetjob_m13_2", "reward", 0, "n5"),
])
def test_a_step_spanning_two_groups_derives_the_component_from_procid_and_task_counts(name, group, rank, node):
    env = recorded(name)
    assert step_components(env) == [1, 3]
    who = identify_task(env)
    assert (who.group, who.rank, who.node, who.component) == (group, rank, node, {"trainer": 1, "reward": 3}[group])


def test_replicas_group_consecutive_ranks():
    layout = json.loads(LAYOUT)
    layout["groups"][1]["ranks_per_replica"] = 2
    assert identify_task({**recorded("hetjob_g1_1"), "HPCRL_LAYOUT": json.dumps(layout)}).replica == 0
    layout["groups"][1]["ranks_per_replica"] = 1
    assert identify_task({**recorded("hetjob_g1_1"), "HPCRL_LAYOUT": json.dumps(layout)}).replica == 1


def test_a_split_job_task_takes_its_group_from_the_head_and_its_rank_from_slurm():
    env = {"HPCRL_LAYOUT": LAYOUT, "HPCRL_GROUP": "trainer", "SLURM_PROCID": "1", "SLURM_NODEID": "1",
           "SLURMD_NODENAME": "n3", "SLURM_LOCALID": "0"}
    who = identify_task(env)
    assert (who.group, who.rank, who.node, who.node_index, who.group_size) == ("trainer", 1, "n3", 1, 2)


def test_the_layout_the_head_writes_names_each_groups_component_and_size():
    spec = job_spec(load_config(REPO / "configs" / "tiny_grpo.toml", overrides=["run.run_dir=/runs/t", "trainer.nodes=2"]))
    env = {"HPCRL_LAYOUT": layout_env(spec.groups), "HPCRL_GROUP": "trainer", "HPCRL_RANK": "1", "HPCRL_NODE": "box"}
    who = identify_task(env)
    trainer = spec.group("trainer")
    assert (who.component, who.group_size, who.replica) == (trainer.component.index, trainer.component.tasks,
                                                            1 // trainer.ranks_per_replica)


def test_a_local_task_reads_the_variables_of_the_local_launcher():
    who = identify_task({"HPCRL_LAYOUT": LAYOUT, "HPCRL_GROUP": "reward", "HPCRL_RANK": "0", "HPCRL_NODE": "box"})
    assert (who.group, who.rank, who.node) == ("reward", 0, "box")


def test_a_task_outside_any_launcher_is_told_how_it_should_be_started():
    with pytest.raises(SlurmError, match="started by the head"):
        identify_task({"HPCRL_LAYOUT": LAYOUT})
    with pytest.raises(SlurmError, match="HPCRL_LAYOUT is not set"):
        identify_task({"SLURM_HET_SIZE": "2"})


@pytest.mark.parametrize("text, hosts", [
    ("n1", ["n1"]),
    ("n[2-3,5]", ["n2", "n3", "n5"]),
    ("gpu[008-010],cpu1", ["gpu008", "gpu009", "gpu010", "cpu1"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
])
def test_host_lists_expand_like_scontrol_show_hostnames(text, hosts):
    assert expand_nodelist(text) == hosts


def test_a_malformed_host_list_is_an_error_naming_it():
    with pytest.raises(SlurmError, match="n\\[1-"):
        expand_nodelist("n[1-")
