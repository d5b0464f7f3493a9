"""`DeepseekV3Shape`: the sizes of a DeepSeek-V3-architecture model (DeepSeek-V3 / R1, Kimi-K2).

The sizes every decoder has (ModelShape) and those of multi-head latent attention (MLA), shared
experts, dense first layers and grouped, biased sigmoid routing, named as config.json names them.
A dense decoder's `num_kv_heads` is `num_heads` here (MLA keeps no KV heads; vLLM's cache holds one
latent per token) and `head_dim` is a query/key head's qk_nope_head_dim + qk_rope_head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.models.shape import Experts, ModelShape, routed_experts


@dataclass(frozen=True, kw_only=True)
class DeepseekV3Shape(ModelShape):
    """DeepSeek-V3's sizes (config.json's names); the defaults are a model without experts."""

    q_lora_rank: int = 0
    """Rank of the query's low-rank projection (q_a_proj, q_a_layernorm, q_b_proj); 0: config.json's
    null, a full-rank q_proj (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 512
    """The compressed key/value latent per token (kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj)."""
    qk_nope_head_dim: int = 128
    """Per head, the query/key dims without RoPE (up-projected from the latent by kv_b_proj)."""
    qk_rope_head_dim: int = 64
    """The query/key dims with RoPE; the key's are shared by every head (decoupled RoPE key)."""
    v_head_dim: int = 128
    """Per head, the value dims (up-projected from the latent by kv_b_proj)."""
    n_routed_experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""
    n_shared_experts: int = 0
    """Experts every token goes through, held as one SwiGLU MLP n_shared_experts * moe_intermediate_size wide."""
    moe_intermediate_size: int = 0
    """Each expert's SwiGLU width; dense layers keep `intermediate_size`."""
    first_k_dense_replace: int = 0
    """The first k layers keep a dense MLP."""
    moe_layer_freq: int = 1
    """After those, layer i is a MoE layer when i % moe_layer_freq == 0 (vLLM's rule)."""
    num_experts_per_tok: int = 0
    """Routed experts each token goes to (top-k)."""
    n_group: int = 1
    """Routed experts form n_group groups; a token picks topk_group groups, then top-k inside them."""
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    """The routed experts' weighted sum is scaled by this."""
    norm_topk_prob: bool = True
    """Renormalise the top-k sigmoid scores to sum to 1."""
    num_nextn_predict_layers: int = 0
    """Multi-token-prediction layers the checkpoint has after the main ones (layer num_layers on):
    read and written back, not in the shape's parameters (vLLM serves them only as a speculative
    decoder; they are neither trained nor synced here)."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` routes to experts (vLLM's DeepseekV2DecoderLayer rule)."""
        return (self.n_routed_experts > 0 and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)

    def experts(self) -> Experts | None:
        return routed_experts(self, num_experts=self.n_routed_experts, top_k=self.num_experts_per_tok,
                              intermediate_size=self.moe_intermediate_size, is_moe_layer=self.is_moe_layer)

    def active_parameters(self) -> int:
        """Parameters a token computes with: every tensor but the routed experts, and top-k of those
        (DeepSeek's "activated parameters": 37B of DeepSeek-V3's 671B)."""
        experts = self.experts()
        if experts is None:
            return self.num_parameters
        return self.num_parameters - experts.parameters + experts.parameters * experts.top_k // experts.num_experts
