"""LoRA adapters as tensors: which linear layers of a model can take one, and the adapters' names and shapes.

Pure (names and sizes only), read by the config checks, the trainer (which adds the adapters to
torchtitan's linears), the transfer planner (which moves only these tensors) and the export (which
writes them as a PEFT directory). A target is a Hugging Face module's leaf name ("q_proj"); for each
2-D weight `model.layers.{i}.<...>.<target>.weight` [out, in] the adapter is two tensors named as PEFT
names them inside its model, without PEFT's `base_model.model.` prefix and adapter name:

    model.layers.{i}.<...>.<target>.lora_A.weight   [rank, in]
    model.layers.{i}.<...>.<target>.lora_B.weight   [out, rank]

in the order of the model's own parameters (checkpoint order), A before B. The output layer, `lm_head`
(PEFT takes it as a target like any linear; vLLM serves it through LogitsProcessorWithLoRA), is a target of
its own when the model has an untied one: `lm_head.lora_A.weight` [rank, hidden], `lm_head.lora_B.weight`
[vocab, rank]. It lifts what frozen output rows cap (a random or ill-fitting head).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpcrl.models.shape import ModelShape

#: Every linear layer of a Llama-style decoder block (PEFT's "all-linear", which leaves out the lm_head): the
#: default of lora.targets.
BLOCK_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The output layer's target: the weight `lm_head.weight`, outside the blocks (opt-in, as in PEFT).
HEAD_TARGET = "lm_head"
#: What a dense family takes: the blocks' linears and the (untied) lm_head.
LORA_TARGETS = (*BLOCK_TARGETS, HEAD_TARGET)
#: PEFT's prefix of a model's own names inside a PeftModel and in adapter_model.safetensors.
PEFT_PREFIX = "base_model.model."


def _target_of(name: str, dims: tuple[int, ...], targets: Sequence[str]) -> str | None:
    """The target a parameter is the weight of, or None (not a 2-D weight of a layer, or not a target)."""
    if name == f"{HEAD_TARGET}.weight":  # an untied output layer (a tied one is embed_tokens: no such weight)
        return HEAD_TARGET if HEAD_TARGET in targets and len(dims) == 2 else None
    parts = name.split(".")
    if len(dims) != 2 or len(parts) < 5 or parts[:2] != ["model", "layers"] or parts[-1] != "weight":
        return None
    # A MoE's routed experts take no adapter (vLLM's fused-MoE LoRA layers are not planned for); its dense
    # layers' MLP and every attention projection do.
    return parts[-2] if parts[-2] in targets and "experts" not in parts else None


def adapter_parameters(shape: ModelShape, rank: int, targets: Sequence[str]) -> Iterator[tuple[str, tuple[int, int]]]:
    """(name, shape) of every adapter tensor of `shape` with LoRA of `rank` on `targets` (module docstring)."""
    for name, dims in shape.hf_parameters():
        if _target_of(name, dims, targets) is not None:
            module = name[: -len(".weight")]
            out, inp = dims
            yield f"{module}.lora_A.weight", (rank, inp)
            yield f"{module}.lora_B.weight", (out, rank)


def adapted_weights(shape: ModelShape, targets: Sequence[str]) -> list[str]:
    """The HF names of the weights that get an adapter, in checkpoint order."""
    return [name for name, dims in shape.hf_parameters() if _target_of(name, dims, targets) is not None]


def present_targets(shape: ModelShape) -> list[str]:
    """The family's LoRA targets this shape has weights of (a model without MLP projections lacks those)."""
    supported = shape.family.lora_targets
    found = {t for name, dims in shape.hf_parameters() if (t := _target_of(name, dims, supported))}
    return [t for t in supported if t in found]
