"""The control bus and a job's group processes in memory, under the real BusPorts and Service.

    head = FakeHead()
    job = FakeJob(config, head)              # trainer ranks, inference replicas and reward, registered
    ports = BusPorts(config, head, store="tcp://127.0.0.1:29500")
    await ports.connect(timeout=5)
    job.kill_replica(1)                      # the head counts it dead; the launcher starts it again

FakeHead has the methods of the head's end of the bus (hpcrl.bus's Router) that BusPorts and Service
call, and keeps their contract wherever those can tell: the same errors from hpcrl.bus.errors
(PeerDeadError when a peer is dead or dies during a call, RemoteError when an endpoint raised,
UnknownPeerError, UnknownEndpointError, DeadlineExceeded), calls running concurrently as tasks,
arguments and results crossing as msgpack, a generation bumped at every change of the peer table,
unhealthy hooks run from the loop, and a new registration under a name replacing the old process.

FakeJob's processes serve the endpoints of the bus's contract (hpcrl.contract.endpoints: FakeHead refuses
a request that does not match its endpoint's request type with BadRequest, as a task's worker does; the
head's GroupClient checks the replies) over the parts of fake_ports.py (one
FakeTrainer for the trainer ranks, a FakeEngine per inference process, a FakeReward). Their
weight-transfer group is strict, as gloo is: it forms once every trainer rank and replica joined
the same generation; a push completes once every member took part; a lost member makes the
trainer's sends fail (a dropped connection) and leaves the survivors' receives hanging until the
group is formed again; a process outside the current group cannot receive. A restarted replica
is a new process (same host, new pid) with a fresh engine on the initial weights, version 0.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgpack
from fake_ports import (
    DIGIT0,
    EPISODE_DIGIT0,
    FakeEngine,
    FakeEnvironment,
    FakeGroupError,
    FakeReward,
    FakeTrainer,
)

from hpcrl.bus.config import BusConfig
from hpcrl.bus.errors import (
    BusError,
    DeadlineExceeded,
    PeerDeadError,
    RemoteError,
    UnknownEndpointError,
    UnknownPeerError,
)
from hpcrl.bus.peer import PeerInfo
from hpcrl.config.groups import REWARD
from hpcrl.config.schema import Config
from hpcrl.contract.endpoints import Endpoint as Declared
from hpcrl.contract.endpoints import InferenceEndpoints, RewardEndpoints, TrainerEndpoints
from hpcrl.contract.endpoints import endpoint as declared
from hpcrl.data.prompts import Prompt
from hpcrl.env.types import EnvRequest
from hpcrl.plan.for_config import plan_for_config
from hpcrl.reward.types import Sample

RUN_ID = "fake-run"
Endpoint = Callable[[Any], Any]  # async (args) -> result


def _wire(value: Any) -> Any:
    """What the other end sees of `value` (msgpack both ways; a value msgpack refuses fails the call)."""
    return msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False)


@dataclass(eq=False)
class _Peer:
    info: PeerInfo
    endpoints: dict[str, tuple[Endpoint, bool]]
    """name -> (endpoint, idempotent)."""
    healthy: bool = True
    dead_reason: str = ""
    calls: set[asyncio.Future] = field(default_factory=set)
    tasks: set[asyncio.Task] = field(default_factory=set)


class FakeHead:
    """The head's end of the bus, in memory (see the module docstring)."""

    def __init__(self, config: BusConfig | None = None) -> None:
        self.config = config or BusConfig()
        self.generation = 0
        self._peers: dict[str, _Peer] = {}
        self._listeners: list[Callable[[PeerInfo], Any]] = []
        self._changed = asyncio.Event()

    # -- the peer table ----------------------------------------------------------------------------
    def register(self, info: PeerInfo, endpoints: dict[Declared, Endpoint]) -> None:
        """A worker registers (ready to serve); it replaces a live process of the same name, without hooks."""
        previous = self._peers.get(info.name)
        if previous is not None and previous.healthy:
            self._declare_dead(previous, "replaced by a new registration of the same peer", notify=False)
        self._peers[info.name] = _Peer(info=info, endpoints={e.name: (fn, e.idempotent) for e, fn in endpoints.items()})
        self._bump()

    def mark_dead(self, name: str, reason: str) -> bool:
        """Declare a peer dead now (the launcher saw its process end); False if it was not alive."""
        peer = self._peers.get(name)
        alive = peer is not None and peer.healthy
        if alive:
            self._declare_dead(peer, reason)
        return alive

    # -- what BusPorts and Service ask of the peer table -------------------------------------------
    def peers(self, group: str | None = None, *, healthy_only: bool = True) -> list[PeerInfo]:
        return [p.info for p in self._peers.values() if group in (None, p.info.group) and (p.healthy or not healthy_only)]

    def is_healthy(self, name: str) -> bool:
        return name in self._peers and self._peers[name].healthy

    def outstanding(self, name: str) -> int:
        return len(self._peers[name].calls) if name in self._peers else 0

    def is_idempotent(self, name: str, endpoint: str) -> bool:
        return name in self._peers and self._peers[name].endpoints.get(endpoint, (None, False))[1]

    def subscribe(self, on_unhealthy: Callable[[PeerInfo], Any]) -> None:
        self._listeners.append(on_unhealthy)

    async def wait_for_peers(self, group: str, replicas: int = 1, *, timeout: float) -> list[int]:
        """The replicas of `group` with every rank registered and healthy, once there are `replicas`."""
        async def enough() -> list[int]:
            while True:
                infos = self.peers(group)
                done = sorted({p.replica for p in infos
                               if sum(q.replica == p.replica for q in infos) == p.replica_ranks})
                if len(done) >= replicas:
                    return done
                await self._changed.wait()
        try:
            return await asyncio.wait_for(enough(), timeout)
        except TimeoutError:
            raise BusError(f"group {group}: fewer than {replicas} replicas registered within {timeout} s") from None

    # -- calls -------------------------------------------------------------------------------------
    async def request(self, peer: str, endpoint: str, args: Any = None, *, buffers=(),
                      timeout: float | None = None) -> Any:
        state = self._state(peer)
        self._check_callable(state, endpoint)
        timeout = self.config.default_deadline if timeout is None else timeout
        if timeout <= 0:
            raise DeadlineExceeded(peer, endpoint, timeout)
        return await self._call(state, endpoint, args, timeout)

    def start_fanout(self, peers: list[str], endpoint: str, args: Any = None, *, buffers=(),
                     timeout: float | None = None) -> asyncio.Future:
        """A future of every peer's result in `peers` order, or of the first error (the rest are abandoned)."""
        states = [self._state(name) for name in peers]
        for state in states:
            self._check_callable(state, endpoint)
        timeout = self.config.default_deadline if timeout is None else timeout
        if timeout <= 0 and states:
            raise DeadlineExceeded(states[0].info.name, endpoint, timeout)
        fan = asyncio.get_running_loop().create_future()
        calls = [self._call(state, endpoint, args, timeout) for state in states]
        if not calls:
            fan.set_result([])

        def settle(call: asyncio.Future) -> None:
            error = None if call.cancelled() else call.exception()
            if fan.done():
                return
            if error is not None:
                fan.set_exception(error)
            elif all(c.done() for c in calls):
                fan.set_result([c.result() for c in calls])
        for call in calls:
            call.add_done_callback(settle)
        fan.add_done_callback(lambda _fan: [c.cancel() for c in calls if not c.done()])
        return fan

    # -- inside ------------------------------------------------------------------------------------
    def _state(self, name: str) -> _Peer:
        peer = self._peers.get(name)
        if peer is None:
            raise UnknownPeerError(name, "has not registered with the head")
        return peer

    @staticmethod
    def _check_callable(peer: _Peer, endpoint: str) -> None:
        if not peer.healthy:
            raise PeerDeadError(peer.info.name, peer.dead_reason)
        if endpoint not in peer.endpoints:
            raise UnknownEndpointError(peer.info.name, endpoint, list(peer.endpoints))

    def _call(self, peer: _Peer, endpoint: str, args: Any, timeout: float) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        serve, _ = peer.endpoints[endpoint]
        sent, declaration = _wire(args), declared(peer.info.group, endpoint)
        name = peer.info.name

        async def run() -> None:  # the worker's side: it answers with the result, or what its endpoint raised
            try:
                declaration.decode_request(sent)  # BadRequest, as serve_endpoints refuses it
                result = _wire(await serve(sent))
            except Exception as exc:  # noqa: BLE001 - as a worker does: any error of its endpoint is the reply
                if not future.done():
                    future.set_exception(RemoteError(name, endpoint, type(exc).__name__, str(exc)))
            else:
                if not future.done():
                    future.set_result(result)

        task = loop.create_task(run())
        peer.tasks.add(task)
        task.add_done_callback(peer.tasks.discard)
        peer.calls.add(future)
        timer = loop.call_later(timeout, lambda: future.done() or future.set_exception(
            DeadlineExceeded(name, endpoint, timeout)))
        future.add_done_callback(lambda _f: (timer.cancel(), peer.calls.discard(future)))
        return future

    def _declare_dead(self, peer: _Peer, reason: str, *, notify: bool = True) -> None:
        peer.healthy, peer.dead_reason = False, reason
        for call in list(peer.calls):
            if not call.done():
                call.set_exception(PeerDeadError(peer.info.name, reason))
        for task in list(peer.tasks):  # the process is gone, and what it was doing with it
            task.cancel()
        loop = asyncio.get_running_loop()
        for listener in self._listeners if notify else ():
            loop.call_soon(self._run_hook, listener, peer.info)
        self._bump()

    @staticmethod
    def _run_hook(hook: Callable[[PeerInfo], Any], info: PeerInfo) -> None:
        result = hook(info)
        if asyncio.iscoroutine(result):
            asyncio.ensure_future(result)

    def _bump(self) -> None:
        self.generation += 1
        self._changed.set()
        self._changed = asyncio.Event()


