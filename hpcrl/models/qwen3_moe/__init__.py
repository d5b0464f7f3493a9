"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention, and routed experts in place of the MLP."""

from hpcrl.models.qwen3_moe.family import FAMILY, Qwen3Moe
from hpcrl.models.qwen3_moe.shape import Qwen3MoeShape

__all__ = ["FAMILY", "Qwen3Moe", "Qwen3MoeShape"]
