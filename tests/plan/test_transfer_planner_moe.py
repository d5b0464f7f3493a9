"""The resharding planner on Mixture-of-Experts layouts: FSDP2 shards of per-expert or grouped
expert tensors -> vLLM's FusedMoE w13/w2 at tensor parallel and expert parallel, element-exact
against vLLM's loader rules and byte-minimal, with shapes that do not divide evenly.

The experts come from a toy family registered here (Qwen3's dense decoder with every MLP replaced
by a router and experts, named and laid out as Qwen3-MoE in HF and vLLM), so these tests need
nothing but the planner."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcrl.errors import PlanError
from hpcrl.models import ModelShape, register
from hpcrl.models.dense import DenseDecoder, titan_model
from hpcrl.models.layout import VllmParam
from hpcrl.plan.transfer.check import check_plan, verify_elements
from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout, chunk_source_rows, experts_of_rank
from hpcrl.plan.transfer.planner import plan


class ToyMoe(DenseDecoder):
    """Every layer's MLP is `experts` experts of width `inter` behind a router (Qwen3-MoE's names)."""

    model_type = "toy_moe"
    titan = titan_model("torchtitan.models.qwen3", "Qwen3", "Qwen3StateDictAdapter")

    def __init__(self, experts: int, inter: int) -> None:
        self.experts, self.inter = experts, inter
        self.architecture = f"ToyMoe{experts}x{inter}ForCausalLM"

    def hf_parameters(self, shape: ModelShape) -> Iterator[tuple[str, tuple[int, ...]]]:
        h = shape.hidden_size
        for name, dims in super().hf_parameters(shape):
            if name.endswith("mlp.gate_proj.weight"):
                p = name[: -len("gate_proj.weight")]
                yield p + "gate.weight", (self.experts, h)
                for e in range(self.experts):
                    yield f"{p}experts.{e}.gate_proj.weight", (self.inter, h)
                    yield f"{p}experts.{e}.up_proj.weight", (self.inter, h)
                    yield f"{p}experts.{e}.down_proj.weight", (h, self.inter)
            elif not name.endswith(("mlp.up_proj.weight", "mlp.down_proj.weight")):
                yield name, dims

    def vllm_parameters(self, shape: ModelShape) -> Iterator[VllmParam]:
        for param in super().vllm_parameters(shape):
            if param.name.endswith("mlp.gate_up_proj.weight"):
                p = param.name[: -len("gate_up_proj.weight")]
                yield VllmParam(name=p + "gate.weight", layer="replicated", hf=(p + "gate.weight",))
                yield VllmParam(name=p + "experts.routed_experts.w13_weight", layer="moe_w13",
                                hf=tuple(f"{p}experts.{e}.{x}_proj.weight"
                                         for e in range(self.experts) for x in ("gate", "up")))
                yield VllmParam(name=p + "experts.routed_experts.w2_weight", layer="moe_w2",
                                hf=tuple(f"{p}experts.{e}.down_proj.weight" for e in range(self.experts)))
            elif not param.name.endswith("mlp.down_proj.weight"):
                yield param


_TOYS: dict[tuple[int, int], ToyMoe] = {}


def moe_shape(experts: int, inter: int, **overrides) -> ModelShape:
    if (experts, inter) not in _TOYS:
        _TOYS[experts, inter] = register(ToyMoe(experts, inter))
    base = dict(architecture=_TOYS[experts, inter].architecture, hidden_size=16, intermediate_size=0,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, vocab_size=100, qk_norm=True)
    return ModelShape(**{**base, **overrides})


def make(shape, *, shard=1, replicate=1, replicas=1, tp=1, ep=False, grouped=False, placement="linear",
         bucket=256):
    p = plan(TrainerLayout(dp_replicate=replicate, dp_shard=shard, grouped_experts=grouped),
             InferenceLayout(replicas=replicas, tensor_parallel=tp, expert_parallel=ep, expert_placement=placement),
             shape, bucket_bytes=bucket)
    check_plan(p)
    verify_elements(p, shape)
    return p


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tp=st.integers(1, 4), extra_experts=st.integers(0, 5), inter_per_rank=st.integers(1, 3),
       shard=st.integers(1, 7), replicate=st.integers(1, 2), replicas=st.integers(1, 2), ep=st.booleans(),
       grouped=st.booleans(), round_robin=st.booleans())
def test_any_expert_count_tp_ep_and_fsdp_size_plans_every_element_from_the_right_source_at_one_x(
        tp, extra_experts, inter_per_rank, shard, replicate, replicas, ep, grouped, round_robin):
    # Experts: at least one per EP rank, often not a multiple of the ranks or of the FSDP size;
    # the intermediate divides TP (vLLM asserts it) but rarely the FSDP size.
    shape = moe_shape(tp + extra_experts, tp * inter_per_rank, num_heads=12, num_kv_heads=1,
                      vocab_size=150)  # any TP <= 4 (vocab padded to 192)
    p = make(shape, shard=shard, replicate=replicate, replicas=replicas, tp=tp, ep=ep, grouped=grouped,
             placement="round_robin" if round_robin else "linear")
    stats = p.stats()
    assert stats.ratio() == 1.0
    assert sum(stats.received_per_inference_rank) == replicas * sum(stats.minimum_per_tp_rank)


def test_tensor_parallel_splits_each_experts_intermediate_into_gate_then_up_rows():
    shape = moe_shape(3, 4)
    p = make(shape, shard=2, tp=2)
    w13 = next(d for d in p.dests if d.name == "model.layers.0.mlp.experts.routed_experts.w13_weight")
    w2 = next(d for d in p.dests if d.name == "model.layers.0.mlp.experts.routed_experts.w2_weight")
    assert w13.local_shape == (3 * 2 * 2, 16) and w2.local_shape == (3 * 16, 2)  # [E, 2I/tp, H], [E, H, I/tp]


def test_expert_parallel_gives_ranks_whole_experts_as_vllms_determine_expert_map_does():
    torch = pytest.importorskip("torch")
    determine = pytest.importorskip("vllm.model_executor.layers.fused_moe.expert_map_manager").determine_expert_map
    for experts, ep in ((7, 3), (8, 3), (5, 5), (9, 4)):
        for placement in ("linear", "round_robin"):
            for rank in range(ep):
                count, expert_map, _ = determine(ep, rank, experts, placement)
                want = [int(e) for e in torch.argsort(torch.where(expert_map < 0, experts + 1, expert_map))[:count]]
                assert experts_of_rank(experts, ep, rank, placement) == want, (experts, ep, rank, placement)
    p = make(moe_shape(7, 3, num_heads=12, num_kv_heads=1, vocab_size=150), shard=3, tp=3, ep=True)
    w13 = next(d for d in p.dests if d.name == "model.layers.1.mlp.experts.routed_experts.w13_weight")
    assert w13.real_rows == (3 * 6, 2 * 6, 2 * 6)  # 7 experts on 3 ranks: 3, 2, 2, whole (2I rows each)


def test_grouped_experts_are_fsdp_sharded_in_whole_experts():
    shape = moe_shape(5, 6)
    p = make(shape, shard=4, tp=2, grouped=True)  # 5 experts over 4 ranks: 2, 2, 1, 0
    src = next(s for s in p.sources if s.name == "model.layers.0.mlp.experts.gate_proj.weight")
    assert src.shape == (5 * 6, 16)
    assert [(end - start) * 16 for start, end in chunk_source_rows(5 * 6, 4, src.shard_rows)] == \
        [2 * 6 * 16, 2 * 6 * 16, 6 * 16, 0]
    assert not any(".experts.0." in s.name for s in p.sources)


def test_an_intermediate_size_tensor_parallel_does_not_divide_is_a_plan_error_unless_expert_parallel():
    shape = moe_shape(4, 6)
    with pytest.raises(PlanError, match="moe_intermediate_size"):
        plan(TrainerLayout(), InferenceLayout(tensor_parallel=4, expert_parallel=False), dataclasses.replace(
            shape, num_heads=4, num_kv_heads=4))
    make(dataclasses.replace(shape, num_kv_heads=4), tp=4, ep=True)  # whole experts: no split of 6


def test_expert_parallel_over_more_ranks_than_experts_is_a_plan_error():
    with pytest.raises(PlanError, match="2 experts for 4 ranks"):
        plan(TrainerLayout(), InferenceLayout(tensor_parallel=4, expert_parallel=True), moe_shape(2, 4))


def test_verification_catches_a_plan_that_swaps_an_experts_gate_and_up_rows():
    shape = moe_shape(3, 2)
    p = make(shape, shard=1, tp=1, bucket=1 << 20)
    b = p.blocks
    w13 = next(i for i, d in enumerate(p.dests) if d.name == "model.layers.0.mlp.experts.routed_experts.w13_weight")
    gate = next(i for i, s in enumerate(p.sources) if s.name == "model.layers.0.mlp.experts.1.gate_proj.weight")
    up = next(i for i, s in enumerate(p.sources) if s.name == "model.layers.0.mlp.experts.1.up_proj.weight")
    source = b["source"].copy()
    rows = (b["dest"] == w13) & np.isin(source, [gate, up])
    assert rows.sum() == 2
    source[rows] = np.where(source[rows] == gate, up, gate)  # same shapes: in bounds, tiles exactly
    swapped = dataclasses.replace(p, blocks={**b, "source": source})
    check_plan(swapped)
    with pytest.raises(PlanError, match="expected id"):
        verify_elements(swapped, shape)


def test_the_digest_changes_with_the_expert_layout_of_either_side():
    shape = moe_shape(4, 4)
    digests = {make(shape, shard=2, tp=2, ep=ep, grouped=grouped, placement=placement).digest
               for ep, placement in ((False, "linear"), (True, "linear"), (True, "round_robin"))
               for grouped in (False, True)}
    assert len(digests) == 6
