"""`ModelShape`: the sizes of a model, without any weights.

Everything the planners need to know about a model (parameter names and shapes, parameter
count, KV-cache bytes per token) comes from a `ModelShape`. What depends on the architecture
(which parameters exist, how config.json spells the sizes) its family says (`shape.family`,
hpcrl.models); the shape only holds the numbers.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpcrl.models import Family


@dataclass(frozen=True, kw_only=True)
class ModelShape:
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
    # Mixture-of-Experts (Qwen3-MoE, hpcrl/models/qwen3_moe/); the defaults are a dense model.
    num_experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Each expert's SwiGLU width; dense layers of a MoE model keep `intermediate_size`."""
    decoder_sparse_step: int = 1
    """Layer i is a MoE layer when (i + 1) % decoder_sparse_step == 0 (and not in mlp_only_layers)."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers that keep a dense MLP whatever decoder_sparse_step says."""
    norm_topk_prob: bool = False
    """Renormalise the top-k routing weights to sum to 1."""

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` routes to experts (the rule of transformers' and vLLM's Qwen3-MoE)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

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

    def kv_bytes_per_token(self, dtype_bytes: int, tensor_parallel: int = 1) -> int:
        """KV-cache bytes one token takes on one tensor-parallel rank (KV heads replicate past TP)."""
        kv_heads_per_rank = max(1, self.num_kv_heads // tensor_parallel)
        return 2 * self.num_layers * kv_heads_per_rank * self.head_dim * dtype_bytes

    def to_hf_config(self) -> dict:
        """A Hugging Face config.json dict for this shape (used by tools/make_tiny_model.py)."""
        return self.family.to_hf_config(self)


def numel(shape: tuple[int, ...]) -> int:
    """Elements of a tensor of `shape`."""
    count = 1
    for dim in shape:
        count *= dim
    return count
