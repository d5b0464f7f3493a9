"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): a dense decoder with q/k/v biases, always."""

from hpcrl.models.qwen2.family import FAMILY, Qwen2

__all__ = ["FAMILY", "Qwen2"]
