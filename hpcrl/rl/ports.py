"""The controller's `Ports` bound to the control bus: the groups of a job, seen from the head.

    ports = BusPorts(config, head, store_host=..., store_port=...)
    await ports.connect(timeout=600)       # every group registered; weight-transfer group formed
    await run_loop(config, ports)          # hpcrl.rl.loop

  generate        the batch's prompts split in contiguous chunks over the healthy inference replicas
                  (Service.route, idempotent: a chunk whose replica dies is retried on another);
                  sampling seeds depend on each prompt's place in the batch, so the split changes nothing
  score           the reward group (route)
  train_step      every trainer rank (call_all), each takes its share of the batch
  sync_weights    trainer ranks send, every inference replica receives (point to point, the transfer plan)
  save/load       every trainer rank (DCP)

Nothing is pickled: batches, completions and rewards cross the bus as msgpack maps.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict

from hpcrl.config.schema import Config
from hpcrl.data.prompts import Prompt
from hpcrl.inference.types import Completion
from hpcrl.reward.pool import RewardResult, Sample
from hpcrl.rl.rollouts import TrainBatch

#: Seconds a call may take before the head gives up on it (a CPU step or a first vLLM call can be slow).
CALL_TIMEOUT_S = 600.0


class BusPorts:
    def __init__(self, config: Config, head, *, store_host: str, store_port: int, log=print) -> None:
        from hpcrl.services import Service
        from hpcrl.transfer.for_config import plan_for_config

        self.config = config
        self.head = head
        self.store_host, self.store_port = store_host, store_port
        self.log = log
        self.trainer = Service(head, "trainer")
        self.inference = Service(head, "inference")
        self.reward = Service(head, "reward")
        self.plan = plan_for_config(config)

    async def connect(self, *, timeout: float) -> None:
        """Wait for every group, then form the weight-transfer group (trainer ranks + every vLLM worker)."""
        c = self.config
        for group, replicas in (("trainer", 1), ("inference", c.inference.replicas), ("reward", 1)):
            await self.head.wait_for_peers(group, replicas, timeout=timeout)
            self.log(f"group {group}: {replicas} replica(s) ready")
        args = {"host": self.store_host, "port": self.store_port, "timeout_s": timeout, "digest": self.plan.digest}
        await asyncio.gather(self.trainer.call_all(0, "connect_transfer", args, timeout=timeout),
                             self.inference.fanout("connect_transfer", args, timeout=timeout))
        self.log(f"weight-transfer group formed: {self.plan.trainer.world_size} trainer rank(s) -> "
                 f"{c.inference.replicas} replica(s) x TP {c.inference.tensor_parallel} (plan {self.plan.digest[:12]})")

    # -- Ports ---------------------------------------------------------------------------------
    async def generate(self, prompts: list[Prompt], *, n: int, seed: int) -> list[list[Completion]]:
        replicas = max(1, len(self.inference.replicas()))
        size = -(-len(prompts) // replicas)
        chunks = [(k, prompts[k:k + size]) for k in range(0, len(prompts), size)]
        parts = await asyncio.gather(*(
            self.inference.route("generate", {"prompts": [asdict(p) for p in chunk], "n": n, "seed": seed,
                                              "offset": offset}, timeout=CALL_TIMEOUT_S)
            for offset, chunk in chunks))
        return [[Completion(**c) for c in group] for part in parts for group in part]

    async def score(self, samples: list[Sample]) -> list[RewardResult]:
        out = await self.reward.route("score", {"samples": [asdict(s) for s in samples]}, timeout=CALL_TIMEOUT_S)
        return [RewardResult(**r) for r in out]

    async def train_step(self, batch: TrainBatch, *, step: int) -> dict[str, float]:
        results = await self.trainer.call_all(0, "train_step", {"batch": batch.to_dict(), "step": step},
                                              timeout=CALL_TIMEOUT_S)
        return results[0]

    async def sync_weights(self, version: int) -> None:
        await asyncio.gather(self.trainer.call_all(0, "send_weights", {"version": version}, timeout=CALL_TIMEOUT_S),
                             self.inference.fanout("receive_weights", {"version": version}, timeout=CALL_TIMEOUT_S))

    async def trainer_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        results = await self.trainer.call_all(0, "logprobs", {"sequences": sequences}, timeout=CALL_TIMEOUT_S)
        return results[0]

    async def inference_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        return await self.inference.route("logprobs", {"sequences": sequences}, timeout=CALL_TIMEOUT_S)

    # -- checkpoints ---------------------------------------------------------------------------
    async def save_trainer(self, directory) -> None:
        await self.trainer.call_all(0, "save", {"directory": str(directory)}, timeout=CALL_TIMEOUT_S)

    async def load_trainer(self, directory) -> None:
        await self.trainer.call_all(0, "load", {"directory": str(directory)}, timeout=CALL_TIMEOUT_S)

    async def close(self) -> None:
        pass
