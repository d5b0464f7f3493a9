"""Llama-style dense decoders: the one implementation of `Family` that llama/, qwen2/ and qwen3/ share.

A dense decoder is: token embedding; per layer RMSNorm, grouped-query attention (q/k/v/o
projections, optional q/k/v biases, optional per-head q/k RMSNorm), RMSNorm, SwiGLU MLP
(gate/up/down); final RMSNorm; output head, or the embedding tied to it. Hugging Face names
(transformers' modeling_llama / modeling_qwen2 / modeling_qwen3) and vLLM's (model_executor/models/
llama.py, qwen2.py, qwen3.py: qkv_proj and gate_up_proj stacked) are the same for all three.

A subclass sets `architecture`, `model_type` and `titan`, and overrides the few hooks where its
config.json differs (`reads_qkv_bias`, `reads_qk_norm`, `writes_hf_config`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from hpcrl.models.blocks import Block, DenseMLP, GroupedQueryAttention
from hpcrl.models.family import Family, TitanModel
from hpcrl.models.layout import VllmLayer, VllmParam
from hpcrl.models.lora import LORA_TARGETS
from hpcrl.models.shape import ModelShape, numel

#: q/k/v biases (Qwen2; Llama with attention_bias) sit beside the weights; torchtitan's adapters omit them.
BIAS_NAMES = {f"model.layers.{{}}.self_attn.{proj}.bias": f"layers.{{}}.attention.qkv_linear.{short}.bias"
              for proj, short in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"))}


def titan_model(package: str, prefix: str, adapter: str) -> TitanModel:
    """torchtitan's `{package}.model.{prefix}Model` / `{prefix}TransformerBlock` and its state-dict adapter."""
    return TitanModel(model=f"{package}.model.{prefix}Model", block=f"{package}.model.{prefix}TransformerBlock",
                      state_dict_adapter=f"{package}.state_dict_adapter.{adapter}", extra_names=BIAS_NAMES)


class DenseDecoder(Family):
    """A Llama-style dense decoder (see the module docstring)."""

    lora_targets = LORA_TARGETS

    def reads_qkv_bias(self, config: Mapping[str, Any]) -> bool:
        """Whether a config.json of this family has q/k/v biases."""
        return bool(config.get("attention_bias", False))

    def reads_qk_norm(self, config: Mapping[str, Any]) -> bool:
        """Whether a config.json of this family normalises q and k per head."""
        return False

    def writes_hf_config(self, shape: ModelShape, config: dict) -> None:
        """Add this family's own keys to the config.json dict `to_hf_config` made."""

    def shape_from_hf_config(self, config: Mapping[str, Any]) -> ModelShape:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return ModelShape(
            architecture=self.architecture, hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=self.reads_qkv_bias(config), qk_norm=self.reads_qk_norm(config),
            max_position=int(config.get("max_position_embeddings", 8192)),
            # transformers >= 5 writes rope_parameters.rope_theta; older configs rope_theta.
            rope_theta=float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get(
                "rope_theta", 10000.0)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        )

    def to_hf_config(self, shape: ModelShape) -> dict:
        config = {
            "architectures": [shape.architecture], "model_type": self.model_type,
            "hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
            "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_heads,
            "num_key_value_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
            "vocab_size": shape.vocab_size, "tie_word_embeddings": shape.tie_embeddings,
            "max_position_embeddings": shape.max_position, "rope_theta": shape.rope_theta,
            "rms_norm_eps": shape.rms_norm_eps, "hidden_act": "silu",
        }
        self.writes_hf_config(shape, config)
        return config

    def hf_parameters(self, shape: ModelShape) -> Iterator[tuple[str, tuple[int, ...]]]:
        h, d, f = shape.hidden_size, shape.head_dim, shape.intermediate_size
        q, kv = shape.num_heads * d, shape.num_kv_heads * d
        yield "model.embed_tokens.weight", (shape.vocab_size, h)
        for i in range(shape.num_layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", (h,)
            yield p + "self_attn.q_proj.weight", (q, h)
            yield p + "self_attn.k_proj.weight", (kv, h)
            yield p + "self_attn.v_proj.weight", (kv, h)
            if shape.qkv_bias:
                yield p + "self_attn.q_proj.bias", (q,)
                yield p + "self_attn.k_proj.bias", (kv,)
                yield p + "self_attn.v_proj.bias", (kv,)
            if shape.qk_norm:
                yield p + "self_attn.q_norm.weight", (d,)
                yield p + "self_attn.k_norm.weight", (d,)
            yield p + "self_attn.o_proj.weight", (h, q)
            yield p + "post_attention_layernorm.weight", (h,)
            yield p + "mlp.gate_proj.weight", (f, h)
            yield p + "mlp.up_proj.weight", (f, h)
            yield p + "mlp.down_proj.weight", (h, f)
        yield "model.norm.weight", (h,)
        if not shape.tie_embeddings:
            yield "lm_head.weight", (shape.vocab_size, h)

    def blocks(self, shape: ModelShape) -> list[Block]:
        attention = GroupedQueryAttention(num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                                          head_dim=shape.head_dim, qkv_bias=shape.qkv_bias, qk_norm=shape.qk_norm)
        return [Block(attention=attention, mlp=DenseMLP(hidden_dim=shape.intermediate_size))] * shape.num_layers

    def layer_parameters(self, shape: ModelShape) -> int:
        prefix = "model.layers.0."
        return sum(numel(s) for n, s in self.hf_parameters(shape) if n.startswith(prefix))

    def activation_values_per_token(self, shape: ModelShape) -> int:
        # ~ (7h + 2kv + 4f): the estimate of hpcrl/plan/resources.py's docstring.
        return 7 * shape.hidden_size + 2 * shape.num_kv_heads * shape.head_dim + 4 * shape.intermediate_size

    def vllm_parameters(self, shape: ModelShape) -> Iterator[VllmParam]:
        def same(name: str, layer: VllmLayer) -> VllmParam:
            return VllmParam(name=name, layer=layer, hf=(name,))

        yield same("model.embed_tokens.weight", "vocab")
        for i in range(shape.num_layers):
            p = f"model.layers.{i}."
            yield same(p + "input_layernorm.weight", "replicated")
            for suffix in ("weight", "bias") if shape.qkv_bias else ("weight",):
                yield VllmParam(name=f"{p}self_attn.qkv_proj.{suffix}", layer="qkv",
                                hf=tuple(f"{p}self_attn.{x}_proj.{suffix}" for x in "qkv"))
            if shape.qk_norm:
                yield same(p + "self_attn.q_norm.weight", "replicated")
                yield same(p + "self_attn.k_norm.weight", "replicated")
            yield same(p + "self_attn.o_proj.weight", "row")
            yield same(p + "post_attention_layernorm.weight", "replicated")
            yield VllmParam(name=p + "mlp.gate_up_proj.weight", layer="merged_column",
                            hf=(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"))
            yield same(p + "mlp.down_proj.weight", "row")
        yield same("model.norm.weight", "replicated")
        if not shape.tie_embeddings:
            yield same("lm_head.weight", "vocab")
