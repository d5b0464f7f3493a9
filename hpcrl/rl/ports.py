"""The controller's `Ports` bound to the control bus: the groups of a job, seen from the head.

    ports = BusPorts(config, head, store=address)   # the rendezvous store (hpcrl.rendezvous.meet)
    await ports.connect(timeout=600)       # every group registered; weight-transfer group formed
    await run_loop(config, ports)          # hpcrl.rl.loop

  generate        the batch's prompts split in contiguous chunks, each to the least busy replica that
                  is in the weight-transfer group and on the current weights; a chunk whose replica
                  dies goes to another, or waits until the head has started the lost one again and
                  it was caught up (group formed again, current weights pushed); a chunk's tokens
                  depend on its prompts, its place in the batch and the seed, so where it runs
                  changes nothing (with the same number of replicas: hpcrl.inference.engine); an
                  evaluation's prompts are split the same way, at its own temperature
  generate_turn   [env]: one turn of a chunk of episodes (hpcrl.rl.episodes) on one replica, the least busy
                  serving one, as a chunk of generate (the same failover); its prompts are the episodes' ids
                  so far, each with its max_tokens, its seed the chunk's and the turn's
  env_reset/step  [env]: the reward group's environment workers (route; the calls are idempotent: a request
                  holds the row and the whole conversation); never in the head's process (config.checks
                  refuses [env] with reward.tasks = 0)
  score           the reward group (route)
  train_step      every trainer rank (call_all), each takes its share of the batch
  sync_weights    trainer ranks send, every inference replica receives (point to point, the transfer plan)
  save/load       every trainer rank (DCP)

Every call is typed by the bus's contract (hpcrl.contract.endpoints): a request is built as its
dataclass, and each reply is checked and built into its type, naming the peer when it is malformed
(BadReply). Nothing is pickled: batches, completions and rewards cross the bus as msgpack maps.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TypeVar

from hpcrl.bus.errors import DeadlineExceeded
from hpcrl.config.groups import INFERENCE, REWARD, TRAINER
from hpcrl.config.schema import Config
from hpcrl.contract.endpoints import (
    CheckpointCall,
    ConnectTransferCall,
    Endpoint,
    EnvCall,
    GenerateCall,
    ScoreCall,
    SequencesCall,
    TrainStepCall,
    WeightsCall,
)
from hpcrl.contract.endpoints import InferenceEndpoints as INF
from hpcrl.contract.endpoints import RewardEndpoints as REW
from hpcrl.contract.endpoints import TrainerEndpoints as TRN
from hpcrl.data.prompts import Prompt
from hpcrl.env.types import EnvReply, EnvRequest
from hpcrl.errors import HpcrlError
from hpcrl.inference.types import Completion
from hpcrl.reward.types import RewardResult, Sample
from hpcrl.rl.deadline import StepDeadline
from hpcrl.rl.startup import StartupClock, process_age_s
from hpcrl.trainer.types import TrainBatch

#: Seconds a call may take before the head gives up on it (a CPU step or a first vLLM call can be slow).
CALL_TIMEOUT_S = 600.0
#: Pause before a lost inference call is made again: the head may still count the replica as
#: healthy (unreachable for a moment, not yet silent for heartbeat_timeout), and a retry without
#: a pause would spin the head's event loop so that it never learns otherwise.
RETRY_PAUSE_S = 0.2
#: With spare nodes, heartbeat timeouts a weight push waits on one message before it gives up (and the
#: least seconds): a replica whose node lost power never answers, and only a failed push lets the head
#: form the transfer group again with its replacement inside the job. Without spares the job is requeued
#: instead, and a push waits as long as the group's formation may (the rejoin or start timeout).
PUSH_WAIT_HEARTBEATS, PUSH_WAIT_MIN_S = 3, 30.0

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Rep = TypeVar("Rep")


class StepStuck(HpcrlError):
    """A trainer step overran its deadline (hpcrl.rl.deadline): the run's attempt ends, the job is requeued."""


def _rank0(replies: list[Rep | None], endpoint: Endpoint) -> Rep:
    """Trainer rank 0's reply: it answers for the group (the other ranks answer None)."""
    if replies[0] is None:
        raise HpcrlError(f"{endpoint}: trainer rank 0 answered None, but it answers for the trainer group")
    return replies[0]


