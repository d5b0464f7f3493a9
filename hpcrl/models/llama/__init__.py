"""Llama 3 (LlamaForCausalLM): a dense decoder, q/k/v biases only with config.json's attention_bias."""

from hpcrl.models.llama.family import FAMILY, Llama

__all__ = ["FAMILY", "Llama"]
