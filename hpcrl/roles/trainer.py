"""`python -m hpcrl.roles trainer`: one trainer rank, serving the head.

Its endpoints, with their request and reply types, are declared in hpcrl.contract.endpoints
(TrainerEndpoints):

    train_step {batch, step}        this rank's rows of the batch -> one optimizer step (collective)
    logprobs {sequences}            logprobs of whole sequences under the live policy (collective)
    connect_transfer {store, ...}   join the weight-transfer group with every inference engine
    send_weights {version}          send this rank's FSDP shards to the inference engines
    save {directory} / load {directory}   DCP checkpoint of model and optimizer (collective)

Ranks form their torch.distributed group (gloo on CPU, NCCL+gloo on GPUs) through the head's
rendezvous store (HPCRL_STORE_ADDR, keyed with the run's secret: hpcrl.rendezvous.meet)
before they register on the bus, so a registered trainer
rank is a ready one; a single rank forms a group of one (hpcrl.trainer.group), so mixed precision
runs through FSDP2 there too. The head sends every call to all ranks at once (Service.call_all).

On GPUs a rank sees exactly its own GPU (CUDA_VISIBLE_DEVICES), device 0. The engine thread takes
that device before anything else, then joins the group and builds the model, so every CUDA call
of the engine - FSDP2 creates its streams on the current device - is made on the rank's GPU.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcrl.config.groups import TRAINER
from hpcrl.config.schema import Config
from hpcrl.contract.calls import Handler
from hpcrl.contract.endpoints import (
    CheckpointCall,
    ConnectTransferCall,
    Endpoint,
    Loaded,
    Metrics,
    RankReply,
    SequencesCall,
    TrainerEndpoints,
    TrainStepCall,
    WeightsCall,
    WeightsSent,
)
from hpcrl.errors import HpcrlError
from hpcrl.roles.base import DeviceTable, Role, TorchCuda
from hpcrl.slurm.identity import TaskIdentity

#: Set by the head's supervisor: how many times the trainer group was started again inside this job.
TRAINER_START_ENV = "HPCRL_TRAINER_START"

if TYPE_CHECKING:  # imported when the role starts or the first transfer connects (they need torch)
    import torch

    from hpcrl.trainer import TrainerEngine
    from hpcrl.trainer.types import TrainBatch
    from hpcrl.transfer.trainer import TrainerSender


def rendezvous_timeout(config: Config) -> timedelta:
    """How long trainer ranks wait for each other to form their process group (and its collectives'
    timeout): run.start_timeout_s, or derived from the model's size (hpcrl.plan.timeouts)."""
    from hpcrl.config.model_shapes import shape_of
    from hpcrl.plan.timeouts import run_timeouts

    shape = shape_of(config.model)
    return timedelta(seconds=run_timeouts(config, shape).start_s)


def trainer_device(local_rank: int, visible: int) -> int:
    """The CUDA device of a trainer rank that sees `visible` devices: 0 when it sees only its own
    (the head's launch narrows CUDA_VISIBLE_DEVICES to it); when it sees the node's GPUs (a launch
    that does not narrow), the one of its local rank."""
    if visible == 0:
        raise HpcrlError("the config gives the trainer GPUs (trainer.gpus_per_node > 0) but this rank sees no CUDA "
                         "device: check CUDA_VISIBLE_DEVICES and the job's --gpus-per-node")
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise HpcrlError(f"trainer rank with local rank {local_rank} sees only {visible} CUDA devices "
                         "(CUDA_VISIBLE_DEVICES): more ranks per node than GPUs")
    return local_rank


def local_tensors(engine: TrainerEngine) -> dict[str, torch.Tensor]:
    """What a weight transfer sends from a trainer rank: the local tensor of each of its FSDP shards, by
    HF name (TrainerSender.send). Used by this role and by `hpcrl run`'s one-process trainer."""
    return {name: shard.tensor for name, shard in engine.local_shards().items()}


