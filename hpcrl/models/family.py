"""`Family`: what hpcrl knows about one Hugging Face architecture, asked by the rest of hpcrl.

Every module that once asked `if architecture == ...` asks the shape's family instead:

  config       `shape_from_hf_config` (config.json -> ModelShape), `to_hf_config` (the reverse)
  plan         `hf_parameters` (names and shapes), `layer_parameters` and
               `activation_values_per_token` (memory estimate terms), `vllm_parameters` (vLLM's
               tensor-parallel layout)
  trainer      `titan`: the torchtitan model, block and state-dict adapter classes, by dotted
               path, and the HF -> torchtitan name templates its adapter lacks (hpcrl.trainer.titan
               imports them: it stays the only module that imports torchtitan)

hpcrl/models/dense.py implements all of it for Llama-style dense decoders; a family folder
(hpcrl/models/llama/, qwen2/, qwen3/) says only how it differs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from hpcrl.models.layout import VllmParam
from hpcrl.models.shape import ModelShape


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