# -- the job's processes --------------------------------------------------------------------------
@dataclass(eq=False)
class _Round:
    """One push of one weight version to the group's members."""

    sent: asyncio.Future
    received: asyncio.Future
    arrived: set = field(default_factory=set)


class _TransferGroup:
    """The weight-transfer group of the job's processes (see the module docstring)."""

    def __init__(self, trainer: FakeTrainer) -> None:
        self.trainer = trainer
        self.generation = -1
        self.members: set = set()
        self.expected = 0
        self.formed: asyncio.Future | None = None
        self.lost: set = set()
        self.rounds: dict[int, _Round] = {}

    async def join(self, process, generation: int, expected: int) -> None:
        if generation < self.generation:
            raise FakeGroupError(f"{process.name} joined generation {generation}; the group is at {self.generation}")
        if generation > self.generation:
            self._tear_down(f"the weight-transfer group was formed again (generation {generation})")
            self.generation, self.members, self.lost, self.rounds = generation, set(), set(), {}
            self.expected, self.formed = expected, asyncio.get_running_loop().create_future()
        self.members.add(process)
        if len(self.members) == self.expected:
            self.formed.set_result(None)
        await asyncio.shield(self.formed)

    async def take_part(self, process, version: int, *, sends: bool) -> list[float]:
        """Send (a trainer rank) or receive (a replica) weight `version`; the weights, once every member took part."""
        if process not in self.members or self.formed is None or not self.formed.done():
            raise FakeGroupError(f"{process.name} (pid {process.pid}) is not in the weight-transfer group of "
                                 f"generation {self.generation}: connect_transfer first")
        part = self.rounds.get(version)
        if part is None or part.sent.done():
            loop = asyncio.get_running_loop()
            part = self.rounds[version] = _Round(sent=loop.create_future(), received=loop.create_future())
        part.arrived.add(process)
        self._settle(part)
        return await asyncio.shield(part.sent if sends else part.received)

    def lose(self, process) -> None:
        """A member's process died: the trainer's sends to it fail."""
        if process in self.members:
            self.lost.add(process)
            if self.formed is not None and not self.formed.done():
                self.formed.set_exception(ConnectionError(f"{process.name} left the rendezvous"))
            for part in self.rounds.values():
                self._settle(part)

    def _settle(self, part: _Round) -> None:
        if part.sent.done():
            return
        if part.arrived >= self.members:
            weights = list(self.trainer.weights)
            part.sent.set_result(weights)
            part.received.set_result(weights)
        elif self.lost:
            dead = sorted(p.name for p in self.lost)
            part.sent.set_exception(ConnectionError(f"gloo: connection reset by {', '.join(dead)}"))

    def _tear_down(self, reason: str) -> None:
        for part in self.rounds.values():
            for future in (part.sent, part.received):
                if not future.done():
                    future.set_exception(ConnectionError(reason))
                    future.exception()  # retrieved: nobody may be waiting any more


