"""The generic layer kinds a family builds its transformer blocks from (pure data, no torch).

A family says what each block is (`Family.blocks`): an attention kind and an MLP kind, the MoE
kind with its router kind. The adapters turn each kind into their vendor's layer:
hpcrl.trainer.titan into torchtitan's configs, and the KV-cache estimate (hpcrl.plan.resources,
through `Family.kv_bytes_per_token`) asks the attention kind what one token keeps.

A new kind (e.g. multi-head latent attention, a sigmoid router with grouped, biased top-k) is a
dataclass here and one builder in hpcrl/trainer/titan.py; a family that uses only known kinds
touches neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpcrl.models.shape import ModelShape


@dataclass(frozen=True, kw_only=True)
class GroupedQueryAttention:
    """Attention whose `num_kv_heads` K/V heads each serve num_heads / num_kv_heads query heads."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    """Biases on the q/k/v projections."""
    qk_norm: bool = False
    """q and k RMS-normalised per head."""

    def kv_values_per_token(self, tensor_parallel: int = 1) -> int:
        """Cached values one token keeps on one tensor-parallel rank (K and V; KV heads replicate past TP)."""
        return 2 * max(1, self.num_kv_heads // tensor_parallel) * self.head_dim


@dataclass(frozen=True, kw_only=True)
class LatentAttention:
    """Multi-head latent attention (MLA, DeepSeek-V2/V3): keys and values are up-projected per head
    from a `kv_lora_rank` latent that the KV cache holds, with one RoPE key of `qk_rope_head_dim`
    shared by every head; the query comes through a rank-`q_lora_rank` projection (0: full rank)."""

    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def kv_values_per_token(self, tensor_parallel: int = 1) -> int:
        """Cached values one token keeps on one tensor-parallel rank: the latent and the RoPE key,
        whole on every rank (vLLM's MLA cache is not split by heads)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, kw_only=True)
class DenseMLP:
    """A SwiGLU MLP of width `hidden_dim` (gate, up, down)."""

    hidden_dim: int


@dataclass(frozen=True, kw_only=True)
class SoftmaxTopK:
    """A linear router whose softmax over all experts picks the top k (Qwen3-MoE, Mixtral)."""

    renormalize: bool = False
    """Rescale the k chosen probabilities to sum to 1."""


@dataclass(frozen=True, kw_only=True)
class SigmoidGroupTopK:
    """DeepSeek-V3's router ("noaux_tc"): sigmoid scores; a learnt per-expert correction bias (the
    auxiliary-loss-free balancing's state, `e_score_correction_bias`) is added for choosing only;
    the experts form `n_group` groups, a token keeps the `topk_group` groups whose two best biased
    scores sum highest and picks its top k inside them; the chosen unbiased scores are renormalised
    (`renormalize`) and scaled by `scaling_factor`."""

    n_group: int
    topk_group: int
    renormalize: bool = True
    scaling_factor: float = 1.0


Router = SoftmaxTopK | SigmoidGroupTopK
"""The router kinds (a union as kinds are added)."""


@dataclass(frozen=True, kw_only=True)
class RoutedExperts:
    """A Mixture-of-Experts MLP: `num_experts` SwiGLU experts of width `hidden_dim`, `top_k` per token."""

    num_experts: int
    top_k: int
    hidden_dim: int
    router: Router
    shared_hidden_dim: int = 0
    """Width of the shared experts' SwiGLU MLP, which every token goes through beside its routed
    experts (DeepSeek-V3: n_shared_experts * the expert width); 0: none."""


def has_router_bias(shape: ModelShape) -> bool:
    """Whether any block of `shape` routes with a biased router (SigmoidGroupTopK's correction bias)."""
    return any(isinstance(block.mlp, RoutedExperts) and isinstance(block.mlp.router, SigmoidGroupTopK)
               for block in shape.family.blocks(shape))


Attention = GroupedQueryAttention | LatentAttention
"""The attention kinds (a union as kinds are added)."""
MLP = DenseMLP | RoutedExperts


@dataclass(frozen=True, kw_only=True)
class Block:
    """One transformer block: pre-norm attention, then pre-norm MLP (RMSNorm, residuals)."""

    attention: Attention
    mlp: MLP
