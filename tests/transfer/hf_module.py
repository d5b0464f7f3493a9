"""A trainer model without torchtitan, for transfer tests and tools/bench_reshard.py: a checkpoint's
tensors as a plain module, and its local shards once FSDP2 has sharded it.

    model = checkpoint_module(model_dir)            # parameters under their HF names, float32
    fully_shard(...)                                # the test's FSDP2 layout
    sender.send(local_shards(model))                # hpcrl.transfer.trainer.TrainerSender
"""

from __future__ import annotations

from pathlib import Path

import torch


def checkpoint_module(path: str | Path) -> torch.nn.Module:
    """A plain module whose float32 parameters are the tensors of `path`/model.safetensors, nested
    under their Hugging Face names (model.layers.0.self_attn.q_proj.weight, ...): a trainer model
    with the "hf" naming of a transfer plan, without transformers or torchtitan."""
    from safetensors.torch import load_file

    root = torch.nn.Module()
    for name, tensor in load_file(str(Path(path) / "model.safetensors")).items():
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
