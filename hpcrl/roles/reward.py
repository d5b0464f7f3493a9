"""`python -m hpcrl.roles reward`: the reward group's process, serving the head.

Its endpoints, with their request and reply types, are declared in hpcrl.contract.endpoints
(RewardEndpoints):

    score {samples}     one RewardResult per sample; a verifier that raises, hangs or dies gives an
                        error record naming the sample (never a silent zero), and the pool goes on
    env_reset {requests}   with [env] environment set: one EnvReply per EnvRequest, in order (hpcrl.env):
    env_step {requests}    the episodes' first messages / the environment's answer to each conversation;
                        an environment that raises, hangs or dies gives a reply with `error`, never an exception

The environments run in an EnvPool of worker processes of this task, beside the reward pool. Their
calls do not go through the engine thread: the pool's own thread does the pipe I/O and the endpoints
await its futures, so a slow environment never delays scoring, and concurrent env calls (episodes of
several replicas) share the environment workers. Both are idempotent: an episode's state follows from
its row and conversation, so a call whose reward task died is served again by another one.

reward.kind = "function": a RewardPool of worker processes; "model": a reward model (vLLM's pooling
runner, hpcrl.reward.model), on the task's GPUs when [groups.reward] gpus_per_node > 0 (the task sees
them as cuda:0..), float32 on CPU otherwise.
"""

from __future__ import annotations

import asyncio

from hpcrl.config.groups import REWARD
from hpcrl.config.schema import Config
from hpcrl.contract.calls import Handler
from hpcrl.contract.endpoints import Endpoint, EnvCall, RewardEndpoints, ScoreCall
from hpcrl.env.types import EnvReply, EnvRequest
from hpcrl.reward.types import RewardResult
from hpcrl.roles.base import Role
from hpcrl.slurm.identity import TaskIdentity


class RewardRole(Role):
    group = REWARD

    def __init__(self, config: Config, identity: TaskIdentity, env: dict[str, str]) -> None:
        from hpcrl.reward.model import make_scorer, reward_device

        device = reward_device(config.group(REWARD).gpus_per_node, env.get("CUDA_VISIBLE_DEVICES"))
        super().__init__()
        self.replica = identity.replica
        # A RewardPool of the function, or a reward model (vLLM runs it in its own processes).
        self.pool = make_scorer(config.reward, device=device, dtype=config.model.dtype)
        self.env = None
        if config.env.environment:
            from hpcrl.env.pool import EnvPool

            try:
                self.env = EnvPool(config.env)
            except BaseException:
                self.pool.close()
                raise

    def handlers(self) -> dict[Endpoint, Handler]:
        handlers: dict[Endpoint, Handler] = {RewardEndpoints.score: self.score}
        if self.env is not None:
            handlers |= {RewardEndpoints.env_reset: self.env_reset, RewardEndpoints.env_step: self.env_step}
        return handlers

    async def score(self, call: ScoreCall) -> list[RewardResult]:
        return await self.on_engine(self.pool.score, call.samples)

    async def env_reset(self, call: EnvCall) -> list[EnvReply]:
        return await self._env_call("reset", call.requests)

    async def env_step(self, call: EnvCall) -> list[EnvReply]:
        return await self._env_call("step", call.requests)

    async def _env_call(self, op, requests: list[EnvRequest]) -> list[EnvReply]:
        assert self.env is not None
        futures = self.env.submit(op, requests)
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    def close(self) -> None:
        super().close()
        self.pool.close()
        if self.env is not None:
            self.env.close()
