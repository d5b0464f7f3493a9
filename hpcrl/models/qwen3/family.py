"""The Qwen3 family: dense decoder with per-head q/k RMSNorm, torchtitan's qwen3 model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpcrl.models.dense import DenseDecoder, titan_model


class Qwen3(DenseDecoder):
    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    titan = titan_model("torchtitan.models.qwen3", "Qwen3", "Qwen3StateDictAdapter")

    def reads_qk_norm(self, config: Mapping[str, Any]) -> bool:
        return True  # transformers' Qwen3Attention always has q_norm and k_norm


FAMILY = Qwen3()
