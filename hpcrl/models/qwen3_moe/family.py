"""The Qwen3-MoE family: Qwen3's dense decoder with a router and routed experts in MoE layers.

Its sizes are a `Qwen3MoeShape` (shape.py). A block i is a MoE layer when `shape.is_moe_layer(i)` (num_experts > 0, i not in mlp_only_layers,
(i + 1) % decoder_sparse_step == 0: transformers' and vLLM's rule); its MLP is then a router
`mlp.gate` (E, H), a linear whose softmax picks the top-k experts (renormalised when
norm_topk_prob), and E SwiGLU experts `mlp.experts.{e}.{gate,up,down}_proj` of width
moe_intermediate_size. Other blocks keep Qwen3's dense MLP. Qwen3-MoE has no shared expert.

Names (for the weight transfer; /work/agents/moe_interface.md says the same):
  HF checkpoint  model.layers.{i}.mlp.gate.weight (E, H); model.layers.{i}.mlp.experts.{e}.
                 gate_proj / up_proj (I, H), down_proj (H, I), expert by expert
  vLLM 0.32      mlp.gate.weight replicated (GateLinear); FusedMoE's routed experts (a submodule
                 `routed_experts` of mlp.experts) mlp.experts.routed_experts.w13_weight
                 (E, 2I/tp, H), expert e = [gate rows of this rank; up rows of this rank], and
                 mlp.experts.routed_experts.w2_weight (E, H, I/tp), each expert's columns split (layer kinds
                 "moe_w13" and "moe_w2"); under expert parallelism a rank holds whole experts
  torchtitan     layers.{i}.moe.router.gate.weight, and GroupedExperts' 3-D stacks
                 layers.{i}.moe.routed_experts.inner_experts.w1_EFD (E, I, H) = gate_proj of every
                 expert, w3_EFD (E, I, H) = up_proj, w2_EDF (E, H, I) = down_proj
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from hpcrl.models.blocks import Block, RoutedExperts, SoftmaxTopK
from hpcrl.models.dense import DenseDecoder, titan_model
from hpcrl.models.fused_experts import FUSED_EXPERTS
from hpcrl.models.layout import VllmParam
from hpcrl.models.qwen3_moe.shape import Qwen3MoeShape
from hpcrl.models.shape import ModelShape, largest_block_parameters

#: The dense MLP entries a MoE layer replaces (HF and vLLM names), by suffix.
_DENSE_MLP = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj|gate_up_proj)\.weight$")

#: HF expert name template (layer, expert) -> torchtitan's 3-D stack template (layer): expert e is
#: index e of dim 0 (read by hpcrl.trainer.titan, which stacks and splits them).
EXPERT_STACKS = {
    "model.layers.{}.mlp.experts.{}.gate_proj.weight": "layers.{}.moe.routed_experts.inner_experts.w1_EFD",
    "model.layers.{}.mlp.experts.{}.up_proj.weight": "layers.{}.moe.routed_experts.inner_experts.w3_EFD",
    "model.layers.{}.mlp.experts.{}.down_proj.weight": "layers.{}.moe.routed_experts.inner_experts.w2_EDF",
}


class Qwen3Moe(DenseDecoder):
    architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"
    titan = replace(titan_model("torchtitan.models.qwen3", "Qwen3", "Qwen3StateDictAdapter"),
                    expert_stacks=EXPERT_STACKS)
    vllm_load_hooks = (FUSED_EXPERTS,)

    def reads_qk_norm(self, config: Mapping[str, Any]) -> bool:
        return True  # transformers' Qwen3MoeAttention always has q_norm and k_norm

    def shape_from_hf_config(self, config: Mapping[str, Any]) -> Qwen3MoeShape:
        dense = super().shape_from_hf_config(config)
        # transformers' Qwen3MoeConfig defaults, for the keys a config.json may omit. Qwen's published
        # config.json says "num_experts"; transformers 5 saves it as "num_local_experts" (its attribute_map).
        experts = config.get("num_experts", config.get("num_local_experts", 128))
        return Qwen3MoeShape(
            **vars(dense), num_experts=int(experts),
            num_experts_per_tok=int(config.get("num_experts_per_tok", 8)),
            moe_intermediate_size=int(config.get("moe_intermediate_size", 768)),
            decoder_sparse_step=int(config.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in config.get("mlp_only_layers") or ()),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)))

    def blocks(self, shape: ModelShape) -> list[Block]:
        moe = _moe(shape)
        experts = RoutedExperts(num_experts=moe.num_experts, top_k=moe.num_experts_per_tok,
                                hidden_dim=moe.moe_intermediate_size,
                                router=SoftmaxTopK(renormalize=moe.norm_topk_prob))
        return [replace(block, mlp=experts) if moe.is_moe_layer(i) else block
                for i, block in enumerate(super().blocks(shape))]

    def writes_hf_config(self, shape: ModelShape, config: dict) -> None:
        shape = _moe(shape)
        config.update(num_experts=shape.num_experts, num_experts_per_tok=shape.num_experts_per_tok,
                      moe_intermediate_size=shape.moe_intermediate_size,
                      decoder_sparse_step=shape.decoder_sparse_step,
                      mlp_only_layers=list(shape.mlp_only_layers), norm_topk_prob=shape.norm_topk_prob,
                      attention_bias=shape.qkv_bias)

    def hf_parameters(self, shape: ModelShape) -> Iterator[tuple[str, tuple[int, ...]]]:
        shape = _moe(shape)
        h, f = shape.hidden_size, shape.moe_intermediate_size
        for name, size in super().hf_parameters(shape):
            dense = _DENSE_MLP.match(name)
            if dense is None or not shape.is_moe_layer(int(dense.group(1))):
                yield name, size
            elif dense.group(2) == "gate_proj":  # the router and the experts in place of the dense MLP
                p = f"model.layers.{dense.group(1)}.mlp."
                yield p + "gate.weight", (shape.num_experts, h)
                for e in range(shape.num_experts):
                    yield f"{p}experts.{e}.gate_proj.weight", (f, h)
                    yield f"{p}experts.{e}.up_proj.weight", (f, h)
                    yield f"{p}experts.{e}.down_proj.weight", (h, f)

    def layer_parameters(self, shape: ModelShape) -> int:
        return largest_block_parameters(shape)  # dense and MoE blocks differ: the largest bounds the memory

    def activation_values_per_token(self, shape: ModelShape) -> int:
        # Dense's 7h + 2kv attention and norm terms; the MLP's 4f becomes, per routed copy of the
        # token (top-k), its dispatched input and weighted output (2h) and the expert's gate, up,
        # activation and product (4 moe_f); plus the router's E logits and probabilities.
        shape = _moe(shape)
        h, k = shape.hidden_size, shape.num_experts_per_tok
        attention = 7 * h + 2 * shape.num_kv_heads * shape.head_dim
        if not any(shape.is_moe_layer(i) for i in range(shape.num_layers)):
            return attention + 4 * shape.intermediate_size
        moe = k * (2 * h + 4 * shape.moe_intermediate_size) + 2 * shape.num_experts
        return attention + max(moe, 4 * shape.intermediate_size if shape.mlp_only_layers else 0)

    def vllm_parameters(self, shape: ModelShape) -> Iterator[VllmParam]:
        shape = _moe(shape)
        for param in super().vllm_parameters(shape):
            dense = _DENSE_MLP.match(param.name)
            if dense is None or not shape.is_moe_layer(int(dense.group(1))):
                yield param
            elif dense.group(2) == "gate_up_proj":
                p = f"model.layers.{dense.group(1)}.mlp."
                experts = range(shape.num_experts)
                yield VllmParam(name=p + "gate.weight", layer="replicated", hf=(p + "gate.weight",))
                yield VllmParam(name=p + "experts.routed_experts.w13_weight", layer="moe_w13",
                                hf=tuple(f"{p}experts.{e}.{x}_proj.weight" for e in experts for x in ("gate", "up")))
                yield VllmParam(name=p + "experts.routed_experts.w2_weight", layer="moe_w2",
                                hf=tuple(f"{p}experts.{e}.down_proj.weight" for e in experts))


def _moe(shape: ModelShape) -> Qwen3MoeShape:
    """`shape` as this family's own shape type (a plain ModelShape: a Qwen3-MoE without experts)."""
    return shape if isinstance(shape, Qwen3MoeShape) else Qwen3MoeShape(**vars(shape))


FAMILY = Qwen3Moe()
