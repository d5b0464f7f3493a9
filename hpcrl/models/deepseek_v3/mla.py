"""What vLLM derives from MLA's kv_b_proj after loading, derived again after every weight update.

vLLM's MLAAttention layer (vllm 0.32 model_executor/layers/attention/mla_attention.py, inside
`self_attn.mla_attn`) decodes in the latent space: after loading it splits kv_b_proj's weight
[heads*(nope+v), kv_lora] into the absorbed W_UK_T [heads, nope, kv_lora] and W_UV [heads, kv_lora, v]
(`process_weights_after_loading(act_dtype)`, run by the loader after every layer's quant_method,
model_loader/utils.py), parameters of their own that decode's bmm reads. A weight update writes
kv_b_proj only, so without this the layer silently decodes with the old weights. On CPU kv_b_proj
is not repacked (`_cpu_skip_gemm_dispatch`) but for the AMX backend, which packs its own copies and
empties kv_b_proj's weight (the engine then receives into a fresh one, as for any repacked linear);
on CUDA the split is copied into the same tensors (`prefer_copy`), so CUDA graphs stay valid.
ROCm's aiter fp8 / fp4 batched matmuls quantize the split: refused, as quantized serving is.
"""

from __future__ import annotations

from typing import Any

from hpcrl.errors import TransferError
from hpcrl.models.vllm_hooks import VllmLoadHook, VllmSide

#: What MLAAttention derives from kv_b_proj (named for the family's readers and the oracle's checks).
DERIVED = ("W_UK_T", "W_UV")


class MlaAbsorbed(VllmLoadHook):
    """vLLM's MLAAttention: W_UK_T and W_UV derived from kv_b_proj (see the module docstring)."""

    def owns(self, name: str, module: Any) -> bool:
        return False  # it holds no parameter the plan writes

    def derives(self, name: str, module: Any) -> bool:
        return any(c.__name__ == "MLAAttention" for c in type(module).__mro__) and hasattr(module, "kv_b_proj")

    def check(self, module: Any, side: VllmSide) -> None:
        for flag in ("is_aiter_triton_fp8_bmm_enabled", "is_aiter_triton_fp4_bmm_enabled"):
            if getattr(module, flag, False):
                raise TransferError(f"{side.where}: MLA attention quantizes kv_b_proj's absorbed copies ({flag}); "
                                    "hpcrl's weight transfer writes unquantized weights. Fix: serve without "
                                    "VLLM_ROCM_USE_AITER_FP8BMM / FP4BMM")

    def after_update(self, module: Any, side: VllmSide) -> None:
        module.process_weights_after_loading(side.act_dtype)


MLA_ABSORBED = MlaAbsorbed()
