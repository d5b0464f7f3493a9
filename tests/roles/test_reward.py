"""The reward role takes its device from the environment it is given, as the config asks."""

from __future__ import annotations

import pytest

from hpcrl.config import load_config
from hpcrl.reward.types import RewardError
from hpcrl.roles.reward import RewardRole
from hpcrl.slurm.identity import TaskIdentity


def test_a_reward_task_given_gpus_by_the_config_but_seeing_none_stops_with_the_reason(repo, tmp_path):
    (tmp_path / "config.json").write_text("{}")  # the check fails before any model is read
    config = load_config(repo / "configs" / "tiny_grpo.toml",
                         overrides=['reward.kind="model"', f"reward.model_path={tmp_path}", "groups.reward.gpus_per_node=1"])
    identity = TaskIdentity(group="reward", component=3, rank=0, group_size=1, replica=0, local_rank=0, node="n0",
                            node_index=0)
    with pytest.raises(RewardError, match=r"gpus_per_node = 1, but this reward task sees no GPU \(CUDA_VISIBLE_DEVICES=''\)"):
        RewardRole(config, identity, {"CUDA_VISIBLE_DEVICES": ""})