class FakeReplica:
    """One inference process (an inference task's vLLM engine), serving the inference endpoints."""

    def __init__(self, job: FakeJob, replica: int, pid: int) -> None:
        self.job, self.replica, self.pid = job, replica, pid
        self.info = PeerInfo(run_id=RUN_ID, group="inference", replica=replica, host=f"node-i{replica}", pid=pid)
        self.name = f"{self.info.name}@{pid}"
        self.engine = FakeEngine(digit0=job.trainer.digit0, turn_end=job.turn_end)

    def endpoints(self) -> dict[Declared, Endpoint]:
        return {InferenceEndpoints.generate: self.generate, InferenceEndpoints.logprobs: self.logprobs,
                InferenceEndpoints.connect_transfer: self.connect_transfer,
                InferenceEndpoints.receive_weights: self.receive_weights, InferenceEndpoints.status: self.status}

    async def generate(self, args: dict) -> list[list[dict]]:
        self.job.on_call(self, "generate", args)
        await asyncio.sleep(0)
        prompts = [Prompt(**p) for p in args["prompts"]]
        if args.get("max_tokens") is not None:  # a turn of episodes (BusPorts.generate_turn)
            groups = self.engine.generate_turn(prompts, n=args["n"], seed=args["seed"], max_tokens=args["max_tokens"],
                                               temperature=args.get("temperature"))
        else:
            groups = self.engine.generate(prompts, n=args["n"], seed=args["seed"], offset=args["offset"],
                                          temperature=args.get("temperature"))
        return [[asdict(c) for c in group] for group in groups]

    async def logprobs(self, args: dict) -> list[list[float]]:
        await asyncio.sleep(0)
        return self.engine.logprobs(args["sequences"])

    async def connect_transfer(self, args: dict) -> dict:
        self.job.check_digest(self, args)
        await self.job.transfer.join(self, args["generation"], self.job.transfer_size)
        return {"replica": self.replica}

    async def receive_weights(self, args: dict) -> dict:
        self.job.on_call(self, "receive_weights", args)
        await asyncio.sleep(0)
        weights = await self.job.transfer.take_part(self, args["version"], sends=False)
        self.engine.receive(args["version"], weights)
        return {"replica": self.replica, "weight_version": self.engine.version}

    async def status(self, args: dict) -> dict:
        return {"replica": self.replica, "weight_version": self.engine.version}


