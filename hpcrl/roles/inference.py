"""`python -m hpcrl.roles inference`: one inference replica (a vLLM engine), serving the head.

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

from dataclasses import asdict

from hpcrl.config.schema import Config
from hpcrl.data.prompts import Prompt
from hpcrl.errors import HpcrlError
from hpcrl.roles.base import Endpoint, Role
from hpcrl.slurm.identity import TaskIdentity


class InferenceRole(Role):
    group = "inference"

    def __init__(self, config: Config, identity: TaskIdentity, env: dict[str, str]) -> None:
        super().__init__()
        from hpcrl.inference.engine import VllmEngine
        from hpcrl.plan.for_config import plan_for_config

        self.config, self.replica = config, identity.replica
        self.plan = plan_for_config(config)
        self.engine = VllmEngine.from_config(config, weight_transfer=True)

    def endpoints(self) -> dict[str, Endpoint]:
        return {"generate": (self.generate, True), "logprobs": (self.logprobs, True),
                "connect_transfer": (self.connect_transfer, False),
                "receive_weights": (self.receive_weights, False), "status": (self.status, True)}

    async def generate(self, call) -> list[list[dict]]:
        args = call.args
        prompts = [Prompt(**p) for p in args["prompts"]]
        temperature = args.get("temperature")  # an evaluation's (0.0: greedy); None: inference.temperature
        limits = args.get("max_tokens")  # an episode's turn (hpcrl.rl.episodes): one per prompt
        groups = await self.on_engine(lambda: self.engine.generate(
            prompts, n=int(args["n"]), seed=int(args["seed"]), offset=int(args.get("offset", 0)),
            temperature=None if temperature is None else float(temperature),
            max_tokens=None if limits is None else [int(m) for m in limits]))
        return [[asdict(c) for c in group] for group in groups]

    async def logprobs(self, call) -> list[list[float]]:
        return await self.on_engine(self.engine.token_logprobs, call.args["sequences"])

    async def connect_transfer(self, call) -> dict:
        args = call.args
        if args["digest"] != self.plan.digest:
            raise HpcrlError(f"inference replica {self.replica} planned the weight transfer as "
                             f"{self.plan.digest[:12]}, the head as {args['digest'][:12]}")
        await self.on_engine(lambda: self.engine.connect_transfer(
            self.plan, store=args["store"], replica=self.replica,
            generation=int(args.get("generation", 0)), transport=self.config.weight_transport,
            timeout_s=float(args["timeout_s"])))
        return {"replica": self.replica}

    async def receive_weights(self, call) -> dict:
        await self.on_engine(self.engine.receive_weights, int(call.args["version"]))
        return {"replica": self.replica, "weight_version": self.engine.weight_version}

    async def status(self, call) -> dict:
        return {"replica": self.replica, "weight_version": self.engine.weight_version}

    def close(self) -> None:
        super().close()
        self.engine.close()
