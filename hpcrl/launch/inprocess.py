"""Every group of a run in this one process: `hpcrl run CONFIG`, and the loop's end-to-end test bed.

    trainer    one TrainerEngine rank in a process group of one (gloo on CPU, NCCL on a GPU): FSDP2 and
               its mixed precision, as on the ranks of a job; its calls run on one engine thread
    inference  one VllmEngine (its own engine-core / worker processes, as vLLM always starts them)
    reward     a RewardPool (spawned worker processes, per-sample timeout), or a reward model (its own
               vLLM engine; on CPU unless [groups.reward] gpus_per_node > 0)
    env        [env]: an EnvPool (hpcrl.env.pool: env.workers processes of its own, per-step timeout)
    weights    trainer -> vLLM workers through hpcrl's transfer plan and weight-transfer engine over
               gloo: the same planner, digest handshake and receive path as in a heterogeneous job

The Controller drives these through the same `Ports` as it drives the groups of a job; blocking
calls run in threads so that generation of the next batch overlaps the training step.

    hpcrl run configs/tiny_grpo.toml        # or: python -m hpcrl run configs/tiny_grpo.toml (hpcrl.cli.run_cmd)
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from hpcrl.config.schema import Config
from hpcrl.data.prompts import Prompt
from hpcrl.env.types import EnvReply, EnvRequest
from hpcrl.errors import HpcrlError
from hpcrl.inference.types import Completion
from hpcrl.reward.model import make_scorer, reward_device
from hpcrl.reward.types import RewardResult, Sample
from hpcrl.rl.controller import Controller
from hpcrl.rl.loop import run_loop
from hpcrl.rl.startup import StartupClock
from hpcrl.roles.base import DeviceTable, EngineThread
from hpcrl.roles.trainer import local_tensors
from hpcrl.trainer.types import TrainBatch

if TYPE_CHECKING:
    from hpcrl.rendezvous.meet import ServedStore
    from hpcrl.trainer import EngineOptions, TrainerEngine

log = logging.getLogger(__name__)
T = TypeVar("T")


def split_cpus(cpus: list[int], tensor_parallel: int) -> tuple[str, list[int]]:
    """Share this process's CPUs between vLLM's workers and the trainer, which run at the same time
    (generation of the next batch overlaps the train step): (VLLM_CPU_OMP_THREADS_BIND for the
    first half, split between the TP ranks; the other half for the trainer). With one CPU both get it.

    Overlapping threads on the same cores cost far more than they bring: on 2 cores, a tiny train
    step took 92 ms with 1 torch thread and 759 ms with 2 while another process kept the cores busy."""
    cpus = sorted(cpus)
    half = max(1, (len(cpus) + 1) // 2)
    inference, trainer = cpus[:half], cpus[half:] or cpus[-1:]
    per_rank = max(1, len(inference) // tensor_parallel)
    groups = [inference[i * per_rank:(i + 1) * per_rank] or inference[-1:] for i in range(tensor_parallel)]
    return "|".join(",".join(map(str, g)) for g in groups), trainer


class OneProcessTrainer:
    """`hpcrl run`'s trainer: one rank on its own engine thread (on CUDA device 0 when trainer.gpus_per_node
    > 0). Mixed precision (bf16 on a GPU) is FSDP2's, so then the rank forms a torch.distributed group of
    one and is sharded as in a job; a float32 run (every CPU run) stays unsharded, which costs FSDP2's
    wrappers nothing (a tiny CPU step: 16 ms unsharded, 36 ms as a world of 1). `overrides` go to
    EngineOptions (a test trains bfloat16 on CPU). close() leaves the group."""

    def __init__(self, config: Config, *, devices: DeviceTable | None = None, cpus: list[int] | None = None,
                 **overrides: Any) -> None:
        from hpcrl.trainer import EngineOptions

        options = EngineOptions.from_config(config, **overrides)
        self.thread = EngineThread("hpcrl-trainer", device=0 if options.device == "cuda" else None, devices=devices)
        try:
            if cpus:  # its thread on these CPUs, and torch's intra-op threads (this process's) one per CPU
                self.thread.call(_use_cpus, cpus)
            self.engine: TrainerEngine = self.thread.call(self._start, options)
        except BaseException:
            self.thread.close()
            raise

    @staticmethod
    def _start(options: EngineOptions) -> TrainerEngine:
        from hpcrl.trainer import TrainerEngine, group

        if options.dtype != "float32":  # mixed precision is FSDP2's: a group of one
            group.join_alone(device=options.device)
        try:
            return TrainerEngine(options)
        except BaseException:
            group.leave()
            raise

    def close(self) -> None:
        from hpcrl.trainer import group

        self.thread.close()
        group.leave()


@dataclass
class _Outcome(Generic[T]):
    value: T | None = None
    error: BaseException | None = None


def _outcome(fn: Callable[..., T], *args: Any, **kwargs: Any) -> _Outcome[T]:
    """fn's value, or the error it raised: a part that failed must not hide the parts that started."""
    try:
        return _Outcome(value=fn(*args, **kwargs))
    except BaseException as err:  # noqa: BLE001 - raised again once every started part is registered for closing
        return _Outcome(error=err)


