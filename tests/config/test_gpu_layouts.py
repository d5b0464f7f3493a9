"""GPU layouts that a node of the cluster profile cannot hold: each is a ConfigError at load naming the key and
the fix (hpcrl.config.components). The profile is launch/generic.toml: 8 GPUs, 96 CPUs, 1024 GiB per node."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.config import load_config
from hpcrl.config.components import make_components
from hpcrl.errors import ConfigError

CONFIG = """\
[run]
name = "g"

[model]
preset = "qwen2.5-7b"

[trainer]
nodes = 1
gpus_per_node = 8
micro_batch_size = 1
global_batch_size = 64

[inference]
replicas = 4
tensor_parallel = 2
gpus_per_node = 8

[reward]
function = "hpcrl.reward.builtin:exact_match"

[algorithm]
group_size = 8

[data]
source = "builtin:arithmetic"
"""

# (what is wrong, --set overrides, the key named, words of the problem and of the fix)
CASES = [
    ("more GPUs per node than the node has", ["trainer.gpus_per_node=16"],
     "trainer.gpus_per_node", ["16 GPUs per node", "have 8", "at most 8"]),
    ("replicas x TP not filling whole nodes", ["inference.replicas=3", "inference.tensor_parallel=4"],
     "inference.replicas", ["3 replicas do not fill 2 inference nodes", "multiple of 2", "2 of TP 4 fit a node"]),
    ("an inference node asked for fewer GPUs than its replicas use", ["groups.inference.gpus_per_node=4"],
     "groups.inference.gpus_per_node", ["fewer than the 4 replica(s) x TP 2 = 8", "remove groups.inference"]),
    ("CPUs per GPU over the node", ["cluster.cpus_per_gpu=16"],
     "cluster.cpus_per_gpu", ["16 x 8 GPUs is more than the node's 96 CPUs", "at most 12"]),
    ("CPUs per task over the node", ["groups.trainer.cpus_per_task=16"],
     "groups.trainer.cpus_per_task", ["8 task(s) x 16 CPUs = 128", "nodes have 96", "at most 12"]),
    ("memory per node over the node", ['groups.inference.mem="2000G"'],
     "groups.inference.mem", ["2000G of memory", "have 1024 GiB"]),
    ("memory per GPU over the node", ["cluster.mem_per_gpu_gib=200"],
     "cluster.mem_per_gpu_gib", ["200 x 8 GPUs is more than the node's 1024 GiB", "at most 128"]),
    ("GPUs for a reward function", ["groups.reward.gpus_per_node=1"],
     "groups.reward.gpus_per_node", ['reward.kind = "function"', 'reward.kind = "model"']),
    ("reward GPUs not split evenly among its tasks", ['reward.kind="model"', 'reward.model_path="/nowhere"',
                                                      "reward.tasks=2", "groups.reward.gpus_per_node=3"],
     "groups.reward.gpus_per_node", ["3 GPUs per node cannot be split evenly among 2 reward tasks", "multiple of 2"]),
    ("more reward GPUs than a node has", ['reward.kind="model"', 'reward.model_path="/nowhere"',
                                          "groups.reward.gpus_per_node=16"],
     "groups.reward.gpus_per_node", ["16 GPUs per node", "have 8"]),
    ("GPUs for the head", ["groups.head.gpus_per_node=1"], "groups.head.gpus_per_node", ["uses no GPU"]),
    ("TP larger than an inference node", ["inference.gpus_per_node=2", "inference.tensor_parallel=4"],
     "inference.tensor_parallel", ["more than the 2 GPUs", "at most 2"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_gpu_layout_a_node_cannot_hold_is_refused_at_load_naming_the_key_and_the_fix(case, tmp_path: Path):
    _, overrides, key, words = case
    path = tmp_path / "g.toml"
    path.write_text(CONFIG)
    with pytest.raises(ConfigError) as caught:
        load_config(path, cluster="generic", overrides=overrides)
    assert caught.value.key == key, str(caught.value)
    for word in words:
        assert word in str(caught.value), str(caught.value)


def test_the_base_layout_loads_and_each_task_gets_its_share_of_the_node(tmp_path: Path):
    path = tmp_path / "g.toml"
    path.write_text(CONFIG)
    parts = {c.name: c for c in make_components(load_config(path, cluster="generic"))}
    trainer, inference = parts["trainer"], parts["inference"]
    assert (trainer.tasks_per_node, trainer.gpus_per_task, trainer.cpus_per_task, trainer.mem) == (8, 1, 12, "1024G")
    assert (inference.tasks_per_node, inference.gpus_per_task, inference.cpus_per_task) == (4, 2, 24)
    assert inference.gpus_per_node == 8 and inference.mem == "1024G"
    assert (parts["head"].cpus_per_task, parts["head"].mem) == (4, "16G")  # the profile's [groups.head]: cpu nodes
    assert len(CASES) >= 8
