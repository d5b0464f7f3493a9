"""`Qwen3MoeShape`: a dense decoder's sizes, and the routed experts of Qwen3-MoE."""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.models.shape import Experts, ModelShape, routed_experts


@dataclass(frozen=True, kw_only=True)
class Qwen3MoeShape(ModelShape):
    """Qwen3-MoE: the defaults are a dense model (no experts)."""

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

    def experts(self) -> Experts | None:
        return routed_experts(self, num_experts=self.num_experts, top_k=self.num_experts_per_tok,
                              intermediate_size=self.moe_intermediate_size, is_moe_layer=self.is_moe_layer)
