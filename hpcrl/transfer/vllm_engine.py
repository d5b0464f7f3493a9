"""hpcrl's engine in vLLM's weight-transfer registry: the vLLM side of a weight transfer.

The transfer's only module that imports vLLM's weight-transfer API (transfer/nccl.py borrows
vLLM's NCCL wrapper). Use vLLM's own entry points:

    llm = LLM(model=..., worker_extension_cls=hpcrl.inference.vllm_llm.WORKER_EXTENSION,
              weight_transfer_config={"backend": "hpcrl"})
    llm.init_weight_transfer_engine({"init_info": init_info(...)})   # once: joins the group, digests
    llm.start_weight_update(); llm.update_weights({"update_info": {"version": 3}})
    llm.finish_weight_update(weight_version="3"); llm.reset_prefix_cache()

(hpcrl.inference.engine.VllmEngine does this: connect_transfer, then receive_weights, the three
in one call through the worker extension.)

Registration: vLLM creates the engine inside each worker process (Worker.load_model ->
WeightTransferEngineFactory.create_engine), and CPU workers are spawned, so the engine must be
registered in the worker. Workers import `worker_extension_cls` before loading the model
(vllm/v1/worker/worker_base.py); the extension (hpcrl.inference.vllm_worker) imports this module,
and importing it registers "hpcrl" (idempotent): the import-time side effect, and the reason the
registration sits at the bottom of this module.

Receiving: every worker computes the plan itself from the layouts in the init info and the
model's HF config, compares digests with every trainer rank and worker, then receives its
messages straight into the live parameters. On CPU, vLLM repacks linear weights for oneDNN and
leaves the parameter an empty [0] tensor (vllm/model_executor/layers/utils.py,
dispatch_cpu_unquantized_gemm; lm_head keeps its weight but computes from a packed copy), so
start_weight_update gives each such layer a fresh unpacked tensor to receive into and
finish_weight_update re-runs the layer's `quant_method.process_weights_after_loading`, the same
step vLLM runs after loading; layers that vLLM changes in other ways after loading (fused experts),
or tensors it derives from written ones (MLA's W_UK_T / W_UV, after every repack), are the family's
to handle (`Family.vllm_load_hooks`, hpcrl/models/vllm_hooks.py). Generation cannot interleave:
update_weights is one blocking collective_rpc, so no half-written fused module is ever used (reset the prefix cache after).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from hpcrl.config.model_shapes import from_hf_config
from hpcrl.errors import TransferError
from hpcrl.models.vllm_hooks import VllmLoadHook, VllmSide
from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
from hpcrl.plan.transfer.plan import TransferPlan
from hpcrl.plan.transfer.planner import plan as plan_transfer
from hpcrl.rendezvous.listen import seal_loopback_gloo
from hpcrl.transfer import execute
from hpcrl.transfer.registry import TransferLink, open_group

if TYPE_CHECKING:
    from hpcrl.transfer.vllm_lora import LoraSlots

ENGINE_NAME = "hpcrl"

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


def check_expert_parallel(inference: InferenceLayout, parallel_config: Any, *, moe: bool) -> None:
    """TransferError unless the plan's expert parallelism is vLLM's (`enable_expert_parallel`,
    `expert_placement_strategy`, one data-parallel rank: EP size = TP size)."""
    served = bool(getattr(parallel_config, "enable_expert_parallel", False)) and moe
    placement = getattr(parallel_config, "expert_placement_strategy", "linear")
    if inference.expert_parallel != served or (served and inference.expert_placement != placement):
        raise TransferError(f"the plan has expert_parallel {inference.expert_parallel} (placement "
                            f"{inference.expert_placement!r}), this engine serves enable_expert_parallel {served} "
                            f"(placement {placement!r}); set inference.expert_parallel as the engine runs")
    if served and getattr(parallel_config, "data_parallel_size", 1) != 1:
        raise TransferError(f"vLLM runs data parallel {parallel_config.data_parallel_size} with expert parallel: "
                            "the plan's EP size is the TP size (one data-parallel rank per engine)")


def init_info(*, store: str, replica: int, trainer: TrainerLayout, inference: InferenceLayout,
              wire_dtype: str, bucket_bytes: int, timeout_s: float = 120.0,
              digest: str = "", generation: int = 0, transport: str = "gloo",
              lora_alpha: float = 0.0) -> dict[str, Any]:
    """The `init_info` dict for `LLM.init_weight_transfer_engine` (plain data: crosses collective_rpc)."""
    lora = dict(lora_rank=inference.lora_rank, lora_targets=list(inference.lora_targets)) if inference.lora_rank else {}
    return dict(store=store, replica=replica, wire_dtype=wire_dtype, bucket_bytes=bucket_bytes,
                timeout_s=timeout_s, digest=digest, generation=generation,
                transport=transport, lora_alpha=lora_alpha,
                trainer=dict(dp_replicate=trainer.dp_replicate, dp_shard=trainer.dp_shard,
                             grouped_experts=trainer.grouped_experts),
                inference=dict(replicas=inference.replicas, tensor_parallel=inference.tensor_parallel,
                               vocab_padding=inference.vocab_padding, expert_parallel=inference.expert_parallel,
                               expert_placement=inference.expert_placement, **lora))


@dataclass
class HpcrlInitInfo(WeightTransferInitInfo):
    store: str
    """The rendezvous store's ZeroMQ address (hpcrl.rendezvous.meet; its key: the run's secret)."""
    replica: int
    trainer: dict
    inference: dict
    wire_dtype: str
    bucket_bytes: int
    timeout_s: float = 120.0
    digest: str = ""
    """When set, the digest the caller planned with; a worker that plans differently fails at once."""
    generation: int = 0
    """Which formation of the group on this store (a replaced replica makes everyone form it again)."""
    transport: str = "gloo"
    """"gloo" or "ucx" (hpcrl/transfer/registry.py)."""
    lora_alpha: float = 0.0
    """With a LoRA plan: [lora] alpha (each received B is scaled by alpha / rank, as vLLM does at load)."""


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
        self._slots: list[tuple[str, torch.nn.Module, VllmLoadHook | None, str, tuple[int, ...]]] | None = None
        self._repacking: list[Callable[[], None]] | None = None  # what redoes vLLM's post-load step
        self._hooks: tuple[VllmLoadHook, ...] = ()  # the served family's (Family.vllm_load_hooks)
        self.lora: LoraSlots | None = None  # a LoRA plan's versions in vLLM's LoRA slots (hpcrl.transfer.vllm_lora)
        self.last: dict[str, Any] = {}

    # -- set-up ---------------------------------------------------------------------------
    def init_transfer_engine(self, info: HpcrlInitInfo) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank

        if self.group is not None:  # a new plan (e.g. the trainer was resized): leave the old group
            self.shutdown()
        check_unquantized(self.model, self.model_config.quantization,
                          where=f"replica {info.replica} TP rank {get_tensor_model_parallel_rank()}")
        shape = from_hf_config(self.model_config.hf_config.to_dict(), where="the served model's config")
        inference = InferenceLayout(**{**info.inference,
                                       "lora_targets": tuple(info.inference.get("lora_targets", ()))})
        if inference.tensor_parallel != self.parallel_config.tensor_parallel_size:
            raise TransferError(f"the plan has TP {inference.tensor_parallel}, this engine runs TP "
                                f"{self.parallel_config.tensor_parallel_size}")
        check_expert_parallel(inference, self.parallel_config, moe=shape.experts() is not None)
        self._slots = self._repacking = None  # found again for this plan at its first update
        self._hooks = shape.family.vllm_load_hooks
        self.plan = plan = plan_transfer(TrainerLayout(**info.trainer), inference, shape, wire_dtype=info.wire_dtype,
                                         bucket_bytes=info.bucket_bytes)
        self.replica, self.tp_rank = info.replica, get_tensor_model_parallel_rank()
        # The versions resident in vLLM's LoRA slots outlive a plan (a resized trainer plans again).
        resident, self.lora = (self.lora.resident if self.lora is not None else []), None
        if inference.lora_rank:  # the adapters move, into vLLM's LoRA slots: the model's parameters stay
            from hpcrl.transfer.vllm_lora import LoraSlots

            self.lora = LoraSlots(self.model, plan, tp_rank=self.tp_rank, alpha=info.lora_alpha,
                                  where=f"replica {self.replica} TP rank {self.tp_rank}", resident=resident)
        me = execute.describe_group_rank(plan, execute.inference_group_rank(plan, self.replica, self.tp_rank))
        if info.digest and info.digest != plan.digest:
            raise TransferError(f"{me} planned {plan.digest[:12]}, the caller {info.digest[:12]}: the served "
                                "model or the layouts differ from what the caller planned with")
        self.timeout_s = info.timeout_s
        rank = execute.inference_group_rank(plan, self.replica, self.tp_rank)
        world = plan.trainer.world_size + inference.replicas * inference.tensor_parallel
        # vLLM's own gloo groups formed when its engine started: seal their listeners (on loopback:
        # vllm_llm.py) as ours are sealed once formed (hpcrl.rendezvous.listen); on one node its processes
        # hold no other TCP listener there (docs/FACTS.md, "gloo's listener").
        seal_loopback_gloo()
        self.group = group = open_group(info.transport, store=info.store, rank=rank, world_size=world,
                                        timeout_s=info.timeout_s, generation=info.generation)
        group.check_digests(rank=rank, digest=plan.digest, describe=lambda r: execute.describe_group_rank(plan, r))

    # -- one update -----------------------------------------------------------------------
    def start_weight_update(self) -> None:
        """Find the live tensor of every planned parameter; on CPU, unpacked tensors to receive into.

        A layer that one of the family's load hooks owns (e.g. FusedMoE's experts:
        hpcrl/models/fused_experts.py) receives where its hook says; a plain linear repacked for
        oneDNN on CPU (an empty [0] weight) receives into a fresh unpacked tensor."""
        if self.plan is None:
            raise TransferError("start_weight_update before init_weight_transfer_engine")
        if self.lora is not None:
            raise TransferError("a LoRA plan is received with receive_adapter(version), not vLLM's weight-update "
                                "session (whose end drops every adapter: hpcrl.transfer.vllm_lora)")
        t0 = time.perf_counter()
        if self._slots is None:
            self._slots = self._find_slots(self.plan)
        self._targets, written = {}, set()
        for name, module, hook, attr, shape in self._slots:
            param = getattr(module, attr)
            target = param.data
            if hook is not None:
                target = hook.receive_into(module, attr, self._rows_columns(name), self._side())
                param = getattr(module, attr)
            elif target.numel() == 0 and shape[0] * shape[1]:
                # Repacked for oneDNN on CPU: receive into a fresh unpacked tensor, repack at finish.
                target = torch.empty(shape, dtype=param.dtype, device=param.device)
                param = torch.nn.Parameter(target, requires_grad=False)
                setattr(module, attr, param)
            written.add(id(param))
            self._targets[name] = target
        if self._repacking is None:
            self._repacking = self._find_repacking(written)
        self.last = {"start_s": time.perf_counter() - t0}

    def _rows_columns(self, name: str) -> tuple[int, int]:
        """(rows, columns) the plan writes of parameter `name` on this rank."""
        assert self.plan is not None
        dest = next(d for d in self.plan.dests if d.name == name)
        return dest.real_rows[self.tp_rank], dest.local_shape[1]

    def _side(self) -> VllmSide:
        """What the family's load hooks need of vLLM, torch and the plan (hpcrl/models/vllm_hooks.py)."""
        from vllm.model_executor.utils import replace_parameter
        from vllm.platforms import current_platform

        from hpcrl.plan.transfer.layout import experts_of_rank

        assert self.plan is not None
        inference, tp_rank = self.plan.inference, self.tp_rank
        return VllmSide(
            where=f"replica {self.replica} TP rank {tp_rank}", tp_rank=tp_rank, on_cpu=current_platform.is_cpu(),
            replace_parameter=replace_parameter,
            empty=lambda shape, like: torch.empty(shape, dtype=like.dtype, device=like.device),
            experts_written=lambda total: experts_of_rank(
                total, inference.tensor_parallel if inference.expert_parallel else 1, tp_rank,
                inference.expert_placement),
            expert_layout=f"expert_parallel {inference.expert_parallel}, placement {inference.expert_placement!r}",
            act_dtype=self.model_config.dtype)

    def _find_slots(self, plan: TransferPlan
                    ) -> list[tuple[str, torch.nn.Module, VllmLoadHook | None, str, tuple[int, ...]]]:
        """(parameter name, its module, the family's load hook of that module, its attribute, its local
        shape) of every planned parameter: found once per plan, since the modules stay (a push
        replaces only their parameters, on CPU)."""
        params = dict(self.model.named_parameters())
        where = f"replica {self.replica} TP rank {self.tp_rank}"
        slots: list[tuple[str, torch.nn.Module, VllmLoadHook | None, str, tuple[int, ...]]] = []
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
            module = self.model.get_submodule(module_name)
            hook = next((h for h in self._hooks if h.owns(module_name, module)), None)
            if hook is not None and all(m is not module for _, m, _, _, _ in slots):
                hook.check(module, replace(self._side(), where=f"{where}: {module_name}"))
            slots.append((d.name, module, hook, attr, tuple(d.local_shape)))
        return slots

    def _find_repacking(self, written: set[int]) -> list[Callable[[], None]]:
        """What redoes vLLM's post-load step for every module computing from a written parameter
        (ids in `written`): the family's load hook of a module it owns; on CPU, the quant_method
        that repacks a plain layer, including a tied lm_head (its `weight` *is*
        embed_tokens.weight, but its packed copy is its own)."""
        from vllm.platforms import current_platform

        assert self._slots is not None
        side, hooked = self._side(), set()
        out: list[Callable[[], None]] = []
        for _, module, hook, _, _ in self._slots:
            if hook is not None and id(module) not in hooked:
                hooked.add(id(module))
                out.append(partial(hook.after_update, module, side))
        if current_platform.is_cpu():
            out += [partial(getattr(module, "quant_method").process_weights_after_loading, module)  # noqa: B009
                    for module in self.model.modules()
                    if id(module) not in hooked
                    and hasattr(getattr(module, "quant_method", None), "process_weights_after_loading")
                    and any(id(p) in written for p in module.parameters(recurse=False))]
        # Then what vLLM derived from the written layers (e.g. MLA's W_UK_T / W_UV), after them as vLLM
        # runs its attention layers' post-load step after every quant_method.
        for name, module in self.model.named_modules():
            hook = next((h for h in self._hooks if h.derives(name, module)), None)
            if hook is not None and id(module) not in hooked:
                hooked.add(id(module))
                hook.check(module, replace(side, where=f"{side.where}: {name}"))
                out.append(partial(hook.after_update, module, side))
        return out

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

    def receive_adapter(self, version: int) -> None:
        """A LoRA plan's whole update: `version` into a fresh slot (hpcrl.transfer.vllm_lora), received in place,
        B scaled. Outside vLLM's weight-update session, which would drop every adapter after."""
        if self.lora is None:
            raise TransferError("receive_adapter without a LoRA plan: the plan moves the model's weights")
        t0 = time.perf_counter()
        self._targets = self.lora.begin(version)
        self.last = {"start_s": time.perf_counter() - t0}
        try:
            self.receive_weights(HpcrlUpdateInfo(version=version))
        finally:
            self._targets = {}
        t0 = time.perf_counter()
        self.lora.finish()
        self.last["finish_s"] = time.perf_counter() - t0

    def finish_weight_update(self) -> None:
        t0 = time.perf_counter()
        for redo in self._repacking or ():
            redo()
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
