"""The Llama family: dense decoder, torchtitan's llama3 model, and the planner's torchtitan naming."""

from __future__ import annotations

from hpcrl.models.dense import DenseDecoder, titan_model
from hpcrl.models.layout import Piece, SourceTensor
from hpcrl.models.llama.titan_layout import llama3_titan_layout
from hpcrl.models.shape import ModelShape


class Llama(DenseDecoder):
    architecture = "LlamaForCausalLM"
    model_type = "llama"
    titan = titan_model("torchtitan.models.llama3", "Llama3", "Llama3StateDictAdapter")

    def writes_hf_config(self, shape: ModelShape, config: dict) -> None:
        config["attention_bias"] = shape.qkv_bias

    def torchtitan_layout(self, shape: ModelShape, *, fuse_qkv: bool
                          ) -> tuple[list[SourceTensor], dict[str, list[Piece]]]:
        return llama3_titan_layout(shape, fuse_qkv=fuse_qkv)


FAMILY = Llama()
