"""A model family is one folder plus one registry line: a toy family from tests/ goes through the
config reader, the transfer planner and the torchtitan trainer without a line of hpcrl changed."""

from __future__ import annotations

from dataclasses import replace

import pytest
from toy_family import TOY

import hpcrl.models
from hpcrl.config.model_shapes import PRESETS, from_hf_config
from hpcrl.errors import ConfigError, TrainerError
from hpcrl.models import Family, ModelShape, architectures, register
from hpcrl.plan.transfer.check import check_plan, verify_elements
from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
from hpcrl.plan.transfer.planner import plan

TOY_CONFIG = {"architectures": ["ToyForCausalLM"], "model_type": "toy", "n_embd": 64, "n_inner": 96,
              "n_layer": 2, "n_head": 4, "n_kv_head": 2, "vocab_size": 90, "n_positions": 256}


def register_for_this_test(monkeypatch, family: Family) -> None:
    """`register(family)` in a copy of the registry that the test's end puts back."""
    monkeypatch.setattr(hpcrl.models, "_FAMILIES", dict(hpcrl.models._FAMILIES))
    register(family)


@pytest.fixture
def toy(monkeypatch) -> ModelShape:
    """The toy family registered (for this test only) and the shape of TOY_CONFIG."""
    register_for_this_test(monkeypatch, TOY)
    return from_hf_config(TOY_CONFIG)


def test_a_registered_family_reads_its_own_config_json(toy: ModelShape):
    assert toy.family is TOY and "ToyForCausalLM" in architectures()
    assert (toy.hidden_size, toy.intermediate_size, toy.num_layers, toy.head_dim) == (64, 96, 2, 16)
    assert toy.tie_embeddings and toy.qk_norm and not toy.qkv_bias
    assert from_hf_config(toy.to_hf_config()) == toy


def test_a_registered_family_lists_its_hugging_face_parameters(toy: ModelShape):
    params = dict(toy.hf_parameters())
    assert params["model.layers.1.self_attn.q_norm.weight"] == (16,)
    assert params["model.layers.0.self_attn.k_proj.weight"] == (2 * 16, 64)
    assert "lm_head.weight" not in params  # tied
    block = 2 * 64 + 2 * 16 + (64 + 2 * 32 + 64) * 64 + 3 * 96 * 64
    assert toy.layer_parameters == block
    assert toy.num_parameters == 90 * 64 + 2 * block + 64


@pytest.mark.parametrize("shard,tp", [(1, 1), (3, 2), (2, 4)])
def test_a_registered_family_gets_a_transfer_plan_that_fills_every_vllm_rank(toy: ModelShape, shard: int, tp: int):
    p = plan(TrainerLayout(dp_shard=shard), InferenceLayout(replicas=2, tensor_parallel=tp), toy,
             bucket_bytes=1 << 16)
    check_plan(p)
    verify_elements(p, toy)
    assert p.stats().ratio() == 1.0
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.qkv_proj.weight"} <= {
        d.name for d in p.dests}


def test_a_registered_family_is_built_by_torchtitan_with_every_parameter_named(toy: ModelShape):
    pytest.importorskip("torchtitan")
    from hpcrl.trainer import titan

    names = titan.hf_to_titan_names(toy)
    assert list(names) == [n for n, _ in toy.hf_parameters()]
    model = titan.build_model(toy, max_seq_len=32, device="meta")
    params = {titan.clean_name(n): tuple(p.shape) for n, p in model.named_parameters()}
    assert sorted(params) == sorted(names.values())
    for hf_name, dims in toy.hf_parameters():
        assert params[names[hf_name]] == dims, hf_name


def test_an_unknown_architecture_is_a_config_error_naming_the_known_ones():
    config = {**PRESETS["tiny-llama"].to_hf_config(), "architectures": ["MixtralForCausalLM"]}
    with pytest.raises(ConfigError) as err:
        from_hf_config(config, where="models/mixtral/config.json")
    message = str(err.value)
    assert "models/mixtral/config.json has architecture 'MixtralForCausalLM'" in message
    assert "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM" in message
    with pytest.raises(ConfigError, match="'MixtralForCausalLM', which hpcrl cannot train"):
        list(ModelShape(**{**vars(PRESETS["tiny-llama"]), "architecture": "MixtralForCausalLM"}).hf_parameters())


def test_two_families_cannot_claim_one_architecture(toy: ModelShape):
    register(TOY)  # the same family again: no change
    with pytest.raises(ConfigError, match="two model families claim architecture 'ToyForCausalLM'"):
        register(type(TOY)())


def test_a_family_naming_a_torchtitan_class_that_does_not_exist_is_a_trainer_error(monkeypatch):
    pytest.importorskip("torchtitan")
    from hpcrl.trainer import titan

    class Misnamed(type(TOY)):
        titan = replace(TOY.titan, block="torchtitan.models.qwen3.model.Qwen4TransformerBlock")

    register_for_this_test(monkeypatch, Misnamed())
    with pytest.raises(TrainerError, match="'torchtitan.models.qwen3.model.Qwen4TransformerBlock'"):
        titan.build_model(from_hf_config(TOY_CONFIG), max_seq_len=32)
