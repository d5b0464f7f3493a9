"""The processes tools/gpu/gpu_check.py drives: a trainer rank and the vLLM replica (the full check), and
the two ends of the one-GPU transfer (the partial check: a sender and a receiver without vLLM).

    python tools/gpu/gpu_check_ranks.py trainer|vllm|sender|receiver   # started by tools/gpu/gpu_check_steps.py
                                                                   # and gpu_check_partial.py, never by hand

Each reads one JSON command per line on stdin ({"id", "cmd", "args"}: a method of its class in
KINDS and its keyword arguments) and answers with one JSON line ({"id", "ok", "result" or
"error" and "traceback", "seconds"}) on the stdout it was started with; everything else it or its
children print (vLLM's logs) goes to stderr, which the driver points at a log file. Both use
hpcrl's own code paths: TrainerEngine (FSDP2, GRPO loss), TrainerSender, VllmEngine with hpcrl's
weight-transfer engine, vLLM's reload_weights for the reference, hpcrl.transfer.execute.receive.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TRAINER_RANKS = 2
TENSOR_PARALLEL = 2


def gb_per_s(nbytes: float, seconds: float) -> float | None:
    """Decimal GB per second, None for no time."""
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else None


def make_plan(shape, dtype: str):
    """The transfer plan both ends use: FSDP over TRAINER_RANKS -> one replica at TENSOR_PARALLEL, HF names."""
    from hpcrl.plan.for_config import BUCKET_BYTES
    from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
    from hpcrl.plan.transfer.planner import plan as plan_transfer

    return plan_transfer(TrainerLayout(dp_shard=TRAINER_RANKS),
                         InferenceLayout(replicas=1, tensor_parallel=TENSOR_PARALLEL), shape,
                         wire_dtype=dtype, bucket_bytes=BUCKET_BYTES)


def init_info_args(plan) -> dict[str, Any]:
    """The plan's part of hpcrl.transfer.vllm_engine.init_info (the vLLM side plans again from it)."""
    return dict(trainer=plan.trainer, inference=plan.inference, wire_dtype=plan.wire_dtype,
                bucket_bytes=plan.bucket_bytes, digest=plan.digest)


