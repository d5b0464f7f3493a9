"""The resource plan: components, parameter counts, memory estimates against measurements."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.config.load import load_config_and_shape
from hpcrl.config.model_shapes import PRESETS
from hpcrl.errors import ConfigError
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


def test_a_token_budget_sizes_the_trainers_activations_and_logits_in_place_of_rows():
    rows = plan_of("tiny_grpo.toml", "trainer.micro_batch_size=64").trainer_memory.parts
    packed = plan_of("tiny_grpo.toml", "trainer.micro_batch_size=64", "trainer.micro_batch_tokens=40").trainer_memory.parts
    tokens_of_rows = 64 * (16 + 1)  # micro_batch_size x (max_prompt_tokens + max_tokens)
    assert packed["activations"] * tokens_of_rows == rows["activations"] * 40
    assert packed["logits_fp32"] * tokens_of_rows == rows["logits_fp32"] * 40
    assert {k: v for k, v in packed.items() if k not in ("activations", "logits_fp32")} == \
        {k: v for k, v in rows.items() if k not in ("activations", "logits_fp32")}


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


def test_the_70b_trainer_estimate_is_near_the_47_gib_measured_on_64_h100s():
    # configs/llama70b_grpo.toml on launch/generic.toml: FSDP over 64 ranks, bf16, kl_coef 0.001,
    # micro-batch 1 x (1024 + 4096) tokens, activation checkpointing. 70.55e9 parameters, of which
    # the root unit holds 2.10e9 (embedding and output head, 128256 x 8192 each, and the norm).
    #   fp32 params, grads and AdamW's 2 states: 16 B x 70.55e9 / 64            16.43 GiB
    #   the reference model, fp32 shards:         4 B x 70.55e9 / 64             4.11 GiB
    #   two gathered blocks in bf16:          2 x 2 B x 855.6e6                  3.19 GiB
    #   the gathered roots of policy and reference: 2 x 2 B x 2.10e9              7.83 GiB
    #   activations, fp32 logits, runtime:   7.91 + 4.89 + 3.00                 15.80 GiB
    #                                                                    total  47.35 GiB
    # Before: the reference in bf16 (2.05 GiB) and no roots: 37.5 GiB, 9.9 GiB short.
    plan = plan_of("llama70b_grpo.toml", cluster="generic")
    parts = plan.trainer_memory.parts
    assert parts["reference_model"] == 4 * 70_553_706_496 // 64
    assert parts["gathered_roots"] == 2 * 2 * (2 * 128256 * 8192 + 8192)
    estimate = plan.trainer_memory.total / GIB
    assert estimate == pytest.approx(47.35, abs=0.01)
    assert abs(estimate - 47.0) / 47.0 < 0.05


def _bytes_a_step_holds(shape, dtype: str, store: Path) -> dict[str, int]:
    """Bytes of the reference's shards, and of the roots gathered while the policy computes its
    logits, in one GRPO step of a world of one gloo rank (FSDP2, kl_coef > 0)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from hpcrl.algorithms.base import Options
    from hpcrl.trainer import EngineOptions, TrainerEngine, pad_rows

    dist.init_process_group("gloo", store=dist.FileStore(str(store), 1), rank=0, world_size=1)
    try:
        engine = TrainerEngine(EngineOptions(shape=shape, dtype=dtype, max_seq_len=64, micro_batch_size=4,
                                             loss=Options(kl_coef=0.1)))
        gathered: list[int] = []

        def count_gathered(*_):  # plain tensors, not DTensor shards: what FSDP has gathered now
            gathered.append(sum(p.numel() * p.element_size() for model in (engine.model, engine.reference)
                                for p in model.parameters() if not isinstance(p, DTensor)))

        # The final norm runs last in the forward (the engine applies lm_head itself, in chunks): the root is gathered.
        engine.model.norm.register_forward_hook(count_gathered)
        batch = pad_rows(sequences=[[1, *range(10, 40)]] * 4, prompt_lengths=[2] * 4,
                         old_logprobs=[[-5.0] * 29] * 4, advantages=[1.0, -1.0, 0.5, 0.0])
        engine.train_step(batch)
        assert engine.reference is not None
        reference = sum(p.to_local().numel() * p.to_local().element_size() for p in engine.reference.parameters())
        assert {p.to_local().dtype for p in engine.reference.parameters()} == {torch.float32}
        return {"reference_model": reference, "gathered_roots": max(gathered)}
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype, gpus", [("bfloat16", 1), ("float32", 0)])
def test_the_reference_and_gathered_roots_are_estimated_as_a_measured_cpu_step_holds_them(
        tmp_path: Path, dtype: str, gpus: int):
    # A tiny Llama with a 4096-token vocabulary, so that the root (embedding, norm, head) is 1/3 of
    # the model. The plan counts bf16 compute only on GPUs, so the bf16 case plans for one GPU.
    import dataclasses
    shape = dataclasses.replace(PRESETS["tiny-llama"], vocab_size=4096)
    config, _ = load_config_and_shape(REPO / "configs" / "tiny_grpo.toml", overrides=(
        f"model.dtype={dtype}", f"trainer.gpus_per_node={gpus}", "algorithm.kl_coef=0.1"))
    parts = plan_resources(config, shape).trainer_memory.parts
    measured = _bytes_a_step_holds(shape, dtype, tmp_path / "store")
    assert measured == {"reference_model": parts["reference_model"], "gathered_roots": parts["gathered_roots"]}


