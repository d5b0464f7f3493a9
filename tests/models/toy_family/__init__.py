"""A toy model family outside hpcrl: what adding a family takes (this folder, one `register` call).

ToyForCausalLM is a dense decoder whose config.json speaks GPT-2's dialect (n_embd, n_layer,
n_head, n_inner, n_positions) and whose every checkpoint has tied embeddings and per-head q/k
norms. The trainer builds it from torchtitan's Qwen3 classes.
"""

from toy_family.family import TOY, Toy

__all__ = ["TOY", "Toy"]
