"""The Qwen3-MoE family: config.json both ways, HF and vLLM parameters, memory terms."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpcrl.config.model_shapes import PRESETS, from_hf_config

#: Qwen/Qwen3-30B-A3B's config.json as published (the keys hpcrl reads; "num_experts" as Qwen spells it).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "attention_bias": False,
}

#: Three blocks, the middle one dense (mlp_only_layers), experts not renormalised: every branch.
MIXED = replace(PRESETS["tiny-qwen3-moe"], num_layers=3, mlp_only_layers=(1,), norm_topk_prob=False)


def test_a_published_qwen3_moe_config_json_reads_as_the_preset_and_back():
    shape = from_hf_config(QWEN3_30B_A3B)
    assert shape == PRESETS["qwen3-30b-a3b"]
    assert from_hf_config(shape.to_hf_config()) == shape
    # transformers 5 saves the expert count as num_local_experts (its attribute_map).
    saved = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert from_hf_config(saved).num_experts == 128


def test_transformers_reads_the_config_json_the_family_writes():
    transformers = pytest.importorskip("transformers")
    hf = MIXED.to_hf_config()
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 32)
    assert (config.mlp_only_layers, config.norm_topk_prob) == ([1], False)


def test_qwen3_moe_presets_have_the_published_parameter_counts():
    assert round(PRESETS["qwen3-30b-a3b"].num_parameters / 1e9, 2) == 30.53
    assert round(PRESETS["qwen3-235b-a22b"].num_parameters / 1e9, 2) == 235.09


def test_moe_layers_list_a_router_and_every_expert_and_dense_layers_a_plain_mlp():
    params = dict(MIXED.hf_parameters())
    assert params["model.layers.0.mlp.gate.weight"] == (8, 64)
    assert params["model.layers.2.mlp.experts.7.gate_proj.weight"] == (32, 64)
    assert params["model.layers.2.mlp.experts.7.down_proj.weight"] == (64, 32)
    assert params["model.layers.1.mlp.gate_proj.weight"] == (128, 64)  # mlp_only_layers: dense
    assert "model.layers.0.mlp.gate_proj.weight" not in params and "model.layers.1.mlp.gate.weight" not in params
    attention = 2 * 64 + 2 * 16 + (64 + 2 * 32 + 64) * 64
    assert MIXED.layer_parameters == attention + 8 * 64 + 8 * 3 * 32 * 64  # the largest block: a MoE one


def test_vllm_parameters_are_the_router_and_fused_w13_and_w2_per_moe_layer():
    params = {p.name: p for p in MIXED.family.vllm_parameters(MIXED)}
    w13 = params["model.layers.0.mlp.experts.w13_weight"]
    assert w13.layer == "moe_w13" and len(w13.hf) == 16
    assert w13.hf[:3] == ("model.layers.0.mlp.experts.0.gate_proj.weight",
                          "model.layers.0.mlp.experts.0.up_proj.weight",
                          "model.layers.0.mlp.experts.1.gate_proj.weight")
    w2 = params["model.layers.2.mlp.experts.w2_weight"]
    assert w2.layer == "moe_w2" and w2.hf[-1] == "model.layers.2.mlp.experts.7.down_proj.weight"
    assert params["model.layers.0.mlp.gate.weight"].layer == "replicated"
    assert params["model.layers.1.mlp.gate_up_proj.weight"].layer == "merged_column"
    # Every HF tensor is read by exactly one vLLM parameter.
    read = [name for p in params.values() for name in p.hf]
    assert sorted(read) == sorted(name for name, _ in MIXED.hf_parameters())


def test_moe_activation_memory_counts_each_token_once_per_routed_expert():
    shape = PRESETS["qwen3-30b-a3b"]
    h, kv = 2048, 4 * 128
    assert shape.family.activation_values_per_token(shape) == 7 * h + 2 * kv + 8 * (2 * h + 4 * 768) + 2 * 128
    top2 = replace(shape, num_experts_per_tok=2)
    assert top2.family.activation_values_per_token(top2) < shape.family.activation_values_per_token(shape)
