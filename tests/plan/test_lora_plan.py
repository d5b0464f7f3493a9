"""The memory plan of a LoRA trainer: gradients and AdamW states of the adapters only, no reference copy."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hpcrl.config.load import load_config_and_shape
from hpcrl.models.lora import adapter_parameters
from hpcrl.plan import plan_resources
from hpcrl.plan.resources import GIB

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def test_a_lora_trainer_holds_gradients_and_adam_states_of_its_adapters_only_and_no_reference():
    config, shape = load_config_and_shape(REPO / "configs" / "tiny_lora_grpo.toml", overrides=("algorithm.kl_coef=0.1",))
    lora = plan_resources(config, shape).trainer_memory.parts
    full = plan_resources(dataclasses.replace(config, lora=None), shape).trainer_memory.parts
    adapters = sum(rows * cols for _, (rows, cols) in adapter_parameters(shape, 16, config.lora.targets))
    assert lora["grads_fp32"] == 4 * adapters and lora["adamw_states"] == 8 * adapters
    assert lora["params_fp32"] == 4 * (shape.num_parameters + adapters)
    assert lora["reference_model"] == 0 and full["reference_model"] == 4 * shape.num_parameters
    assert lora["gathered_roots"] * 2 == full["gathered_roots"]  # no reference root kept gathered


def test_qwen3_8b_with_lora_fits_one_80_gib_gpu_where_full_fine_tuning_does_not():
    config, shape = load_config_and_shape(REPO / "configs" / "qwen3-8b_lora_grpo.toml", cluster="generic")
    lora = plan_resources(config, shape).trainer_memory
    full = plan_resources(dataclasses.replace(config, lora=None), shape).trainer_memory
    assert lora.fits and not full.fits
    assert full.total - lora.total > 85 * GIB  # the base's fp32 gradients and AdamW states
