"""The Qwen2 family: dense decoder with q/k/v biases.

torchtitan 0.3.0 has no Qwen2 model: the trainer builds it from Qwen3's blocks, with q/k/v
biases and no q/k norm (hpcrl.trainer.titan reads both from the shape).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpcrl.models.dense import DenseDecoder, titan_model


class Qwen2(DenseDecoder):
    architecture = "Qwen2ForCausalLM"
    model_type = "qwen2"
    titan = titan_model("torchtitan.models.qwen3", "Qwen3", "Qwen3StateDictAdapter")

    def reads_qkv_bias(self, config: Mapping[str, Any]) -> bool:
        return True  # transformers' Qwen2Attention always has them; config.json does not say


FAMILY = Qwen2()
