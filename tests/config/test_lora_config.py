"""[lora]: its keys, the checks against the model (targets it has, a rank it can hold), its round trip through
the run directory's config.toml, and the adapter tensors' names and shapes (hpcrl/models/lora.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.config import load_config
from hpcrl.config.dump import dump_toml
from hpcrl.config.model_shapes import shape_of
from hpcrl.errors import ConfigError
from hpcrl.models.lora import BLOCK_TARGETS, adapter_parameters, present_targets
from hpcrl.models.presets import PRESETS

REPO = Path(__file__).resolve().parents[2]


def with_lora(tmp_path: Path, table: str, *overrides: str):
    path = tmp_path / "lora.toml"
    path.write_text((REPO / "configs/tiny_grpo.toml").read_text() + "\n[lora]\n" + table)
    return load_config(path, overrides=overrides)


def test_no_lora_table_trains_every_weight_and_writes_no_lora_table():
    config = load_config(REPO / "configs/tiny_grpo.toml")
    assert config.lora is None and "[lora]" not in dump_toml(config)


def test_an_empty_lora_table_turns_lora_on_with_every_linear_layer_and_round_trips(tmp_path: Path):
    config = with_lora(tmp_path, "")
    assert config.lora is not None and config.lora.rank == 16 and config.lora.alpha == 32.0
    assert config.lora.targets == list(BLOCK_TARGETS) and config.lora.dropout == 0.0
    copy = tmp_path / "config.toml"
    copy.write_text(dump_toml(config))
    assert load_config(copy) == config


@pytest.mark.parametrize("table, key, says", [
    ('targets = ["q_proj", "qproj"]\n', "lora.targets", "did you mean 'q_proj'?"),
    ("targets = []\n", "lora.targets", "is empty"),
    ('targets = ["v_proj", "v_proj"]\n', "lora.targets", "'v_proj' twice"),
    ("rank = 0\n", "lora.rank", "at least 1"),
    ("rank = 200\n", "lora.rank", "at most 64"),  # k_proj: 2 KV heads x 32
    ("alpha = -1.0\n", "lora.alpha", "above 0"),
    ("dropout = 1.0\n", "lora.dropout", "[0, 1)"),
    ('init_from = "a\\nb"\n', "lora.init_from", "control character"),
    ("rnak = 4\n", "lora.rnak", "did you mean 'rank'?"),
])
def test_a_bad_lora_key_is_a_config_error_naming_it_and_the_fix(tmp_path: Path, table: str, key: str, says: str):
    with pytest.raises(ConfigError) as err:
        with_lora(tmp_path, table)
    assert err.value.key == key and says in str(err.value)


def test_a_target_the_model_lacks_lists_the_layers_it_has():
    shape = PRESETS["tiny-qwen3-moe"]
    # every layer routes its MLP; the untied output layer takes one too
    assert present_targets(shape) == ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"]


def test_the_lm_head_takes_an_adapter_of_rank_by_hidden_and_vocab_by_rank(tmp_path: Path):
    config = with_lora(tmp_path, 'rank = 4\ntargets = ["lm_head"]\n')
    shape = shape_of(config.model)
    assert list(adapter_parameters(shape, 4, config.lora.targets)) == [
        ("lm_head.lora_A.weight", (4, shape.hidden_size)), ("lm_head.lora_B.weight", (shape.vocab_size, 4))]


def test_a_family_without_lora_is_refused_naming_the_table(tmp_path: Path):
    with pytest.raises(ConfigError) as err:
        with_lora(tmp_path, "rank = 4\n", 'model.preset="tiny-deepseek-v3"', 'model.path=""')
    assert err.value.key == "lora" and "takes no LoRA adapters" in str(err.value)


def test_adapters_are_named_as_peft_names_them_with_a_rank_by_in_and_an_out_by_rank_tensor(tmp_path: Path):
    config = with_lora(tmp_path, 'rank = 4\ntargets = ["q_proj", "down_proj"]\n')
    shape = shape_of(config.model)
    tensors = dict(adapter_parameters(shape, 4, config.lora.targets))
    hf = dict(shape.hf_parameters())
    assert len(tensors) == 2 * 2 * shape.num_layers
    for layer in range(shape.num_layers):
        for module in (f"model.layers.{layer}.self_attn.q_proj", f"model.layers.{layer}.mlp.down_proj"):
            out, inp = hf[f"{module}.weight"]
            assert tensors[f"{module}.lora_A.weight"] == (4, inp) and tensors[f"{module}.lora_B.weight"] == (out, 4)
