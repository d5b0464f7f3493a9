"""The trainer side of a weight transfer: send from local FSDP2 shards, never `full_tensor()`.

    sender = TrainerSender.connect(plan, rank=rank, host=host, port=port, timeout_s=120)   # transport="gloo"
    sender.send(local_shards(model))      # after every optimizer step, on every trainer rank

`local_shards(module)` maps each parameter name to its local shard (`DTensor.to_local()`, a view
of rows [a, b) of the Shard(0) placement with torch.chunk semantics), so no gather happens.
Every trainer rank joins the transfer group at connect time; the plan digest is compared with
every other rank (trainer and vLLM workers) before anything moves.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from hpcrl.errors import TransferError
from hpcrl.plan.transfer_plan import TransferPlan
from hpcrl.transfer import execute
from hpcrl.transfer.group import open_group


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


class TrainerSender:
    """One trainer rank's end of the transfer group."""

    def __init__(self, plan: TransferPlan, group, *, rank: int, timeout_s: float) -> None:
        self.plan, self.group, self.rank, self.timeout_s = plan, group, rank, timeout_s
        self.last_seconds = 0.0

    @classmethod
    def connect(cls, plan: TransferPlan, *, rank: int, host: str, port: int, timeout_s: float = 120.0,
                external_store: bool = False, generation: int = 0, transport: str = "gloo") -> "TrainerSender":
        world = plan.trainer.world_size + plan.inference.replicas * plan.inference.tensor_parallel
        if not 0 <= rank < plan.trainer.world_size:
            raise TransferError(f"trainer rank {rank} is outside the plan's {plan.trainer.world_size} trainer ranks")
        group = open_group(transport, host=host, port=port, rank=rank, world_size=world, timeout_s=timeout_s,
                           external_store=external_store, generation=generation)
        group.check_digests(rank=rank, digest=plan.digest, describe=lambda r: execute.describe_group_rank(plan, r))
        return cls(plan, group, rank=rank, timeout_s=timeout_s)

    def send(self, shards: dict[str, torch.Tensor]) -> int:
        """Send this rank's part of one update; returns the bytes sent."""
        t0 = time.perf_counter()
        sources = execute.check_sources(self.plan, self.rank, shards)
        with torch.no_grad():
            sent = execute.send(self.group, self.plan, self.rank, sources, timeout_s=self.timeout_s)
        self.last_seconds = time.perf_counter() - t0
        return sent

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()
