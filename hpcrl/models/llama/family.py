"""The Llama family: dense decoder, torchtitan's llama3 model."""

from __future__ import annotations

from hpcrl.models.dense import DenseDecoder, titan_model
from hpcrl.models.shape import ModelShape


class Llama(DenseDecoder):
    architecture = "LlamaForCausalLM"
    model_type = "llama"
    titan = titan_model("torchtitan.models.llama3", "Llama3", "Llama3StateDictAdapter")

    def writes_hf_config(self, shape: ModelShape, config: dict) -> None:
        config["attention_bias"] = shape.qkv_bias


FAMILY = Llama()
