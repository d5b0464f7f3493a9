"""A trainer model without torchtitan, for transfer tests and tools/bench/weight_sync.py: a checkpoint's
tensors as a plain module, and its local shards once FSDP2 has sharded it.

    model = checkpoint_module(model_dir)            # parameters under their HF names, float32
    model = checkpoint_module(model_dir, grouped_experts=True)   # a MoE's experts as 3-D stacks
    fully_shard(...)                                # the test's FSDP2 layout
    sender.send(local_shards(model))                # hpcrl.transfer.trainer.TrainerSender
"""

from __future__ import annotations

from pathlib import Path

import torch


def checkpoint_module(path: str | Path, *, grouped_experts: bool = False) -> torch.nn.Module:
    """A plain module whose float32 parameters are the tensors of `path`/model.safetensors, nested
    under their Hugging Face names (model.layers.0.self_attn.q_proj.weight, ...): a trainer model
    with the "hf" naming of a transfer plan, without transformers or torchtitan.

    grouped_experts=True stacks a MoE layer's experts as torchtitan's GroupedExperts holds them,
    [E, I, H] (gate, up) and [E, H, I] (down), named as HF without the expert index
    (model.layers.0.mlp.experts.gate_proj.weight): the trainer layout's grouped_experts."""
    import re

    from safetensors.torch import load_file

    tensors = load_file(str(Path(path) / "model.safetensors"))
    if grouped_experts:
        expert = re.compile(r"^(.*\.experts\.)(\d+)\.(\w+_proj\.weight)$")
        stacks: dict[str, dict[int, torch.Tensor]] = {}
        for name in [n for n in tensors if expert.match(n)]:
            m = expert.match(name)
            assert m is not None
            stacks.setdefault(m.group(1) + m.group(3), {})[int(m.group(2))] = tensors.pop(name)
        tensors.update({name: torch.stack([by[e] for e in range(len(by))]) for name, by in stacks.items()})
    root = torch.nn.Module()
    for name, tensor in tensors.items():
        *parents, leaf = name.split(".")
        module = root
        for part in parents:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(tensor.float()))
    return root


def local_shards(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> this rank's local shard of every parameter (plain tensors pass through)."""
    out = {}
    for name, param in module.named_parameters():
        data = param.data if isinstance(param, torch.nn.Parameter) else param
        to_local = getattr(data, "to_local", None)
        out[name] = to_local() if callable(to_local) else data
    return out
