"""Qwen3 (Qwen3ForCausalLM): a dense decoder that normalises q and k per head."""

from hpcrl.models.qwen3.family import FAMILY, Qwen3

__all__ = ["FAMILY", "Qwen3"]
