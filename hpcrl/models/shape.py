"""`ModelShape`: the sizes of a model, without any weights.

Everything the planners need to know about a model (parameter names and shapes, parameter
count, KV-cache bytes per token) comes from a `ModelShape` and its family. What depends on the
architecture (which parameters exist, how config.json spells the sizes, what a block is made of)
its family says (`shape.family`, hpcrl.models); the shape only holds the numbers, and a family
whose model has sizes the others lack has a shape type of its own (a subclass, in its folder).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpcrl.models import Family


@dataclass(frozen=True, kw_only=True)
class Experts:
    """What a Mixture-of-Experts model's routed experts look like from outside its family."""

    layers: tuple[int, ...]
    """The blocks that route to experts (the others keep a dense MLP)."""
    num_experts: int
    """Routed experts per MoE block."""
    top_k: int
    """Experts each token is routed to."""
    parameters: int
    """Parameters of the routed experts of every MoE block together."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes every family's decoder has: embeddings, blocks of attention and MLP, the head.

    A family with sizes of its own (experts, latent attention ...) subclasses it in its folder
    (hpcrl/models/qwen3_moe/shape.py); `Family.blocks` says what each block is made of."""

    architecture: str
    """Hugging Face architecture name (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM): names the family."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2; Llama with attention_bias)."""
    qk_norm: bool = False
    """q and k normalised per head (q_norm, k_norm of size head_dim; Qwen3)."""
    max_position: int = 8192
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5

    def experts(self) -> Experts | None:
        """The routed experts, for a Mixture-of-Experts model (its family's shape type says); None
        for a dense one. What hpcrl outside hpcrl/models/ may know of a MoE."""
        return None

    @property
    def family(self) -> Family:
        """The model family of `architecture` (ConfigError naming the known ones if there is none)."""
        # The registry is the package itself: it imports the families, which import this module.
        from hpcrl.models import family_for

        return family_for(self.architecture)

    def hf_parameters(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(Hugging Face parameter name, shape) for every parameter, in checkpoint order."""
        return self.family.hf_parameters(self)

    @property
    def num_parameters(self) -> int:
        return sum(numel(shape) for _, shape in self.hf_parameters())

    @property
    def layer_parameters(self) -> int:
        """Parameters of one transformer block (what FSDP gathers at a time)."""
        return self.family.layer_parameters(self)

    @property
    def root_parameters(self) -> int:
        """Parameters outside the transformer blocks (embedding, final norm, output head): FSDP's root unit."""
        return sum(numel(shape) for name, shape in self.hf_parameters() if not name.startswith("model.layers."))

    def to_hf_config(self) -> dict:
        """A Hugging Face config.json dict for this shape (used by tools/make_tiny_model.py)."""
        return self.family.to_hf_config(self)


def numel(shape: tuple[int, ...]) -> int:
    """Elements of a tensor of `shape`."""
    count = 1
    for dim in shape:
        count *= dim
    return count


def routed_experts(shape: ModelShape, *, num_experts: int, top_k: int, intermediate_size: int,
                   is_moe_layer: Callable[[int], bool]) -> Experts | None:
    """The routed experts of a MoE family's shape: `num_experts` SwiGLU MLPs (gate, up, down) of
    `intermediate_size` in every block `is_moe_layer` picks; None when no block routes."""
    layers = tuple(i for i in range(shape.num_layers) if is_moe_layer(i))
    if not layers:
        return None
    per_block = num_experts * 3 * intermediate_size * shape.hidden_size  # gate, up, down
    return Experts(layers=layers, num_experts=num_experts, top_k=top_k, parameters=per_block * len(layers))


def largest_block_parameters(shape: ModelShape) -> int:
    """Parameters of `shape`'s largest transformer block (model.layers.N.*): what FSDP gathers at a time
    when blocks differ (dense and MoE blocks)."""
    sizes = [0] * shape.num_layers
    for name, size in shape.hf_parameters():
        if name.startswith("model.layers."):
            sizes[int(name.split(".", 3)[2])] += numel(size)
    return max(sizes, default=0)
