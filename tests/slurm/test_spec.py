"""Broken group specs are refused before anything is written or submitted, naming key and fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.config import load_config
from hpcrl.config.components import make_components
from hpcrl.errors import ConfigError
from hpcrl.slurm.spec import job_spec, spare_nodes_of, time_limit_seconds

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_grpo.toml"
LOCAL = str(REPO / "launch" / "local.toml")
GENERIC = str(REPO / "launch" / "generic.toml")


def _spec(*overrides: str, cluster: str = LOCAL):
    return job_spec(load_config(TINY, cluster=cluster, overrides=["run.run_dir=/runs/t", *overrides]))


def test_a_misspelt_partition_key_is_refused_with_the_right_name(tmp_path: Path):
    broken = tmp_path / "broken.toml"
    broken.write_text(TINY.read_text() + '\n[groups.trainer]\npartiton = "debug"\n')
    with pytest.raises(ConfigError) as err:
        load_config(broken, cluster=LOCAL)
    assert err.value.key == "groups.trainer.partiton" and "did you mean 'partition'" in str(err.value)
    assert err.value.line is not None


def test_zero_trainer_nodes_are_refused():
    with pytest.raises(ConfigError, match="trainer.nodes: must be at least 1"):
        _spec("trainer.nodes=0")


def test_negative_group_nodes_are_refused():
    with pytest.raises(ConfigError, match="groups.inference.nodes"):
        _spec("groups.inference.nodes=-1")


def test_gpus_on_a_cpu_only_profile_are_refused_naming_the_profile():
    with pytest.raises(ConfigError) as err:
        _spec("groups.reward.gpus_per_node=1")
    assert err.value.key == "groups.reward.gpus_per_node" and "'local' has no GPUs" in str(err.value)
    with pytest.raises(ConfigError, match="inference.gpus_per_node"):
        _spec("inference.gpus_per_node=8")


def test_split_layout_refuses_groups_in_different_partitions():
    with pytest.raises(ConfigError) as err:
        _spec('cluster.layout="split"', cluster=GENERIC)
    assert err.value.key == "groups.reward.partition"
    assert 'layout = "hetjob"' in err.value.fix


def test_split_layout_lays_groups_end_to_end_and_keeps_the_head_off_its_own_node():
    spec = _spec('cluster.layout="split"', "trainer.nodes=2")
    assert [(g.name, g.first_node, g.component.nodes) for g in spec.groups] == [
        ("head", 0, 1), ("trainer", 0, 2), ("inference", 2, 1), ("reward", 3, 1)]
    assert dict(spec.blocks[0].options)["nodes"] == "4"


def test_hetjob_groups_take_cluster_defaults_and_their_own_settings():
    spec = _spec('groups.trainer.time="01:00:00"', 'groups.trainer.sbatch_extra=["--exclusive", "--reservation=rl"]')
    trainer = dict(spec.blocks[1].options)
    assert trainer["partition"] == "debug" and trainer["time"] == "01:00:00"
    assert trainer["exclusive"] == "" and trainer["reservation"] == "rl"
    assert time_limit_seconds(spec) == 3600


def test_every_group_slot_holds_its_component_as_the_planner_made_it():
    config = load_config(TINY, cluster=LOCAL, overrides=["run.run_dir=/runs/t", 'cluster.layout="split"'])
    assert [g.component for g in job_spec(config).groups] == make_components(config)


def test_trainer_replicas_follow_the_hsdp_layout():
    spec = _spec("trainer.nodes=2", "trainer.dp_replicate=2")
    assert spec.group("trainer").ranks_per_replica == 1
    assert _spec("trainer.nodes=2").group("trainer").ranks_per_replica == 2


def test_spare_nodes_in_a_hetjob_are_refused_naming_the_key_and_the_layout_that_holds_them():
    with pytest.raises(ConfigError) as err:
        _spec("cluster.spare_nodes=1")
    assert err.value.key == "cluster.spare_nodes" and 'layout = "split"' in err.value.fix
    with pytest.raises(ConfigError, match="cluster.spare_nodes: must be 0 or more"):
        _spec('cluster.layout="split"', "cluster.spare_nodes=-1")
    with pytest.raises(ConfigError, match="cluster.spare_nodes"):
        _spec('cluster.layout="split"', "cluster.spare_nodes=65")


def test_a_split_job_with_spare_nodes_asks_for_them_with_no_kill_and_finds_them_after_every_group():
    spec = _spec('cluster.layout="split"', "trainer.nodes=2", "inference.replicas=2", "cluster.spare_nodes=2")
    options = dict(spec.blocks[0].options)
    assert options["nodes"] == "7" and options["no-kill"] == "" and spec.spare_nodes == 2
    assert spare_nodes_of(spec.groups, [f"n{i}" for i in range(1, 8)], spec.spare_nodes) == ["n6", "n7"]
    assert "no-kill" not in dict(_spec('cluster.layout="split"').blocks[0].options)  # no spare: as before
