"""`python -m hpcrl.roles inference`: one inference replica (a vLLM engine), serving the head.

Its endpoints, with their request and reply types, are declared in hpcrl.contract.endpoints
(InferenceEndpoints):

    generate {prompts, n, seed, offset[, temperature][, max_tokens]}
                                          n completions per prompt, tagged with the weight version
                                          (temperature: an evaluation's, 0.0 greedy; else inference.temperature;
                                          max_tokens: one limit per prompt, an episode's turn, else inference's)
    logprobs {sequences}                  logprob of every token after the first, live weights
    connect_transfer {host, port, ...}    join the weight-transfer group (hpcrl's vLLM weight-transfer engine)
    receive_weights {version}             receive one update from the trainer ranks, then serve it
    status {}                             weight version and replica

generate and logprobs are idempotent: if this replica dies mid-call, the head retries them on
another one, and a chunk's sampling seed depends on its place in the batch, not on the replica
(hpcrl.inference.engine: the chunk draws the same tokens wherever it runs).
"""

from __future__ import annotations

from hpcrl.config.groups import INFERENCE
from hpcrl.config.schema import Config
from hpcrl.contract.calls import Handler
from hpcrl.contract.endpoints import (
    ConnectTransferCall,
    Endpoint,
    GenerateCall,
    InferenceEndpoints,
    ReplicaReply,
    ReplicaWeights,
    SequencesCall,
    StatusCall,
    WeightsCall,
)
from hpcrl.errors import HpcrlError
from hpcrl.inference.types import Completion
from hpcrl.roles.base import Role
from hpcrl.slurm.identity import TaskIdentity


class InferenceRole(Role):
    group = INFERENCE

    def __init__(self, config: Config, identity: TaskIdentity, env: dict[str, str]) -> None:
        super().__init__()
        from hpcrl.inference.engine import VllmEngine
        from hpcrl.plan.for_config import plan_for_config

        self.config, self.replica = config, identity.replica
        self.plan = plan_for_config(config)
        self.engine = VllmEngine.from_config(config, weight_transfer=True, engine_core_here=True)

    def handlers(self) -> dict[Endpoint, Handler]:
        return {InferenceEndpoints.generate: self.generate, InferenceEndpoints.logprobs: self.logprobs,
                InferenceEndpoints.connect_transfer: self.connect_transfer,
                InferenceEndpoints.receive_weights: self.receive_weights, InferenceEndpoints.status: self.status}

    async def generate(self, call: GenerateCall) -> list[list[Completion]]:
        # temperature: an evaluation's (0.0: greedy), None: inference.temperature; max_tokens: an episode's
        # turn (hpcrl.rl.episodes), one per prompt
        temperature = None if call.temperature is None else float(call.temperature)
        return await self.on_engine(lambda: self.engine.generate(
            call.prompts, n=call.n, seed=call.seed, offset=call.offset, temperature=temperature,
            max_tokens=call.max_tokens))

    async def logprobs(self, call: SequencesCall) -> list[list[float]]:
        return await self.on_engine(self.engine.token_logprobs, call.sequences)

    async def connect_transfer(self, call: ConnectTransferCall) -> ReplicaReply:
        if call.digest != self.plan.digest:
            raise HpcrlError(f"inference replica {self.replica} planned the weight transfer as "
                             f"{self.plan.digest[:12]}, the head as {call.digest[:12]}")
        await self.on_engine(lambda: self.engine.connect_transfer(
            self.plan, store=call.store, replica=self.replica, generation=call.generation,
            transport=self.config.weight_transport, timeout_s=float(call.timeout_s)))
        return ReplicaReply(replica=self.replica)

    async def receive_weights(self, call: WeightsCall) -> ReplicaWeights:
        await self.on_engine(self.engine.receive_weights, call.version)
        return await self.status(StatusCall())

    async def status(self, call: StatusCall) -> ReplicaWeights:
        return ReplicaWeights(replica=self.replica, weight_version=self.engine.weight_version)

    def close(self) -> None:
        super().close()
        self.engine.close()
