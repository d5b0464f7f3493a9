"""The trainer side of a weight transfer: send from local FSDP2 shards, never `full_tensor()`.

    sender = TrainerSender.connect(plan, rank=rank, store=address, timeout_s=120)   # transport="gloo"
    sender.send({name: shard.tensor for name, shard in engine.local_shards().items()})    # every step, every rank

`send` takes each planned parameter's local shard under its HF name (the trainer engine's
`local_shards`: rows [a, b) of the Shard(0) placement with torch.chunk semantics), so no gather
happens. Every trainer rank joins the transfer group at connect time; the plan digest is
compared with every other rank (trainer and vLLM workers) before anything moves.
"""

from __future__ import annotations

import time

import torch

from hpcrl.errors import TransferError
from hpcrl.plan.transfer.plan import TransferPlan
from hpcrl.transfer import execute
from hpcrl.transfer.registry import open_group


class TrainerSender:
    """One trainer rank's end of the transfer group."""

    def __init__(self, plan: TransferPlan, group, *, rank: int, timeout_s: float) -> None:
        self.plan, self.group, self.rank, self.timeout_s = plan, group, rank, timeout_s
        self.last_seconds = 0.0

    @classmethod
    def connect(cls, plan: TransferPlan, *, rank: int, store: str, timeout_s: float = 120.0,
                generation: int = 0, transport: str = "gloo") -> TrainerSender:
        world = plan.trainer.world_size + plan.inference.replicas * plan.inference.tensor_parallel
        if not 0 <= rank < plan.trainer.world_size:
            raise TransferError(f"trainer rank {rank} is outside the plan's {plan.trainer.world_size} trainer ranks")
        group = open_group(transport, store=store, rank=rank, world_size=world, timeout_s=timeout_s,
                           generation=generation)
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
