"""The LoRA transfer plan: only the adapters move, element-exact into vLLM's LoRA slot tensors as its LoRA layers
slice them (hpcrl/plan/transfer/lora.py; re-derived in check.lora_expected), and `hpcrl plan --transfer` shows them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from hpcrl.cli.transfer_view import render_transfer, transfer_summary
from hpcrl.config import load_config
from hpcrl.config.model_shapes import PRESETS
from hpcrl.errors import PlanError
from hpcrl.models.lora import LORA_TARGETS, adapter_parameters
from hpcrl.plan.for_config import plan_for_config
from hpcrl.plan.transfer.check import check_plan, verify_elements
from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
from hpcrl.plan.transfer.planner import plan

REPO = Path(__file__).resolve().parents[2]
LLAMA = PRESETS["tiny-llama"]  # 4 heads, 2 KV heads: at TP 4 each KV head is on two ranks


def lora_plan(*, shard=1, tp=1, rank=4, targets=LORA_TARGETS, shape=LLAMA):
    return plan(TrainerLayout(dp_shard=shard), InferenceLayout(tensor_parallel=tp, lora_rank=rank,
                                                               lora_targets=tuple(targets)),
                shape, bucket_bytes=1 << 12)


@pytest.mark.parametrize("targets", [LORA_TARGETS, ("k_proj", "up_proj", "o_proj")], ids=["all", "some"])
@pytest.mark.parametrize("shard", [1, 2, 3])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_lora_plan_fills_every_slot_tensor_exactly_as_vllm_lora_layers_slice_the_adapters(targets, shard, tp):
    p = lora_plan(shard=shard, tp=tp, targets=targets)
    check_plan(p)
    verify_elements(p, LLAMA)
    assert [s.name for s in p.sources] == [n for n, _ in adapter_parameters(LLAMA, 4, targets)]
    # Column-parallel B and row-parallel A are split; A of a column-parallel layer, B of a row-parallel one and
    # both of the lm_head (added to the gathered logits) are whole on every rank: each rank receives that much.
    whole = split = 0
    for name, (rows, cols) in adapter_parameters(LLAMA, 4, targets):
        row_parallel = ".o_proj." in name or ".down_proj." in name
        if name.endswith("lora_A.weight") != row_parallel or name.startswith("lm_head."):  # the head's: both whole
            whole += rows * cols
        elif ".k_proj." in name or ".v_proj." in name:
            split += rows * cols // min(tp, LLAMA.num_kv_heads)
        else:
            split += rows * cols // tp
    assert p.stats().received_per_inference_rank == [(whole + split) * p.itemsize] * tp


def test_element_verification_catches_a_lora_plan_that_writes_the_wrong_elements():
    p = lora_plan(shard=2, tp=2)
    b = p.blocks
    i = int(np.nonzero(b["src_offset"] > 0)[0][0])
    swapped = dataclasses.replace(p, blocks={**b, "src_offset": b["src_offset"] - (np.arange(len(b["src_offset"])) == i)})
    with pytest.raises(PlanError, match="expected id"):
        verify_elements(swapped, LLAMA)


def test_a_lora_layout_needs_both_a_rank_and_targets():
    with pytest.raises(PlanError, match="give both"):
        InferenceLayout(lora_rank=8)


def test_a_lora_config_plans_only_the_adapters_and_the_cli_shows_them(tmp_path):
    base = (tmp_path / "lora.toml")
    base.write_text((REPO / "configs" / "tiny_grpo.toml").read_text() + "\n[lora]\nrank = 8\nalpha = 16.0\n"
                    'targets = ["v_proj", "q_proj", "down_proj"]\n')
    config = load_config(base)
    p = plan_for_config(config)
    assert p.inference.lora_targets == ("q_proj", "v_proj", "down_proj")  # the family's order: one digest
    assert {s.name.rsplit(".", 3)[1] for s in p.sources} == {"q_proj", "v_proj", "down_proj"}
    summary = transfer_summary(config, LLAMA, link_gbps=400)
    adapter_bytes = sum(r * c for _, (r, c) in adapter_parameters(LLAMA, 8, ["q_proj", "v_proj", "down_proj"])) * 4
    assert summary["trainer"]["sent_bytes"] == [adapter_bytes]
    assert summary["lora"]["full_weights_minimum_bytes_per_tp_rank"] > 10 * adapter_bytes
    text = render_transfer(summary)
    assert text.splitlines()[0].endswith("LoRA rank 8 adapters of q_proj, v_proj, down_proj")
    assert summary["digest"][:16] in text and "LoRA: only the 12 adapter tensors move" in text
