"""The vLLM side of a weight transfer: our engine in vLLM's weight-transfer registry, and a worker extension.

The only hpcrl module that imports vLLM's worker internals. Use vLLM's own entry points:

    llm = LLM(model=..., worker_extension_cls="hpcrl.transfer.vllm_adapter.HpcrlWorkerExtension",
              weight_transfer_config={"backend": "hpcrl"})
    llm.init_weight_transfer_engine({"init_info": init_info(...)})   # once: joins the group, digests
    llm.start_weight_update(); llm.update_weights({"update_info": {"version": 3}})
    llm.finish_weight_update(weight_version="3"); llm.reset_prefix_cache()
    llm.collective_rpc("hpcrl_receive_weights", args=(3,))   # or the three in one call (one round trip)

Registration: vLLM creates the engine inside each worker process (Worker.load_model ->
WeightTransferEngineFactory.create_engine), and CPU workers are spawned, so the engine must be
registered in the worker. Workers import `worker_extension_cls` before loading the model
(vllm/v1/worker/worker_base.py), so importing this module registers "hpcrl" (idempotent): the
import-time side effect, and the reason it lives here. The other one, on CPU only: vLLM's worker
busy-loops (sched_yield) for a second after every message it reads from its engine
(vllm/distributed/device_communicators/shm_broadcast.py, SpinCondition, busy_loop_s = 1), so a
worker that the head calls every step spins a core for good. On a GPU node that core is the
inference node's own; on CPUs it is the trainer's: a tiny-model train step went from 0.03 s to
0.8-1.1 s beside a spinning worker in the local Slurm hetjob. `quiet_idle_workers` cuts the
spin to 5 ms (then the worker sleeps on its notify socket, woken within microseconds). A
one-rank engine on CPU has no such queue: hpcrl runs its worker inside the engine core
(hpcrl.inference.engine).

Receiving: every worker computes the plan itself from the layouts in the init info and the
model's HF config, compares digests with every trainer rank and worker, then receives its
messages straight into the live parameters. On CPU, vLLM repacks linear weights for oneDNN and
leaves the parameter an empty [0] tensor (vllm/model_executor/layers/utils.py,
dispatch_cpu_unquantized_gemm; lm_head keeps its weight but computes from a packed copy), so
start_weight_update gives each such layer a fresh unpacked tensor to receive into and
finish_weight_update re-runs the layer's `quant_method.process_weights_after_loading`, the same
step vLLM runs after loading. Generation cannot interleave: update_weights is one blocking
collective_rpc, so no half-written fused module is ever used (reset the prefix cache after).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from hpcrl.config.model_shapes import from_hf_config
from hpcrl.errors import TransferError
from hpcrl.plan.transfer_layout import InferenceLayout, TrainerLayout
from hpcrl.plan.transfer_plan import TransferPlan
from hpcrl.plan.transfer_planner import plan as plan_transfer
from hpcrl.transfer import execute
from hpcrl.transfer.registry import TransferLink, open_group

ENGINE_NAME = "hpcrl"
log = logging.getLogger(__name__)

#: Parameter dtypes a transfer writes (the plan's wire dtypes); an fp8 or integer one holds quantized weights.
UNQUANTIZED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_unquantized(model: torch.nn.Module, quantization: str | None, *, where: str) -> None:
    """TransferError unless `model` (a vLLM model's module tree) computes from plain float weights.

    The plan writes each parameter as the trainer holds it; a quantized layer computes from packed
    integers or fp8 plus scales that only its quant_method's loader can make. So until quantized
    serving is supported: `quantization` (vLLM's model_config.quantization) must be unset, every
    module's `quant_method` one of vLLM's Unquantized*Method (or a subclass), and every parameter a
    float of 16 or 32 bits."""
    fix = ("serve the unquantized checkpoint (bf16, fp16 or fp32; no quantization_config in its config.json) "
           "without LLM(quantization=...): hpcrl's weight transfer cannot write quantized weights yet")
    if quantization:
        raise TransferError(f"{where}: the served model is quantized ({quantization!r}). Fix: {fix}")
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and not any(c.__name__.startswith("Unquantized") for c in type(method).__mro__):
            raise TransferError(f"{where}: layer {name!r} ({type(module).__name__}) computes with the quantized "
                                f"method {type(method).__name__}. Fix: {fix}")
    for name, param in model.named_parameters():
        if param.dtype not in UNQUANTIZED_DTYPES:
            raise TransferError(f"{where}: parameter {name!r} is {param.dtype}, a quantized dtype (transfers write "
                                f"float32, bfloat16 or float16). Fix: {fix}")


def init_info(*, host: str, port: int, replica: int, trainer: TrainerLayout, inference: InferenceLayout,
              wire_dtype: str, bucket_bytes: int, timeout_s: float = 120.0, external_store: bool = False,
              digest: str = "", generation: int = 0, transport: str = "gloo") -> dict[str, Any]:
    """The `init_info` dict for `LLM.init_weight_transfer_engine` (plain data: crosses collective_rpc)."""
    return dict(host=host, port=port, replica=replica, wire_dtype=wire_dtype, bucket_bytes=bucket_bytes,
                timeout_s=timeout_s, external_store=external_store, digest=digest, generation=generation,
                transport=transport,
                trainer=dict(dp_replicate=trainer.dp_replicate, dp_shard=trainer.dp_shard, naming=trainer.naming,
                             fuse_qkv=trainer.fuse_qkv),
                inference=dict(replicas=inference.replicas, tensor_parallel=inference.tensor_parallel,
                               vocab_padding=inference.vocab_padding))


@dataclass
class HpcrlInitInfo(WeightTransferInitInfo):
    host: str
    port: int
    replica: int
    trainer: dict
    inference: dict
    wire_dtype: str
    bucket_bytes: int
    timeout_s: float = 120.0
    external_store: bool = False
    digest: str = ""
    """When set, the digest the caller planned with; a worker that plans differently fails at once."""
    generation: int = 0
    """Which formation of the group on this store (a replaced replica makes everyone form it again)."""
    transport: str = "gloo"
    """"gloo" or "ucx" (hpcrl/transfer/registry.py)."""


@dataclass
class HpcrlUpdateInfo(WeightTransferUpdateInfo):
    version: int = 0


class HpcrlWeightTransferEngine(WeightTransferEngine[HpcrlInitInfo, HpcrlUpdateInfo]):
    """Receives this worker's share of a TransferPlan from the trainer ranks (see module docstring)."""

    init_info_cls = HpcrlInitInfo
    update_info_cls = HpcrlUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.plan: TransferPlan | None = None
        self.group: TransferLink | None = None
        self.replica = self.tp_rank = 0
        self._targets: dict[str, torch.Tensor] = {}
        # Found at the first update of a plan, kept for the next (start_weight_update).
        self._slots: list[tuple[str, torch.nn.Module, str, tuple[int, ...]]] | None = None
        self._repacking: list[tuple[torch.nn.Module, Any]] | None = None  # (layer, its vLLM quant_method)
        self.last: dict[str, Any] = {}

    # -- set-up ---------------------------------------------------------------------------
    def init_transfer_engine(self, info: HpcrlInitInfo) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank

        if self.group is not None:  # a new plan (e.g. the trainer was resized): leave the old group
            self.shutdown()
        check_unquantized(self.model, self.model_config.quantization,
                          where=f"replica {info.replica} TP rank {get_tensor_model_parallel_rank()}")
        shape = from_hf_config(self.model_config.hf_config.to_dict(), where="the served model's config")
        inference = InferenceLayout(**info.inference)
        if inference.tensor_parallel != self.parallel_config.tensor_parallel_size:
            raise TransferError(f"the plan has TP {inference.tensor_parallel}, this engine runs TP "
                                f"{self.parallel_config.tensor_parallel_size}")
        self._slots = self._repacking = None  # found again for this plan at its first update
        self.plan = plan = plan_transfer(TrainerLayout(**info.trainer), inference, shape, wire_dtype=info.wire_dtype,
                                         bucket_bytes=info.bucket_bytes)
        self.replica, self.tp_rank = info.replica, get_tensor_model_parallel_rank()
        me = execute.describe_group_rank(plan, execute.inference_group_rank(plan, self.replica, self.tp_rank))
        if info.digest and info.digest != plan.digest:
            raise TransferError(f"{me} planned {plan.digest[:12]}, the caller {info.digest[:12]}: the served "
                                "model or the layouts differ from what the caller planned with")
        self.timeout_s = info.timeout_s
        rank = execute.inference_group_rank(plan, self.replica, self.tp_rank)
        world = plan.trainer.world_size + inference.replicas * inference.tensor_parallel
        self.group = group = open_group(info.transport, host=info.host, port=info.port, rank=rank, world_size=world,
                                        timeout_s=info.timeout_s, external_store=info.external_store,
                                        generation=info.generation)
        group.check_digests(rank=rank, digest=plan.digest, describe=lambda r: execute.describe_group_rank(plan, r))

    # -- one update -----------------------------------------------------------------------
    def start_weight_update(self) -> None:
        """Find the live tensor of every planned parameter; on CPU, unpacked tensors to receive into."""
        if self.plan is None:
            raise TransferError("start_weight_update before init_weight_transfer_engine")
        t0 = time.perf_counter()
        if self._slots is None:
            self._slots = self._find_slots(self.plan)
        self._targets, written = {}, set()
        for name, module, attr, shape in self._slots:
            param = getattr(module, attr)
            target = param.data
            if target.numel() == 0 and shape[0] * shape[1]:
                # Repacked for oneDNN on CPU: receive into a fresh unpacked tensor, repack at finish.
                target = torch.empty(shape, dtype=param.dtype, device=param.device)
                param = torch.nn.Parameter(target, requires_grad=False)
                setattr(module, attr, param)
            written.add(id(param))
            self._targets[name] = target
        if self._repacking is None:
            self._repacking = self._find_repacking(written)
        self.last = {"start_s": time.perf_counter() - t0}

    def _find_slots(self, plan: TransferPlan) -> list[tuple[str, torch.nn.Module, str, tuple[int, ...]]]:
        """(parameter name, its module, its attribute, its local shape) of every planned parameter: found
        once per plan, since the modules stay (a push replaces only their parameters, on CPU)."""
        params = dict(self.model.named_parameters())
        where = f"replica {self.replica} TP rank {self.tp_rank}"
        slots = []
        for d in plan.dests:
            if d.name not in params:
                raise TransferError(f"{where}: the served model has no parameter {d.name!r}")
            module_name, _, attr = d.name.rpartition(".")
            # Received in place: on CUDA, unquantized layers keep computing from this very tensor, so
            # addresses captured in CUDA graphs stay valid and nothing has to run after writing it.
            # vLLM 0.32.0, model_executor/layers/linear.py: UnquantizedLinearMethod
            # .process_weights_after_loading (206-227) only acts when is_cpu() (repack, 207-216) or
            # is_xpu() (opt-in relayout, 217-227); apply (229-240) calls the _gemm_impl picked in
            # __init__ (175) by layers/utils.py dispatch_unquantized_gemm (620-652), which on CUDA is
            # default_unquantized_gemm (83-89: F.linear(x, layer.weight)) or, only with an opt-in
            # FlashInfer linear_backend, cuda_flashinfer_bf16_gemm (202-217: also layer.weight, read per
            # call). layers/vocab_parallel_embedding.py: UnquantizedEmbeddingMethod
            # .process_weights_after_loading (67-71) is CPU-only too; embedding (85-86) is
            # F.embedding(x, layer.weight). On CPU, dispatch_cpu_unquantized_gemm (utils.py 470-608)
            # packs a copy and empties the weight: handled in start_weight_update and finish_weight_update.
            slots.append((d.name, self.model.get_submodule(module_name), attr, tuple(d.local_shape)))
        return slots

    def _find_repacking(self, written: set[int]) -> list[tuple[torch.nn.Module, Any]]:
        """On CPU, every module computing from a written parameter (ids in `written`), with the
        quant_method that repacks it, including a tied lm_head (its `weight` *is* embed_tokens.weight,
        but its packed copy is its own); nothing elsewhere."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return []
        return [(module, module.quant_method) for module in self.model.modules()
                if hasattr(getattr(module, "quant_method", None), "process_weights_after_loading")
                and any(id(p) in written for p in module.parameters(recurse=False))]

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class calls torch.accelerator.synchronize(), which raises on CPU.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: HpcrlUpdateInfo) -> None:
        if not self._targets:
            raise TransferError("update_weights outside start_weight_update / finish_weight_update")
        plan, group = self.plan, self.group
        if plan is None or group is None:  # the group failed to open, or was shut down
            raise TransferError("update_weights without a transfer group: call init_weight_transfer_engine first")
        t0 = time.perf_counter()
        dests = execute.check_dests(plan, self.replica, self.tp_rank, self._targets)
        with torch.no_grad():
            received = execute.receive(group, plan, self.replica, self.tp_rank, dests, timeout_s=self.timeout_s)
        self.last.update(version=update_info.version, bytes=received, receive_s=time.perf_counter() - t0)

    def finish_weight_update(self) -> None:
        t0 = time.perf_counter()
        for module, quant_method in self._repacking or ():
            quant_method.process_weights_after_loading(module)
        self._targets = {}
        self.last["finish_s"] = time.perf_counter() - t0

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()


def register() -> None:
    """Put "hpcrl" in vLLM's weight-transfer registry of this process (idempotent)."""
    if ENGINE_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, HpcrlWeightTransferEngine)


register()

#: Seconds a vLLM worker on CPU keeps busy-looping after a read before it sleeps (vLLM: 1 s).
CPU_WORKER_SPIN_S = 0.005


def quiet_idle_workers(spin_s: float = CPU_WORKER_SPIN_S) -> None:
    """On CPU platforms, make this process's vLLM workers busy-loop at most `spin_s` after a read
    (see the module docstring); idempotent, and nothing on GPUs."""
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.platforms import current_platform

    condition = shm_broadcast.SpinCondition
    if not current_platform.is_cpu() or getattr(condition.wait, "hpcrl_spin_s", None) is not None:
        return
    original = condition.wait

    def wait(self, timeout_ms: int | None = None) -> None:
        if self.is_reader and self.busy_loop_s > spin_s:
            self.busy_loop_s = spin_s
        return original(self, timeout_ms)

    # A monkeypatch (module docstring): mypy cannot follow a marked function put in a method's place.
    wait.hpcrl_spin_s = spin_s  # type: ignore[attr-defined]  # the mark that makes this idempotent
    condition.wait = wait  # type: ignore[method-assign]  # the patch itself


quiet_idle_workers()


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class _ModelRunner(Protocol):
    """What the extension uses of the vLLM Worker's model runner (GPU or CPU)."""

    def get_model(self) -> torch.nn.Module: ...


class _WeightUpdates(Protocol):
    """vLLM's Worker methods of one weight update (vllm/v1/worker/gpu_worker.py; the CPU worker inherits them)."""

    def start_weight_update(self) -> None: ...
    def update_weights(self, update_info: dict) -> None: ...
    def finish_weight_update(self) -> None: ...


class HpcrlWorkerExtension:
    """Methods vLLM mixes into its Worker (`worker_extension_cls`), called with `collective_rpc`."""

    model_runner: _ModelRunner  # the Worker's (an annotation only: vLLM refuses extension names the Worker has)

    def hpcrl_receive_weights(self, version: int) -> None:
        """One whole update in one call: the Worker's own start_weight_update, update_weights and
        finish_weight_update, in turn, with their bookkeeping (a failed update ends the session, as
        there). LLM's three calls are three round trips to the engine core, each about 0.4 ms on CPU,
        on the critical path of every step."""
        worker: _WeightUpdates = self  # type: ignore[assignment]  # mixed into vLLM's Worker, which has them
        worker.start_weight_update()
        worker.update_weights({"version": version})
        worker.finish_weight_update()

    def hpcrl_weight_digests(self) -> dict[str, str]:
        """sha256 of every weight this rank computes with: non-empty parameters, and for layers whose
        weight vLLM repacked (CPU), the effective matrix read back through the packed kernel
        (cpu_linear(I) = I W^T = W^T: exact, one non-zero product per output)."""
        model = self.model_runner.get_model()
        out = {name: _sha(p) for name, p in model.named_parameters() if p.numel()}
        with torch.no_grad():
            for name, module in model.named_modules():
                kernel = getattr(module, "cpu_linear", None)
                size = getattr(module, "input_size_per_partition", None)
                if kernel is None or size is None:
                    continue
                dtype = next((p.dtype for p in module.parameters()), torch.float32)
                eye = torch.eye(size, dtype=dtype)
                out[f"{name}.weight@kernel"] = _sha(kernel(eye, module.weight, None).t().contiguous())
        return out

    def hpcrl_seed_sampling(self, seed: int) -> None:
        """Seed this rank's default torch generators (CPU and every accelerator): the randomness vLLM's
        sampler draws for requests without a seed of their own (forward_cpu's Gumbel seeds, the
        native path's exponential noise, FlashInfer's seed and offset). Every TP rank gets the same."""
        torch.manual_seed(seed)

    def hpcrl_eager_helpers(self) -> None:
        """Run this worker's torch.compile'd functions eagerly (CPU with enforce_eager, where the model
        itself is eager): what is left compiled there is the sampler's helpers (vLLM 0.32:
        batched_count_greater_than in v1/sample/ops/logprobs.py, the top-k/top-p mask in
        topk_topp_sampler.py), whose inductor build made the first request with logprobs take 2.4 s
        instead of 0.06 s on a 2-core VM, and each new batch shape recompiled."""
        torch._dynamo.config.disable = True

    def hpcrl_last_update(self) -> dict:
        """Bytes and seconds (start_s, receive_s, finish_s) of this rank's last received update."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "last", {}) or {})


#: Seconds to wait for a vLLM client's output thread to end once its engine is shut down.
OUTPUT_THREAD_JOIN_S = 10.0


def shut_down_llm(llm: Any) -> None:
    """Stop a vLLM `LLM`: its engine processes, then its client's output thread and ZMQ context.

    vLLM's shutdown ends the engine processes and tells the client's output thread (a daemon) to
    stop, but waits for neither that thread nor its ZMQ context: whichever thread drops the last
    reference ends the context later, possibly that daemon thread while the interpreter is tearing
    down, where a thread still in native code aborts the process (docs/FACTS.md, "Teardown"). Both
    are ended here, while the interpreter is whole."""
    engine = getattr(llm, "llm_engine", None)
    client = getattr(engine, "engine_core", None)
    shutdown = getattr(engine, "shutdown", None) or getattr(client, "shutdown", None)
    if shutdown is not None:
        shutdown()
    thread = getattr(client, "output_queue_thread", None)  # vllm/v1/engine/core_client.py, SyncMPClient
    if thread is not None:
        thread.join(OUTPUT_THREAD_JOIN_S)
        if thread.is_alive():  # it still uses the context: leave both
            log.warning(f"vLLM's client thread {thread.name} did not end within {OUTPUT_THREAD_JOIN_S:g} s of its "
                        "engine's shutdown")
            return
    ctx = getattr(client, "ctx", None)
    if ctx is not None:
        ctx.destroy(linger=0)  # closes what sockets are left; its I/O threads end