def _rejoin_timeout_s(config: Config) -> float:
    """run.rejoin_timeout_s, or derived from the model's size (hpcrl.plan.timeouts)."""
    from hpcrl.config.model_shapes import shape_of
    from hpcrl.plan.timeouts import run_timeouts

    return run_timeouts(config, shape_of(config.model)).rejoin_s


class BusPorts:
    def __init__(self, config: Config, head, *, store: str, generation: int = -1) -> None:
        from hpcrl.contract.calls import GroupClient
        from hpcrl.plan.for_config import describe_plan, plan_for_config

        self.config = config
        self.head = head
        self.store = store
        self.step_deadline = StepDeadline(ceiling_s=CALL_TIMEOUT_S)
        self.trainer = GroupClient(head, TRAINER)
        self.inference = GroupClient(head, INFERENCE)
        self.reward = GroupClient(head, REWARD)
        self.plan = plan_for_config(config)
        log.info(describe_plan(self.plan))  # the digest `hpcrl plan --transfer` prints for this config
        self.startup = StartupClock()
        """The start-up (hpcrl.rl.startup): when each group was ready, seconds from the head's launch."""
        self.rejoin_timeout_s = _rejoin_timeout_s(config)
        """Seconds a lost inference replica has to come back (started again by the head) and register."""
        self.push_wait_s = (max(PUSH_WAIT_MIN_S, PUSH_WAIT_HEARTBEATS * config.cluster.heartbeat_timeout_s)
                            if config.cluster.spare_nodes else None)
        """Spare nodes: seconds a transfer waits on one message (PUSH_WAIT_HEARTBEATS); None: the formation's."""
        self.replicas = config.inference.replicas
        # Trainer-side work (train steps, weight pushes, forming the transfer group) one at a time.
        self._trainer_turn = asyncio.Lock()
        self.generation = generation
        """The weight-transfer group formed last (its store prefix): -1 before the first; a group formed again
        after the trainer group started again inside the job goes on from the last one's."""
        self._first = generation < 0
        self.members: dict[int, tuple[str, int]] = {}
        """replica -> (host, pid) of the processes in the current weight-transfer group."""
        self.current = False
        """Whether the group's replicas hold the trainer's weights of `trainer_version`."""
        self.trainer_version = 0
        # reward.tasks = 0: score in the head's process (no reward group in the job).
        self.local_scorer = None
        if config.reward.tasks == 0:
            from hpcrl.reward.model import make_scorer
            self.local_scorer = make_scorer(config.reward)

    async def connect(self, *, timeout: float) -> None:
        """Wait for every group, then form the weight-transfer group (trainer ranks + every vLLM worker).
        self.startup gets when each group was ready, counted from the head's launch (they start at once)."""
        await self.head.wait_for_peers(TRAINER, 1, timeout=timeout)
        self.startup.record(TRAINER, process_age_s())
        if self.local_scorer is None:
            await self.head.wait_for_peers(REWARD, 1, timeout=timeout)
            self.startup.record(REWARD, process_age_s())
        log.info(f"groups ready: trainer ({self.plan.trainer.world_size} rank(s)), reward "
                 f"({'in the head' if self.local_scorer is not None else 'its own group'})")
        async with self._trainer_turn:
            await self._form_group(timeout)

    # -- the weight-transfer group and which replicas may serve ---------------------------------
    def _leader(self, replica: int):
        for peer in self.head.peers(INFERENCE):
            if peer.replica == replica and peer.rank == 0:
                return peer
        return None

    def _intact(self) -> bool:
        """Every replica of the group formed last is still the same healthy process."""
        for replica in range(self.replicas):
            peer = self._leader(replica)
            if peer is None or (peer.host, peer.pid) != self.members.get(replica):
                return False
        return True

    async def _form_group(self, timeout: float) -> None:
        """(Re)form the weight-transfer group once every replica is registered (a lost one started again)."""
        await self.head.wait_for_peers(INFERENCE, self.replicas, timeout=timeout)
        if self.generation < 0 and self._first:
            self.startup.record(INFERENCE, process_age_s())
        forming = time.monotonic()
        self.generation += 1
        self.current = False
        # The group's ends wait this long to form it, and on each message of a push.
        wait_s = min(timeout, self.push_wait_s) if self.push_wait_s else timeout
        call = ConnectTransferCall(store=self.store, timeout_s=wait_s, digest=self.plan.digest,
                                   generation=self.generation)
        members = {r: (p.host, p.pid) for r in range(self.replicas) if (p := self._leader(r)) is not None}
        await asyncio.gather(self.trainer.call_all(0, TRN.connect_transfer, call, timeout=timeout),
                             self.inference.fanout(INF.connect_transfer, call, timeout=timeout))
        self.members = members
        if self.generation == 0 and self._first:
            self.startup.record("weights", time.monotonic() - forming)
        log.info(f"weight-transfer group formed (generation {self.generation}): {self.plan.trainer.world_size} "
                 f"trainer rank(s) -> {self.replicas} replica(s) x TP {self.config.inference.tensor_parallel} "
                 f"(plan {self.plan.digest[:12]})")

    async def _push(self) -> bool:
        """Send the trainer's weights (`trainer_version`) to every replica. False when an inference
        replica was lost meanwhile (its call failed with PeerDeadError; the trainer's send to it fails
        too): the replicas stay stale until _catch_up has formed the group again with the replica the
        head starts again, and pushed. Any other failure is raised."""
        from hpcrl.bus.errors import PeerDeadError

        version = self.trainer_version
        outcomes = await asyncio.gather(
            self.trainer.call_all(0, TRN.send_weights, WeightsCall(version=version), timeout=CALL_TIMEOUT_S),
            self.inference.fanout(INF.receive_weights, WeightsCall(version=version), timeout=CALL_TIMEOUT_S),
            return_exceptions=True)
        sent, received = outcomes  # unpacked apart: mypy 2.4 cannot type `a, b = await gather(...)` here
        if isinstance(received, PeerDeadError):
            log.warning(f"weight version {version} did not reach the inference replicas ({received}); they get "
                     "the trainer's weights once the lost replica is back")
            return False
        for outcome in (sent, received):
            if isinstance(outcome, BaseException):
                raise outcome
        self.current = True
        return True

    async def _catch_up(self) -> None:
        """Held under the trainer turn: if a replica was replaced, form the group again; then, if the
        replicas are stale, push the trainer's current weights to everyone, so a newcomer serves what
        the others serve. A push that loses a replica is followed by a pause (the head may not yet
        count it as dead), and the caller tries again."""
        replaced = not self._intact()
        if replaced:
            log.info("an inference replica was replaced: forming the weight-transfer group again")
            await self._form_group(self.rejoin_timeout_s)
        if self.current:
            return
        if not await self._push():
            await asyncio.sleep(RETRY_PAUSE_S)
        elif replaced:
            log.info(f"inference replicas caught up to weight version {self.trainer_version}")

    def _serving(self) -> list[str]:
        """Names of the replicas that may serve now: in the group, healthy, on the current weights."""
        if not self.current:
            return []
        names = []
        for replica, member in self.members.items():
            peer = self._leader(replica)
            if peer is not None and (peer.host, peer.pid) == member:
                names.append(peer.name)
        return names

    async def _call_inference(self, endpoint: Endpoint[Req, Rep], request: Req) -> Rep:
        """One call to the least busy serving replica; a replica lost meanwhile is replaced, caught up
        and the call made again (generate and logprobs are idempotent: same seeds, same weights)."""
        from hpcrl.bus.errors import PeerDeadError

        loop = asyncio.get_running_loop()
        deadline = loop.time() + CALL_TIMEOUT_S + self.rejoin_timeout_s
        while True:
            serving = self._serving()
            if not serving:
                async with self._trainer_turn:
                    await self._catch_up()
                continue
            name = min(serving, key=self.head.outstanding)
            try:
                return await self.inference.request(name, endpoint, request, timeout=CALL_TIMEOUT_S)
            except PeerDeadError as err:
                if loop.time() > deadline:
                    raise
                log.warning(f"{endpoint.name} on {name} lost ({err}); it goes to a replica on current weights")
                await asyncio.sleep(RETRY_PAUSE_S)

    # -- Ports ---------------------------------------------------------------------------------
    async def generate(self, prompts: list[Prompt], *, n: int, seed: int,
                       temperature: float | None = None) -> list[list[Completion]]:
        size = -(-len(prompts) // self.replicas)
        chunks = [(k, prompts[k:k + size]) for k in range(0, len(prompts), size)]
        # An evaluation's temperature (0.0: greedy); rollouts send none and sample at inference.temperature.
        parts = await asyncio.gather(*(
            self._call_inference(INF.generate, GenerateCall(prompts=chunk, n=n, seed=seed, offset=offset,
                                                            temperature=temperature))
            for offset, chunk in chunks))
        return [group for part in parts for group in part]

    async def generate_turn(self, prompts: list[Prompt], *, n: int, seed: int, max_tokens: list[int],
                            temperature: float | None = None) -> list[list[Completion]]:
        return await self._call_inference(INF.generate, GenerateCall(prompts=prompts, n=n, seed=seed, offset=0,
                                                                     max_tokens=list(max_tokens),
                                                                     temperature=temperature))

    async def env_reset(self, requests: list[EnvRequest]) -> list[EnvReply]:
        return await self._env(REW.env_reset, requests)

    async def env_step(self, requests: list[EnvRequest]) -> list[EnvReply]:
        return await self._env(REW.env_step, requests)

    async def _env(self, endpoint: Endpoint[EnvCall, list[EnvReply]], requests: list[EnvRequest]) -> list[EnvReply]:
        # A worker answers its share one episode after another, each within env.step_timeout_s.
        timeout = CALL_TIMEOUT_S + self.config.env.step_timeout_s * len(requests)
        return await self._call_reward(endpoint, EnvCall(requests=requests), timeout=timeout)

    async def score(self, samples: list[Sample]) -> list[RewardResult]:
        if self.local_scorer is not None:
            return await asyncio.to_thread(self.local_scorer.score, samples)
        return await self._call_reward(REW.score, ScoreCall(samples=samples), timeout=CALL_TIMEOUT_S)

    async def _call_reward(self, endpoint: Endpoint[Req, Rep], request: Req, *, timeout: float) -> Rep:
        """A call to the least busy reward task. With spare nodes, a call that finds none left (its node lost,
        the head starting it again on a spare) waits for the newcomer and is made again there: every reward
        call holds all it needs, and a lost call's answer never reached the head, so nothing is scored twice."""
        from hpcrl.bus.errors import NoHealthyReplicaError

        while True:
            try:
                return await self.reward.route(endpoint, request, timeout=timeout)
            except NoHealthyReplicaError:
                if not self.config.cluster.spare_nodes:
                    raise
                log.warning(f"{endpoint.name}: no reward task serves; waiting for the one started again")
                await asyncio.sleep(RETRY_PAUSE_S)  # the lost task may still count as healthy for a moment
                await self.head.wait_for_peers(REWARD, 1, timeout=self.rejoin_timeout_s)

    async def train_step(self, batch: TrainBatch, *, step: int) -> dict[str, float]:
        async with self._trainer_turn:
            loop = asyncio.get_running_loop()
            started, deadline = loop.time(), self.step_deadline.seconds()
            try:
                results = await self.trainer.call_all(0, TRN.train_step, TrainStepCall(batch=batch, step=step),
                                                      timeout=deadline)
            except DeadlineExceeded as err:
                raise StepStuck(f"train step {step} did not finish within its deadline of "
                                f"{self.step_deadline.describe()}: a trainer rank is stuck (a collective some rank "
                                f"never joined?) ({err})") from None
            self.step_deadline.observe(loop.time() - started)
            self.trainer_version = step + 1  # the replicas get it at the next push
        return _rank0(results, TRN.train_step)

    async def sync_weights(self, version: int) -> None:
        async with self._trainer_turn:
            self.trainer_version, self.current = version, False
            await self._catch_up()  # a replica lost meanwhile: the next inference call catches up

    async def trainer_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        async with self._trainer_turn:
            results = await self.trainer.call_all(0, TRN.logprobs, SequencesCall(sequences=sequences),
                                                  timeout=CALL_TIMEOUT_S)
        return _rank0(results, TRN.logprobs)

    async def inference_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        return await self._call_inference(INF.logprobs, SequencesCall(sequences=sequences))

    # -- checkpoints ---------------------------------------------------------------------------
    async def save_trainer(self, directory) -> None:
        async with self._trainer_turn:
            await self.trainer.call_all(0, TRN.save, CheckpointCall(directory=str(directory)), timeout=CALL_TIMEOUT_S)

    def close(self) -> None:
        if self.local_scorer is not None:
            self.local_scorer.close()

    async def load_trainer(self, directory) -> None:
        async with self._trainer_turn:
            results = await self.trainer.call_all(0, TRN.load, CheckpointCall(directory=str(directory)),
                                                  timeout=CALL_TIMEOUT_S)
            self.trainer_version = results[0].step
