"""The resource plan: components, parameter counts, memory estimates against measurements."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.config.load import load_config_and_shape
from hpcrl.config.model_shapes import PRESETS
from hpcrl.plan import plan_resources
from hpcrl.plan.resources import GIB

REPO = Path(__file__).resolve().parents[2]


def plan_of(name: str, *overrides: str, cluster: str | None = None):
    config, shape = load_config_and_shape(REPO / "configs" / name, cluster=cluster, overrides=overrides)
    return plan_resources(config, shape)


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


@pytest.mark.parametrize("preset, published", [
    ("llama3-70b", 70_553_706_496),   # Meta's model card: 70.6 B
    ("llama3-8b", 8_030_261_248),
    ("llama3-1b", 1_235_814_400),
    ("qwen2.5-7b", 7_615_616_512),
    ("qwen2.5-0.5b", 494_032_768),
])
def test_parameter_counts_match_the_published_ones(preset: str, published: int):
    assert PRESETS[preset].num_parameters == published


def test_llama70b_plan_puts_64_trainer_ranks_on_8_nodes_and_4_replicas_on_4_nodes():
    plan = plan_of("llama70b_grpo.toml")
    by_name = {c.name: c for c in plan.components}
    assert [c.name for c in plan.components] == ["head", "trainer", "inference", "reward"]
    assert [c.index for c in plan.components] == [0, 1, 2, 3]
    assert (by_name["trainer"].nodes, by_name["trainer"].tasks_per_node, by_name["trainer"].gpus_per_node) == (8, 8, 8)
    assert (by_name["inference"].nodes, by_name["inference"].tasks) == (4, 4)
    assert plan.trainer_mesh == {"world_size": 64, "dp_replicate": 1, "dp_shard": 64}
    assert plan.fits


def test_replicas_share_a_node_when_tensor_parallel_leaves_room():
    plan = plan_of("llama8b_grpo.toml")
    inference = next(c for c in plan.components if c.name == "inference")
    assert (inference.nodes, inference.tasks_per_node) == (1, 4)


def test_hsdp_mesh_is_reported_as_replicate_times_shard():
    assert plan_of("qwen2.5-7b_grpo.toml").trainer_mesh == {"world_size": 16, "dp_replicate": 2, "dp_shard": 8}


def test_scoring_in_the_head_leaves_no_reward_component():
    plan = plan_of("tiny_grpo.toml", "reward.tasks=0")
    assert [c.name for c in plan.components] == ["head", "trainer", "inference"]


def test_trainer_estimate_is_within_ten_percent_of_the_measured_llama_1b_step(tmp_path: Path):
    # docs/FACTS.md: Llama-3 1B, FSDP2 on one H100, bf16 params / fp32 reduce, AdamW, batch 4 x 2048,
    # no activation checkpointing: 39.9 GiB.
    text = (REPO / "configs" / "llama8b_grpo.toml").read_text()
    path = tmp_path / "l1b.toml"
    path.write_text(text)
    plan = plan_of(str(path), "model.preset=llama3-1b", "trainer.gpus_per_node=1",
                   "trainer.activation_checkpointing=false", "trainer.micro_batch_size=4",
                   "trainer.global_batch_size=256", "data.max_prompt_tokens=1024",
                   "inference.max_tokens=1024", "algorithm.kl_coef=0.0", "inference.tensor_parallel=1",
                   "inference.gpus_per_node=1")
    estimate = plan.trainer_memory.total / GIB
    assert abs(estimate - 39.9) / 39.9 < 0.10, estimate


def test_a_70b_trainer_on_one_node_without_checkpointing_is_flagged_as_not_fitting():
    plan = plan_of("llama70b_grpo.toml", "trainer.nodes=1", "trainer.activation_checkpointing=false",
                   "trainer.global_batch_size=64")
    assert not plan.trainer_memory.fits
    assert not plan.fits
    assert any("trainer does NOT fit" in note for note in plan.notes)


def test_inference_that_cannot_hold_one_sequence_is_flagged():
    plan = plan_of("llama70b_grpo.toml", "inference.tensor_parallel=1", "inference.replicas=4")
    assert plan.kv_cache_tokens == 0
    assert not plan.fits
    assert any("inference does NOT fit" in note for note in plan.notes)


def test_the_plan_serialises_to_plain_json_types():
    import json
    data = json.loads(json.dumps(plan_of("tiny_grpo.toml", cluster="local").to_dict()))
    assert data["components"][1]["tasks"] == 1
    assert data["trainer_memory"]["device"] == "CPU node"
    assert data["fits"] is True
