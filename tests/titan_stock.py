"""torchtitan's own Llama3 with fused wqkv, built for a ModelShape: what the planner's "torchtitan"
naming with fuse_qkv must match (tests/plan) and what the vLLM oracle ships from (tests/transfer).

hpcrl's trainer builds its models without fusing (hpcrl.trainer.titan); this is torchtitan's stock
layout, with its own init functions, so the tests check the planner against torchtitan itself.
"""

from __future__ import annotations


def stock_fused_llama3(shape):
    """(config, model): torchtitan's Llama3Model for `shape`, fused wqkv, parameters on the CPU."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init
    from torchtitan.models.llama3.model import Llama3Model

    s = shape
    config = Llama3Model.Config(
        dim=s.hidden_size, vocab_size=s.vocab_size,
        tok_embeddings=Embedding.Config(num_embeddings=s.vocab_size, embedding_dim=s.hidden_size,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=s.hidden_size, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=s.hidden_size, out_features=s.vocab_size,
                              param_init=_output_linear_init(s.hidden_size)),
        layers=_build_llama3_layers(fuse_qkv=True, n_layers=s.num_layers, dim=s.hidden_size, n_heads=s.num_heads,
                                    n_kv_heads=s.num_kv_heads, hidden_dim=s.intermediate_size, attn_backend="flex",
                                    rope=ComplexRoPE.Config(dim=s.head_dim, max_seq_len=1024, theta=s.rope_theta)))
    return config, config.build()
