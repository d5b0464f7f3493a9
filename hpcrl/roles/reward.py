"""`python -m hpcrl.roles reward`: the reward group's process, serving the head.

    score {samples}     one RewardResult per sample; a verifier that raises, hangs or dies gives an
                        error record naming the sample (never a silent zero), and the pool goes on

reward.kind = "function": a RewardPool of worker processes; "model": a reward model (vLLM's pooling
runner, hpcrl.reward.model), on the task's GPUs when [groups.reward] gpus_per_node > 0 (the task sees
them as cuda:0..), float32 on CPU otherwise.
"""

from __future__ import annotations

from dataclasses import asdict

from hpcrl.config.schema import Config
from hpcrl.roles.base import Endpoint, Role
from hpcrl.slurm.identity import TaskIdentity


class RewardRole(Role):
    group = "reward"

    def __init__(self, config: Config, identity: TaskIdentity, env: dict[str, str]) -> None:
        from hpcrl.reward.model import make_scorer, reward_device

        device = reward_device(config.group("reward").gpus_per_node, env.get("CUDA_VISIBLE_DEVICES"))
        super().__init__()
        self.replica = identity.replica
        # A RewardPool of the function, or a reward model (vLLM runs it in its own processes).
        self.pool = make_scorer(config.reward, device=device, dtype=config.model.dtype)

    def endpoints(self) -> dict[str, Endpoint]:
        return {"score": (self.score, True)}

    async def score(self, call) -> list[dict]:
        from hpcrl.reward.types import Sample

        samples = [Sample(**s) for s in call.args["samples"]]
        results = await self.on_engine(self.pool.score, samples)
        return [asdict(r) for r in results]

    def close(self) -> None:
        super().close()
        self.pool.close()