class FakeTrainerRank:
    """One trainer rank; the ranks share one FakeTrainer (the sharded model), rank 0 answers for it."""

    def __init__(self, job: FakeJob, rank: int, pid: int) -> None:
        self.job, self.rank, self.pid = job, rank, pid
        self.info = PeerInfo(run_id=RUN_ID, group="trainer", replica=0, rank=rank, replica_ranks=job.world,
                             host=f"node-t{rank}", pid=pid)
        self.name = self.info.name

    def endpoints(self) -> dict[Declared, Endpoint]:
        return {TrainerEndpoints.connect_transfer: self.connect_transfer, TrainerEndpoints.train_step: self.train_step,
                TrainerEndpoints.send_weights: self.send_weights, TrainerEndpoints.logprobs: self.logprobs,
                TrainerEndpoints.save: self.save, TrainerEndpoints.load: self.load}

    async def connect_transfer(self, args: dict) -> dict:
        self.job.check_digest(self, args)
        await self.job.transfer.join(self, args["generation"], self.job.transfer_size)
        return {"rank": self.rank}

    async def train_step(self, args: dict) -> dict | None:
        await asyncio.sleep(0)
        return self.job.trainer.train(args["batch"], args["step"]) if self.rank == 0 else None

    async def send_weights(self, args: dict) -> dict:
        await self.job.transfer.take_part(self, args["version"], sends=True)
        return {"bytes": 24, "seconds": 0.0}

    async def logprobs(self, args: dict) -> list[list[float]] | None:
        await asyncio.sleep(0)
        return self.job.trainer.logprobs(args["sequences"]) if self.rank == 0 else None

    async def save(self, args: dict) -> dict:
        if self.rank == 0:
            self.job.trainer.save(Path(args["directory"]))
        return {"rank": self.rank}

    async def load(self, args: dict) -> dict:
        if self.rank == 0:
            self.job.trainer.load(Path(args["directory"]))
        return {"step": self.job.trainer.version}


