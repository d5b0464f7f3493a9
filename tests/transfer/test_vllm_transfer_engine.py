"""The receiving engine refuses a quantized served model before any transfer, naming what is quantized.

No engine is started: `check_unquantized` takes the module tree, here a small stand-in for a vLLM model
(layers carrying vLLM's own unquantized methods, or a stand-in quantized one).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from hpcrl.errors import TransferError  # noqa: E402
from hpcrl.transfer.vllm_engine import check_unquantized  # noqa: E402 - imports vLLM


class Fp8LinearMethod:
    """Stands in for vLLM's quantized linear methods (vllm/model_executor/layers/quantization/fp8.py)."""


def tiny_model(*, quant_method=None, weight_dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """model.layers.0.self_attn.qkv_proj (a linear layer), model.embed_tokens, as vLLM names them."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    root, model, attn = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
    root.add_module("model", model)
    model.add_module("layers", torch.nn.ModuleList([torch.nn.Module()]))
    model.layers[0].add_module("self_attn", attn)
    qkv = torch.nn.Module()
    qkv.register_parameter("weight", torch.nn.Parameter(torch.zeros(8, 4).to(weight_dtype), requires_grad=False))
    qkv.quant_method = quant_method if quant_method is not None else UnquantizedLinearMethod()
    attn.add_module("qkv_proj", qkv)
    embed = torch.nn.Module()
    embed.register_parameter("weight", torch.nn.Parameter(torch.zeros(16, 4, dtype=torch.bfloat16)))
    embed.quant_method = UnquantizedEmbeddingMethod()
    model.add_module("embed_tokens", embed)
    return root


def test_a_model_of_vllm_unquantized_methods_and_float_weights_passes():
    check_unquantized(tiny_model(), None, where="TP rank 0")
    check_unquantized(tiny_model(weight_dtype=torch.float32), None, where="TP rank 0")


def test_a_subclass_of_an_unquantized_method_passes():
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    class RouterMethod(UnquantizedLinearMethod):  # as vLLM's _GateLinearMethod
        pass

    check_unquantized(tiny_model(quant_method=RouterMethod()), None, where="TP rank 0")


def test_a_quantization_in_the_model_config_is_refused_naming_it_and_the_fix():
    with pytest.raises(TransferError, match=r"replica 0 TP rank 1: the served model is quantized \('fp8'\).*"
                                            r"serve the unquantized checkpoint"):
        check_unquantized(tiny_model(), "fp8", where="replica 0 TP rank 1")


def test_a_layer_with_a_quantized_method_is_refused_naming_the_layer_and_its_method():
    with pytest.raises(TransferError, match=r"layer 'model.layers.0.self_attn.qkv_proj' .*Fp8LinearMethod.*"
                                            r"serve the unquantized checkpoint"):
        check_unquantized(tiny_model(quant_method=Fp8LinearMethod()), None, where="TP rank 0")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_an_fp8_or_integer_parameter_is_refused_naming_the_parameter_and_its_dtype(dtype):
    with pytest.raises(TransferError, match=rf"parameter 'model.layers.0.self_attn.qkv_proj.weight' is {dtype}"):
        check_unquantized(tiny_model(weight_dtype=dtype), None, where="TP rank 0")


@pytest.mark.parametrize(("planned", "served"), [
    (dict(expert_parallel=True), dict(enable_expert_parallel=False)),
    (dict(expert_parallel=False), dict(enable_expert_parallel=True)),
    (dict(expert_parallel=True), dict(enable_expert_parallel=True, expert_placement_strategy="round_robin")),
])
def test_a_plan_whose_expert_parallel_is_not_vllms_is_refused_naming_both(planned, served):
    """Checked against vLLM's own ParallelConfig: a worker whose experts are placed otherwise than the
    plan says would receive whole experts into slices, or the wrong experts."""
    from vllm.config import ParallelConfig

    from hpcrl.plan.transfer.layout import InferenceLayout
    from hpcrl.transfer.vllm_engine import check_expert_parallel

    with pytest.raises(TransferError, match=r"the plan has expert_parallel .* this engine serves enable_expert_parallel"):
        check_expert_parallel(InferenceLayout(tensor_parallel=2, **planned),
                              ParallelConfig(tensor_parallel_size=2, **served), moe=True)
    check_expert_parallel(InferenceLayout(tensor_parallel=2), ParallelConfig(tensor_parallel_size=2, **served),
                          moe=False)  # a dense model: vLLM's flag changes nothing, the plan has no experts