def test_a_set_kv_cache_size_replaces_what_gpu_memory_utilization_leaves_on_gpus_and_on_cpu():
    tiny = plan_of("tiny_grpo.toml")  # 64 MiB of 1 KiB tokens (2 layers x K and V x 2 heads x 32 x fp32)
    assert tiny.kv_cache_tokens == 65_536
    assert plan_of("tiny_grpo.toml", "inference.kv_cache_gib=0.125").kv_cache_tokens == 131_072
    big = plan_of("llama70b_grpo.toml", "inference.kv_cache_gib=1")
    assert big.kv_cache_tokens == 2**30 // (2 * 80 * 8 * 128 * 2 // 8)  # TP 8: one KV head per GPU
    tight = plan_of("tiny_grpo.toml", "inference.kv_cache_gib=0.00001")
    assert tight.kv_cache_tokens == 10 and any("inference does NOT fit" in n and "kv_cache_gib" in n
                                                for n in tight.notes)


def test_a_negative_kv_cache_size_is_refused_with_the_key_and_a_fix():
    with pytest.raises(ConfigError, match=r"inference.kv_cache_gib: must be zero or more, got -1.0.*Fix: set"):
        plan_of("tiny_grpo.toml", "inference.kv_cache_gib=-1")


def test_a_moe_trainer_estimate_shards_every_expert_and_counts_each_token_through_its_top_k():
    from dataclasses import replace

    from hpcrl.models.shape import numel

    config, shape = load_config_and_shape(REPO / "configs" / "qwen3-30b-a3b_grpo.toml")
    parts = plan_resources(config, shape).trainer_memory.parts
    # all 128 experts of all 48 blocks are in the sharded fp32 state: 28.99 B of the 30.53 B parameters
    experts = shape.experts()
    assert experts is not None and experts.parameters == 48 * 128 * 3 * 768 * 2048
    assert experts.parameters == sum(numel(size) for name, size in shape.hf_parameters() if ".mlp.experts." in name)
    assert parts["params_fp32"] == 4 * shape.num_parameters // 16 and parts["adamw_states"] == 2 * parts["params_fp32"]
    assert parts["gathered_blocks"] == 2 * 2 * shape.layer_parameters  # a gathered block holds all its experts
    assert shape.layer_parameters > 128 * 3 * 768 * 2048
    # activations: each token through k experts, so top-2 saves 6 of the 8 dispatched copies (2h + 4f each)
    tokens = config.trainer.micro_batch_size * (config.data.max_prompt_tokens + config.inference.max_tokens)
    top2 = plan_resources(config, replace(shape, num_experts_per_tok=2)).trainer_memory.parts
    assert parts["activations"] - top2["activations"] == tokens * 6 * (2 * 2048 + 4 * 768) * 2  # bf16, checkpointed


def test_the_qwen3_30b_a3b_plan_fits_two_nodes_of_80_gib_gpus_and_says_where_the_experts_are():
    plan = plan_of("qwen3-30b-a3b_grpo.toml", cluster="generic")
    assert plan.fits
    assert plan.trainer_mesh == {"world_size": 16, "dp_replicate": 1, "dp_shard": 16}
    assert (plan.inference_layout["replicas"], plan.inference_layout["tensor_parallel"]) == (2, 4)
    assert 40 * GIB < plan.trainer_memory.total < 48 * GIB
    assert any(n.startswith("experts: 28.99 B of the 30.53 B parameters (95%)") and "up to 8 of every block's 128"
               in n for n in plan.notes)