class FakeJob:
    """The group processes of a job on a FakeHead, and a launcher that starts a lost replica again.

    `on_call(process, endpoint, args)` runs at the start of generate and receive_weights (a test
    kills a replica there to lose it mid-call). `replicas` holds the live process of each replica,
    `processes` every inference process ever started.
    """

    def __init__(self, config: Config, head: FakeHead, *, reward: FakeReward | None = None,
                 env: FakeEnvironment | None = None, relaunch: bool = True) -> None:
        """With `env` the reward process serves its environment too, and the model's ids are the tiny tokenizer's
        (as FakePorts(env=...))."""
        self.config, self.head = config, head
        self.digest = plan_for_config(config).digest
        self.world = config.trainer.world_size
        self.transfer_size = self.world + config.inference.replicas
        self.trainer = FakeTrainer(digit0=EPISODE_DIGIT0 if env is not None else DIGIT0)
        self.turn_end = 102 if env is not None else None
        self.env = env or FakeEnvironment()
        self.transfer = _TransferGroup(self.trainer)
        self.reward = reward or FakeReward()
        self.on_call: Callable[[Any, str, dict], None] = lambda process, endpoint, args: None
        self._pids = itertools.count(1000)
        self.ranks = [FakeTrainerRank(self, rank, next(self._pids)) for rank in range(self.world)]
        for rank in self.ranks:
            head.register(rank.info, rank.endpoints())
        head.register(PeerInfo(run_id=RUN_ID, group=REWARD, replica=0, host="node-r0", pid=next(self._pids)),
                      {RewardEndpoints.score: self._score, RewardEndpoints.env_reset: self._env_reset,
                       RewardEndpoints.env_step: self._env_step})
        self.replicas: dict[int, FakeReplica] = {}
        self.processes: list[FakeReplica] = []
        for replica in range(config.inference.replicas):
            self.start_replica(replica)
        if relaunch:
            head.subscribe(self._relaunch)

    def start_replica(self, replica: int) -> FakeReplica:
        process = FakeReplica(self, replica, next(self._pids))
        self.replicas[replica] = process
        self.processes.append(process)
        self.head.register(process.info, process.endpoints())
        return process

    def kill_replica(self, replica: int, reason: str = "its process was killed (SIGKILL)") -> FakeReplica:
        """The replica's process dies: the head learns it at once, its transfer-group peers see it go."""
        process = self.replicas[replica]
        self.head.mark_dead(process.info.name, reason)
        self.transfer.lose(process)
        return process

    def check_digest(self, process, args: dict) -> None:
        if args["digest"] != self.digest:
            raise FakeGroupError(f"{process.name} planned the weight transfer as {self.digest[:12]}, the head as "
                                 f"{args['digest'][:12]}")

    def _relaunch(self, info: PeerInfo) -> None:
        if info.group == "inference":
            self.start_replica(info.replica)

    async def _env_reset(self, args: dict) -> list[dict]:
        await asyncio.sleep(0)
        return [r.to_dict() for r in self.env.reset([EnvRequest(**q) for q in args["requests"]])]

    async def _env_step(self, args: dict) -> list[dict]:
        await asyncio.sleep(0)
        return [r.to_dict() for r in self.env.step([EnvRequest(**q) for q in args["requests"]])]

    async def _score(self, args: dict) -> list[dict]:
        await asyncio.sleep(0)
        return [asdict(r) for r in self.reward.score([Sample(**s) for s in args["samples"]])]