class TrainerRank:
    """One trainer rank: hpcrl's TrainerEngine under FSDP2, and its end of the transfer group."""

    def start(self, *, rank: int, store_port: int, model_dir: str, device: str, dtype: str, max_seq_len: int,
              micro_batch_size: int, timeout_s: float) -> dict:

        import torch
        import torch.distributed as dist

        from hpcrl.algorithms.base import Options
        from hpcrl.config.model_shapes import load_shape
        from hpcrl.trainer import EngineOptions, TrainerEngine, group

        started = time.perf_counter()
        self.rank, self.device = rank, device
        self.sender: Any = None  # a TrainerSender once connected
        if device == "cuda":
            torch.cuda.set_device(0)  # this process sees only its own GPU (CUDA_VISIBLE_DEVICES)
        from hpcrl.rendezvous.meet import client_store

        store = client_store(f"tcp://127.0.0.1:{store_port}", timeout_s=timeout_s)
        group.join(dist.PrefixStore("hpcrl-gpu-check", store), rank=rank, world=TRAINER_RANKS, device=device,
                   timeout_s=timeout_s)
        self.shape = load_shape(preset_name="", path=model_dir)
        self.engine = TrainerEngine(EngineOptions(
            shape=self.shape, weights_path=model_dir, dtype=dtype, device=device, max_seq_len=max_seq_len,
            lr=1e-5, total_steps=2, micro_batch_size=micro_batch_size, loss=Options(kl_coef=0.05)))
        self.plan = make_plan(self.shape, dtype)
        self._sync()
        return {"load_s": time.perf_counter() - started, "parameters": self.engine.num_parameters(),
                "memory_gib": self._memory(torch.cuda.memory_allocated)}

    def _sync(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()

    def _memory(self, read: Callable[[], int]) -> float | None:
        return round(read() / 2**30, 2) if self.device == "cuda" else None

    def _shards(self) -> dict:
        return {name: shard.tensor for name, shard in self.engine.local_shards().items()}

    def train(self, *, steps: int, rows: int, seq_len: int, seed: int) -> dict:
        """`steps` GRPO steps on a synthetic batch (the same on every rank; each trains its own rows)."""
        import torch

        from hpcrl.trainer import RolloutBatch

        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.shape.vocab_size, (rows, seq_len), generator=generator)
        mask = torch.zeros(rows, seq_len, dtype=torch.bool)
        mask[:, seq_len // 4:] = True  # a quarter prompt, the rest completion
        advantages = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(rows)])
        batch = RolloutBatch(tokens=tokens, completion_mask=mask, old_logprobs=torch.zeros(rows, seq_len),
                             advantages=advantages).shard(self.rank, TRAINER_RANKS)
        # On-policy rollouts: the behaviour logprobs are the policy's own.
        batch = dataclasses.replace(batch, old_logprobs=self.engine.logprobs(batch))
        self._sync()
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        metrics = [self.engine.train_step(batch).as_dict() for _ in range(steps)]
        self._sync()
        return {"metrics": metrics, "peak_memory_gib": self._memory(torch.cuda.max_memory_allocated)}

    def checkpoint(self, *, directory: str, model_dir: str) -> dict:
        """The trained weights as an HF checkpoint in the wire dtype (rank 0 writes; a collective)."""
        from safetensors.torch import save_file

        from hpcrl.transfer.execute import TORCH_DTYPES

        full = self.engine.full_state_dict_hf()
        if self.rank != 0:
            return {}
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        wire = TORCH_DTYPES[self.plan.wire_dtype]
        tensors = {name: t.to(wire).contiguous() for name, t in full.items()}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        weights = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")
        for path in Path(model_dir).iterdir():  # config, generation config, tokenizer
            if path.is_file() and not path.name.endswith(weights):
                shutil.copy(path, out / path.name)
        return {"bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "directory": str(out)}

    def bench(self, *, repeats: int) -> dict:
        """Time execute.pack / unpack of this rank's messages to TP rank 0 against a copy of the same bytes."""
        import torch

        from hpcrl.transfer import execute

        plan, dev = self.plan, torch.device(self.device, 0) if self.device == "cuda" else torch.device("cpu")
        wire = execute.TORCH_DTYPES[plan.wire_dtype]
        sources = execute.check_sources(plan, self.rank, self._shards())
        mine = [m for batch in execute.schedule(plan) for m in batch
                if m.src_rank == self.rank and m.replica == 0 and m.tp_rank == 0]
        buffers = [torch.empty(m.numel, dtype=wire, device=dev) for m in mine]
        dests = [torch.empty(d.local_shape, dtype=wire, device=dev).view(-1) for d in plan.dests]
        nbytes = sum(m.numel for m in mine) * plan.itemsize
        src, dst = torch.empty(nbytes, dtype=torch.uint8, device=dev), torch.empty(nbytes, dtype=torch.uint8, device=dev)

        def pack() -> None:
            for m, buf in zip(mine, buffers):
                execute.pack(plan, m, sources, buf)

        def unpack() -> None:
            for m, buf in zip(mine, buffers):
                execute.unpack(plan, m, buf, dests)

        def timed(run: Callable[[], object]) -> float:
            run()  # warm-up
            self._sync()
            t0 = time.perf_counter()
            for _ in range(repeats):
                run()
            self._sync()
            return (time.perf_counter() - t0) / repeats

        pack_s, unpack_s, copy_s = timed(pack), timed(unpack), timed(lambda: dst.copy_(src))
        return {"bytes": nbytes, "messages": len(mine), "repeats": repeats, "pack_s": pack_s, "unpack_s": unpack_s,
                "copy_s": copy_s, "pack_gb_per_s": gb_per_s(nbytes, pack_s),
                "unpack_gb_per_s": gb_per_s(nbytes, unpack_s), "copy_gb_per_s": gb_per_s(nbytes, copy_s),
                "pack_vs_copy": round(copy_s / pack_s, 3), "unpack_vs_copy": round(copy_s / unpack_s, 3),
                "note": "GB/s of wire bytes; pack also reads the float32 master shards (a cast), a copy "
                        "reads and writes the same bytes once"}

    def connect(self, *, transport: str, port: int, timeout_s: float) -> dict:
        from hpcrl.transfer.trainer import TrainerSender

        self.close_sender()
        self.sender = TrainerSender.connect(self.plan, rank=self.rank, store=f"tcp://127.0.0.1:{port}",
                                            timeout_s=timeout_s, transport=transport)
        return {}

    def send(self, *, corrupt: bool) -> dict:
        """Send this rank's shards; with `corrupt`, rank 0 first changes one element of a copy of one."""
        shards, corrupted = self._shards(), None
        if corrupt and self.rank == 0:
            names = [n for n, t in shards.items() if t.numel()]
            corrupted = "model.norm.weight" if "model.norm.weight" in names else names[0]
            changed = shards[corrupted].clone()  # never the live parameter
            changed.view(-1)[0] += 1.0
            shards[corrupted] = changed
        if self.sender is None:
            raise RuntimeError("send before connect")
        sent = self.sender.send(shards)
        self._sync()
        return {"bytes": sent, "seconds": self.sender.last_seconds, "corrupted": corrupted}

    def logprobs(self, *, sequences: list[list[int]]) -> list[list[float]] | None:
        values = self.engine.sequence_logprobs(sequences)  # a collective: every rank computes them
        return values if self.rank == 0 else None

    def close_sender(self) -> None:
        sender, self.sender = self.sender, None
        if sender is not None:
            sender.close()

    def exit(self) -> dict:
        from hpcrl.trainer import group

        self.close_sender()
        group.leave()
        return {}


# ----------------------------------------------------------------- the one-GPU transfer (partial mode)

#: Seed of the first HF tensor's values in the one-GPU transfer (each next tensor: the next seed).
VALUES_SEED = 1234


def one_gpu_plan(preset: str, wire_dtype: str):
    """(plan, shape): one trainer rank (FSDP world 1, HF names) -> one inference rank (TP 1), `preset`'s shapes."""
    from hpcrl.config.model_shapes import preset as shape_of
    from hpcrl.plan.for_config import BUCKET_BYTES
    from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
    from hpcrl.plan.transfer.planner import plan as plan_transfer

    shape = shape_of(preset)
    return plan_transfer(TrainerLayout(dp_shard=1), InferenceLayout(replicas=1, tensor_parallel=1), shape,
                         wire_dtype=wire_dtype, bucket_bytes=BUCKET_BYTES), shape


def hf_values(shape, device) -> dict:
    """Every HF tensor of `shape` as float32 normal values, seeded per tensor: the same in every process
    (on the same device type), so a receiver knows what a sender sent without being sent it."""
    import torch

    out = {}
    for i, (name, dims) in enumerate(shape.hf_parameters()):
        generator = torch.Generator(device=device).manual_seed(VALUES_SEED + i)
        out[name] = torch.randn(tuple(dims), generator=generator, device=device)
    return out


def expected_dests(plan, shape, hf: dict, tp_rank: int, fill: float) -> dict:
    """One TP rank's vLLM parameters as its weight loaders would fill them from the HF tensors `hf`
    (torch tensors, any device; vocab padding rows `fill`): hpcrl.plan.transfer.check.vllm_expected
    with torch's arrays, so that it runs on the GPU at 1B scale."""
    import torch

    from hpcrl.plan.transfer.check import vllm_expected

    return vllm_expected(plan, shape, hf, tp_rank, concat=torch.cat,
                         padded=lambda rows_cols, like: torch.full(rows_cols, fill, dtype=like.dtype,
                                                                   device=like.device))


def _device(device: str):
    import torch

    if device == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class OneGpuSender:
    """The trainer end of the one-GPU transfer: FSDP world 1, so its local shards are the HF tensors
    (float32 master weights on `device`), sent over gloo with hpcrl's TrainerSender."""

    def start(self, *, preset: str, device: str, wire_dtype: str, port: int, timeout_s: float) -> dict:
        from hpcrl.transfer.trainer import TrainerSender

        self.plan, shape = one_gpu_plan(preset, wire_dtype)
        self.device = _device(device)
        self.shards = hf_values(shape, self.device)
        self.sender = TrainerSender.connect(self.plan, rank=0, store=f"tcp://127.0.0.1:{port}", timeout_s=timeout_s,
                                            transport="gloo")
        return {"tensors": len(self.shards), "device": str(self.device)}

    def send(self) -> dict:
        sent = self.sender.send(self.shards)
        _synchronize(self.device)
        return {"bytes": sent, "seconds": self.sender.last_seconds}

    def exit(self) -> dict:
        self.sender.close()
        return {}


class OneGpuReceiver:
    """The inference end of the one-GPU transfer without vLLM: hpcrl.transfer.execute.receive into
    tensors on `device` shaped as vLLM's at TP 1, each checked element for element against the HF
    values the sender holds (recomputed here from the same seeds)."""

    FILL = -1.0
    """What the destinations hold before each transfer: a tensor the transfer skipped cannot match."""

    def start(self, *, preset: str, device: str, wire_dtype: str, port: int, timeout_s: float) -> dict:
        import torch

        from hpcrl.transfer import execute
        from hpcrl.transfer.registry import open_group

        self.plan, shape = one_gpu_plan(preset, wire_dtype)
        self.device, self.timeout_s = _device(device), timeout_s
        wire = execute.TORCH_DTYPES[wire_dtype]
        hf = {name: t.to(wire) for name, t in hf_values(shape, self.device).items()}  # the cast packing makes
        self.expected = {name: t.contiguous() for name, t in expected_dests(self.plan, shape, hf, 0, self.FILL).items()}
        del hf
        self.dests = {d.name: torch.empty(d.local_shape, dtype=wire, device=self.device) for d in self.plan.dests}
        if set(self.dests) != set(self.expected):
            raise RuntimeError(f"the plan's destinations and the expected tensors differ: "
                               f"{sorted(set(self.dests) ^ set(self.expected))[:5]}")
        rank = execute.inference_group_rank(self.plan, 0, 0)
        self.group = open_group("gloo", store=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=self.plan.trainer.world_size + 1, timeout_s=timeout_s)
        self.group.check_digests(rank=rank, digest=self.plan.digest,
                                 describe=lambda r: execute.describe_group_rank(self.plan, r))
        return {"tensors": len(self.dests), "device": str(self.device)}

    def receive(self) -> dict:
        from hpcrl.transfer import execute

        for t in self.dests.values():
            t.fill_(self.FILL)
        _synchronize(self.device)
        started = time.perf_counter()
        got = execute.receive(self.group, self.plan, 0, 0, execute.check_dests(self.plan, 0, 0, self.dests),
                              timeout_s=self.timeout_s)
        _synchronize(self.device)
        seconds = time.perf_counter() - started
        wrong = [name for name, t in self.dests.items() if not bool((t == self.expected[name].view(t.shape)).all())]
        return {"bytes": got, "seconds": seconds, "tensors": len(self.dests), "wrong": wrong}

    def exit(self) -> dict:
        self.group.close()
        return {}


# --------------------------------------------------------------------------------------- vLLM workers

def worker_pointers(worker) -> dict[str, int]:
    """Run in each vLLM worker (collective_rpc): data_ptr of every parameter."""
    model = worker.model_runner.get_model()
    return {name: int(p.data_ptr()) for name, p in model.named_parameters()}


def worker_fill_nan(worker) -> list[str]:
    """Run in each vLLM worker (collective_rpc): NaN into every row a transfer writes; the planned names.

    Whatever a transfer then fails to write stays NaN and cannot match the reference. (On CPU the
    repacked linear weights are empty [0] tensors; the transfer replaces them, so they are skipped.)"""
    import torch

    engine = worker.weight_transfer_engine
    params = dict(worker.model_runner.get_model().named_parameters())
    with torch.no_grad():
        for dest in engine.plan.dests:
            data = params[dest.name].data
            if data.numel():
                data[:dest.real_rows[engine.tp_rank]].fill_(float("nan"))
    return [dest.name for dest in engine.plan.dests]


class VllmReplica:
    """One vLLM engine (hpcrl's VllmEngine) at TENSOR_PARALLEL with hpcrl's weight-transfer engine."""

    def start(self, *, model_dir: str, device: str, dtype: str, max_model_len: int, gpu_memory_utilization: float,
              max_tokens: int) -> dict:
        from hpcrl.config.model_shapes import load_shape
        from hpcrl.inference.engine import VllmEngine

        started = time.perf_counter()
        self.engine = VllmEngine(
            model_path=model_dir, tensor_parallel=TENSOR_PARALLEL, on_cpu=device == "cpu", dtype=dtype, seed=0,
            max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=device == "cpu", temperature=0.0, top_p=1.0, top_k=-1, max_tokens=max_tokens,
            weight_transfer=True, engine_core_here=True)  # this process holds this one engine (vllm_llm.start_llm)
        self.plan = make_plan(load_shape(preset_name="", path=model_dir), dtype)
        self.version = 0
        return {"start_s": time.perf_counter() - started, "enforce_eager": device == "cpu"}

    def init(self, *, transport: str, port: int, timeout_s: float) -> dict:
        from hpcrl.transfer.vllm_engine import init_info

        info = init_info(store=f"tcp://127.0.0.1:{port}", replica=0, timeout_s=timeout_s,
                         transport=transport, **init_info_args(self.plan))
        self.engine.llm.init_weight_transfer_engine({"init_info": info})
        return {}

    def fill_nan(self) -> dict:
        return {"planned": self.engine.llm.collective_rpc(worker_fill_nan)[0]}

    def receive(self) -> dict:
        self.version += 1
        started = time.perf_counter()
        self.engine.receive_weights(self.version)
        return {"seconds": time.perf_counter() - started, "ranks": self.engine.llm.collective_rpc("hpcrl_last_update")}

    def observe(self, *, prompts: list[str], digests: bool = True, pointers: bool = True,
                generation: bool = True) -> dict:
        """sha256 and data_ptr of every weight on every TP rank; a greedy generation with logprobs."""
        from hpcrl.data.prompts import Prompt

        llm, seen = self.engine.llm, {}
        if digests:
            seen["digests"] = llm.collective_rpc("hpcrl_weight_digests")
        if pointers:
            seen["pointers"] = llm.collective_rpc(worker_pointers)
        if generation:
            groups = self.engine.generate([Prompt(id=str(i), text=text, answer="") for i, text in enumerate(prompts)],
                                          n=1, seed=0)
            seen["generation"] = [{"prompt_token_ids": c.prompt_token_ids, "token_ids": c.token_ids,
                                   "logprobs": c.logprobs, "text": c.text} for [c] in groups]
        return seen

    def reload(self, *, path: str) -> dict:
        """vLLM's own loading of the checkpoint at `path`, in place (Worker.reload_weights)."""
        self.engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": path, "is_checkpoint_format": True})
        return {}

    def exit(self) -> dict:
        self.engine.close()
        return {}


KINDS: dict[str, type] = {"trainer": TrainerRank, "vllm": VllmReplica, "sender": OneGpuSender,
                          "receiver": OneGpuReceiver}


def serve(kind: str) -> int:
    """Answer the driver's commands (see the module docstring) until "exit" or the end of stdin."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.path.insert(0, str(REPO))  # hpcrl, from this checkout
    handler: Any = KINDS[kind]()
    for line in sys.stdin:
        request = json.loads(line)
        started = time.monotonic()
        answer: dict[str, Any] = {"id": request["id"]}
        try:
            answer["result"] = getattr(handler, request["cmd"])(**request["args"])
            answer["ok"] = True
        except Exception as err:  # noqa: BLE001 - sent to the driver, which reports it as the step's failure
            traceback.print_exc()
            answer.update(ok=False, error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()[-3000:])
        answer["seconds"] = time.monotonic() - started
        replies.write(json.dumps(answer) + "\n")
        if request["cmd"] == "exit":
            break
    return 0


if __name__ == "__main__":
    raise SystemExit(serve(sys.argv[1]))