class TrainerRole(Role):
    group = TRAINER

    def __init__(self, config: Config, identity: TaskIdentity, env: dict[str, str], *,
                 devices: DeviceTable | None = None) -> None:
        from hpcrl.plan.for_config import plan_for_config

        self.config, self.rank, self.world = config, identity.rank, identity.group_size
        if self.world != config.trainer.world_size:
            raise HpcrlError(f"the trainer group has {self.world} tasks but the config asks for "
                             f"{config.trainer.world_size} ranks")
        gpus = config.trainer.gpus_per_node > 0
        devices = devices or TorchCuda()
        super().__init__(device=trainer_device(identity.local_rank, devices.device_count()) if gpus else None,
                         devices=devices)
        self.sender: TrainerSender | None = None
        self.store: Any = None
        """The client of the head's rendezvous store the trainer group formed on (kept for the group's life)."""
        try:
            self.engine = self.engine_thread.call(self._start, env, "cuda" if gpus else "cpu")
        except BaseException:
            self.close()
            raise
        self.plan = plan_for_config(config)

    def _start(self, env: dict[str, str], device: str) -> TrainerEngine:
        """Join the trainer group and build the engine (on the engine thread, on its device)."""
        import torch.distributed as dist

        from hpcrl.rendezvous.meet import client_store
        from hpcrl.trainer import TrainerEngine, group

        if self.world > 1:
            address = env.get("HPCRL_STORE_ADDR", "")
            if not address.startswith(("tcp://", "ipc://")):
                raise HpcrlError(f"HPCRL_STORE_ADDR {address!r} is not a ZeroMQ address (it is set by the head)")
            timeout = rendezvous_timeout(self.config)
            self.store = client_store(address, timeout_s=timeout.total_seconds())
            # A requeued job has a new store; a group started again inside the job (the head's Supervisor) meets
            # on the same one, under its own prefix.
            restart, again = env.get("SLURM_RESTART_COUNT", "0"), env.get(TRAINER_START_ENV, "0")
            group.join(dist.PrefixStore(f"hpcrl-trainer/{restart}/{again}", self.store), rank=self.rank, world=self.world,
                       device=device, timeout_s=timeout.total_seconds())
        else:
            group.join_alone(device=device)
        return TrainerEngine.from_config(self.config)

    def handlers(self) -> dict[Endpoint, Handler]:
        return {TrainerEndpoints.connect_transfer: self.connect_transfer, TrainerEndpoints.train_step: self.train_step,
                TrainerEndpoints.send_weights: self.send_weights, TrainerEndpoints.logprobs: self.logprobs,
                TrainerEndpoints.save: self.save, TrainerEndpoints.load: self.load}

    # -- endpoints -------------------------------------------------------------------------------
    async def connect_transfer(self, call: ConnectTransferCall) -> RankReply:
        from hpcrl.transfer.trainer import TrainerSender

        if call.digest != self.plan.digest:
            raise HpcrlError(f"trainer rank {self.rank} planned the weight transfer as {self.plan.digest[:12]}, "
                             f"the head as {call.digest[:12]}: they read different configs or model files")

        def connect() -> None:
            if self.sender is not None:
                self.sender.close()
            self.sender = TrainerSender.connect(self.plan, rank=self.rank, store=call.store,
                                                timeout_s=float(call.timeout_s), generation=call.generation,
                                                transport=self.config.weight_transport)
        await self.on_engine(connect)
        return RankReply(rank=self.rank)

    def _train(self, batch: TrainBatch) -> Metrics:
        metrics = self.engine.train_share(batch).as_dict()  # this rank's rows (and packed micro-batches)
        metrics.pop("step")
        return metrics

    async def train_step(self, call: TrainStepCall) -> Metrics | None:
        metrics = await self.on_engine(self._train, call.batch)
        return metrics if self.rank == 0 else None

    async def logprobs(self, call: SequencesCall) -> list[list[float]] | None:
        values = await self.on_engine(self.engine.sequence_logprobs, call.sequences)
        return values if self.rank == 0 else None

    def _send(self, version: int) -> WeightsSent:
        if self.sender is None:
            raise HpcrlError(f"trainer rank {self.rank} was asked to send weights version {version} before "
                             "connect_transfer")
        shards = local_tensors(self.engine)
        sent = self.sender.send(shards)
        return WeightsSent(bytes=sent, seconds=self.sender.last_seconds)

    async def send_weights(self, call: WeightsCall) -> WeightsSent:
        return await self.on_engine(self._send, call.version)

    async def save(self, call: CheckpointCall) -> RankReply:
        await self.on_engine(self.engine.save_checkpoint, Path(call.directory))
        return RankReply(rank=self.rank)

    async def load(self, call: CheckpointCall) -> Loaded:
        await self.on_engine(self.engine.load_checkpoint, Path(call.directory))
        return Loaded(step=self.engine.step)

    def close(self) -> None:
        from hpcrl.trainer import group

        super().close()
        if self.sender is not None:
            self.sender.close()
        group.leave()
        if self.store is not None:
            self.store.close()
