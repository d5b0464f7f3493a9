"""The toy family: a `DenseDecoder` that reads and writes its own config.json keys."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpcrl.models import ModelShape
from hpcrl.models.dense import DenseDecoder, titan_model


class Toy(DenseDecoder):
    architecture = "ToyForCausalLM"
    model_type = "toy"
    titan = titan_model("torchtitan.models.qwen3", "Qwen3", "Qwen3StateDictAdapter")

    def shape_from_hf_config(self, config: Mapping[str, Any]) -> ModelShape:
        hidden, heads = int(config["n_embd"]), int(config["n_head"])
        return ModelShape(architecture=self.architecture, hidden_size=hidden,
                          intermediate_size=int(config["n_inner"]), num_layers=int(config["n_layer"]),
                          num_heads=heads, num_kv_heads=int(config.get("n_kv_head") or heads),
                          head_dim=hidden // heads, vocab_size=int(config["vocab_size"]),
                          tie_embeddings=True, qk_norm=True, max_position=int(config["n_positions"]),
                          rope_theta=float(config.get("rope_theta", 10000.0)), rms_norm_eps=1e-6)

    def to_hf_config(self, shape: ModelShape) -> dict:
        return {"architectures": [self.architecture], "model_type": self.model_type,
                "n_embd": shape.hidden_size, "n_inner": shape.intermediate_size, "n_layer": shape.num_layers,
                "n_head": shape.num_heads, "n_kv_head": shape.num_kv_heads, "vocab_size": shape.vocab_size,
                "n_positions": shape.max_position, "rope_theta": shape.rope_theta}


TOY = Toy()