def _env_pool(config: Config) -> Any:
    """[env]'s environment workers: processes of their own, as in a job's reward group (hpcrl.env.pool)."""
    from hpcrl.env.pool import EnvPool  # type: ignore[import-not-found,import-untyped,unused-ignore]  # env side

    return EnvPool(config.env)


def _use_cpus(cpus: list[int]) -> None:
    import torch

    os.sched_setaffinity(0, cpus)  # this thread's (Linux: pid 0 is the calling thread)
    torch.set_num_threads(len(cpus))


def _use_cpus_everywhere(cpus: list[int]) -> None:
    """Every thread of this process on `cpus` (the trainer's share: threads started later inherit it
    from the thread that starts them), so that vLLM's engine core has its share to itself.

    Besides the trainer, this process runs the controller, vLLM's client (it queues a step's 128
    requests and reads their outputs) and the reward pool's reader. Left free, the scheduler put them
    on either CPU: beside the engine core they slowed generation, and the trainer waited on the GIL
    for them. Two pairs of runs on the 2-core VM: median step 55.8 / 53.8 ms free, 53.6 / 52.2 ms
    pinned; all but the trainer on vLLM's CPU instead: 70 ms. Called once every part is up: vLLM's
    engine-core process, started from this one, must not inherit the trainer's CPUs."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


class InProcessPorts:
    """The `Ports` of hpcrl.rl.controller, served by engines living in this process."""

    def __init__(self, config: Config) -> None:
        if config.trainer.world_size != 1 or config.inference.replicas != 1:
            raise HpcrlError(f"running in one process needs 1 trainer rank and 1 inference replica, the config has "
                             f"{config.trainer.world_size} and {config.inference.replicas}. Fix: --set "
                             "trainer.nodes=1 --set trainer.ranks_per_node=1 --set inference.replicas=1, or submit "
                             "the run as a job (hpcrl submit)")
        transport = config.one_process_weight_transport()  # before anything loads
        self.config = config
        self._inference_turn = threading.Lock()
        self.startup = StartupClock()
        """Seconds of each part of the start-up (hpcrl.rl.startup): the run log and the first step's metrics."""
        # Everything below is ended by close() in the reverse order of its making (see close()),
        # and by this stack at once when making the next part fails.
        self._closing = ExitStack()
        try:
            self._start(config, transport)
        except BaseException:
            self._closing.close()
            raise

    def _start(self, config: Config, transport: str) -> None:
        """Start the parts at once: vLLM here (its engine processes do the work, this thread mostly
        waits), the trainer and a reward function's pool on threads of their own; then join both
        ends of the weight-transfer group. Each part's seconds go to self.startup."""
        import torch  # noqa: F401 - here, before the parts' threads import their libraries on top of it at once

        from hpcrl.inference.engine import VllmEngine
        from hpcrl.plan.for_config import describe_plan, plan_for_config
        from hpcrl.rendezvous.meet import serve_private_store

        # The transfer group's rendezvous store (no TCP port: an ipc socket in a private directory, and
        # a secret vLLM's workers find through the environment): made first, so that it outlives every
        # client of it, the trainer's end of the group and vLLM's workers.
        self._store: ServedStore | None = serve_private_store()
        self._closing.callback(self._release_store)
        clock = self.startup
        scorer = lambda: make_scorer(config.reward, dtype=config.model.dtype, device=reward_device(  # noqa: E731
            config.group("reward").gpus_per_node, os.environ.get("CUDA_VISIBLE_DEVICES")))
        log.info(f"starting vLLM, the trainer ({config.model.path}) and the reward "
                 f"{'pool' if config.reward.kind == 'function' else 'model'} in parallel")
        binding, cpus = None, None
        if config.trainer.gpus_per_node == 0 and config.inference.gpus_per_node == 0:
            binding, cpus = split_cpus(list(os.sched_getaffinity(0)), config.inference.tensor_parallel)
            binding = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or binding  # the caller's choice stands
            log.info(f"CPUs: vLLM's workers {binding}, the trainer {','.join(map(str, cpus))}")
        with ThreadPoolExecutor(2, thread_name_prefix="hpcrl-start") as pool:
            trainer = pool.submit(clock.timed, "trainer", OneProcessTrainer, config, cpus=cpus)
            # A reward model is a vLLM engine of its own: two vLLM engines are not started at once.
            rewards = pool.submit(clock.timed, "reward", scorer) if config.reward.kind == "function" else None
            inference = _outcome(clock.timed, "inference", VllmEngine.from_config, config, weight_transfer=True,
                                 cpu_binding=binding)
            if rewards is None and inference.value is not None:
                rewards = pool.submit(clock.timed, "reward", scorer)
            built, scoring = _outcome(trainer.result), _outcome(rewards.result) if rewards is not None else None
        # Closed in the reverse order (see close()): whatever started is ended, also when another part failed.
        if built.value is not None:
            self._trainer = built.value
            self._closing.callback(self._trainer.close)
            self.trainer = self._trainer.engine
            self.on_trainer = self._trainer.thread
        if inference.value is not None:
            self.inference = inference.value
            self._closing.callback(self.inference.close)
        if scoring is not None and scoring.value is not None:
            self.rewards = scoring.value
            self._closing.callback(self.rewards.close)
        for failed in (built.error, inference.error, scoring.error if scoring is not None else None):
            if failed is not None:
                raise failed
        if config.env.environment:
            self.environments = clock.timed("env", _env_pool, config)
            self._closing.callback(self.environments.close)
        self.plan = plan_for_config(config)
        log.info(describe_plan(self.plan))  # the digest `hpcrl plan --transfer` prints for this config
        clock.timed("weights", self._join_transfer, transport)
        if cpus:
            _use_cpus_everywhere(cpus)
        log.info(f"vLLM engine, trainer and reward {config.reward.kind} up, weight transfer joined ({transport}): "
                 + ", ".join(f"{part} {s:.1f} s" for part, s in clock.parts().items()))

    def _join_transfer(self, transport: str) -> None:
        from hpcrl.transfer.trainer import TrainerSender

        assert self._store is not None
        store, plan = self._store.address, self.plan
        # Both ends must join the transfer group at once: vLLM's side blocks in its workers.
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(self.inference.connect_transfer, plan, store=store,
                                 transport=transport, timeout_s=120)
            self.sender = self.on_trainer.call(
                lambda: TrainerSender.connect(plan, rank=0, store=store, timeout_s=120, transport=transport))
            self._closing.callback(self.sender.close)
            joined.result()

    # -- Ports ---------------------------------------------------------------------------------
    def _on_inference(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn on the vLLM engine, one call at a time: vLLM's LLM is not thread-safe (two generate calls at once,
        e.g. two chunks' turns of episodes, abort the process in ZeroMQ), as a replica's engine thread is not."""
        with self._inference_turn:
            return fn(*args, **kwargs)

    async def generate(self, prompts: list[Prompt], *, n: int, seed: int,
                       temperature: float | None = None) -> list[list[Completion]]:
        return await asyncio.to_thread(self._on_inference, self.inference.generate, prompts, n=n, seed=seed,
                                       temperature=temperature)

    async def generate_turn(self, prompts: list[Prompt], *, n: int, seed: int, max_tokens: list[int],
                            temperature: float | None = None) -> list[list[Completion]]:
        return await asyncio.to_thread(self._on_inference, self.inference.generate, prompts, n=n, seed=seed,
                                       temperature=temperature, max_tokens=max_tokens)

    async def env_reset(self, requests: list[EnvRequest]) -> list[EnvReply]:
        return await asyncio.to_thread(self.environments.reset, requests)

    async def env_step(self, requests: list[EnvRequest]) -> list[EnvReply]:
        return await asyncio.to_thread(self.environments.step, requests)

    async def score(self, samples: list[Sample]) -> list[RewardResult]:
        return await asyncio.to_thread(self.rewards.score, samples)

    def _train(self, batch: TrainBatch) -> dict[str, float]:
        metrics = self.trainer.train_step(batch.rows()).as_dict()
        metrics.pop("step")
        return metrics

    async def train_step(self, batch: TrainBatch, *, step: int) -> dict[str, float]:
        return await self.on_trainer.run(self._train, batch)

    def _sync(self, version: int) -> None:
        shards = local_tensors(self.trainer)
        # Both ends at once: vLLM's workers block in the transfer group until the trainer has sent.
        with ThreadPoolExecutor(1) as pool:
            received = pool.submit(self.inference.receive_weights, version)
            self.sender.send(shards)
            received.result()

    async def sync_weights(self, version: int) -> None:
        await self.on_trainer.run(self._sync, version)

    async def trainer_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        return await self.on_trainer.run(self.trainer.sequence_logprobs, sequences)

    async def inference_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        return await asyncio.to_thread(self._on_inference, self.inference.token_logprobs, sequences)

    # -- checkpoints ---------------------------------------------------------------------------
    async def save_trainer(self, directory: Path) -> None:
        await self.on_trainer.run(self.trainer.save_checkpoint, directory)

    async def load_trainer(self, directory: Path) -> None:
        await self.on_trainer.run(self.trainer.load_checkpoint, directory)

    def _release_store(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            store.close()  # its serving thread is stopped and joined, its directory removed

    def close(self) -> None:
        """End every part, each once, in the reverse order of its making: the trainer's end of the
        transfer group, the reward pool, vLLM (its workers hold the group's other end and are
        clients of the store), the trainer's thread and process group, the rendezvous store.

        Explicitly, before `hpcrl run` returns: a thread or C++ object left to the interpreter's
        teardown can abort the process after a successful run, and a dropped reference does not
        end this object's parts, since vLLM keeps an import-time exception whose traceback holds
        this object until that teardown (docs/FACTS.md, "Teardown")."""
        self._closing.close()


async def run(config: Config, *, steps: int | None = None) -> Controller:
    """Run (or resume) the whole loop in this process; returns the finished controller."""
    ports = InProcessPorts(config)
    try:
        return await run_loop(config, ports, steps=steps)
    finally:
        ports.close()
