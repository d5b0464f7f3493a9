"""A model family from outside hpcrl, for a Hugging Face architecture vLLM does not know.

ToyLlamaForCausalLM is Llama under another name: hpcrl's Llama family (shape, trainer, transfer
plan) and vLLM's Llama model class (`vllm_model`), registered with vLLM by hpcrl in every vLLM
process. Its load hook owns the final norm and, after each weight update, appends one line to the
file named by $HPCRL_TEST_FAMILY_HOOK_LOG: the process id and the norm's sum as the update left it.
A run names this module in `model.family_modules = ["external_family"]` (tests/models on the
PYTHONPATH); tests/models/test_external_family.py does.
"""

from __future__ import annotations

import os
from typing import Any

from hpcrl.models import register
from hpcrl.models.llama import Llama
from hpcrl.models.vllm_hooks import VllmLoadHook, VllmSide

#: The environment variable naming the file the hook appends to.
HOOK_LOG_ENV = "HPCRL_TEST_FAMILY_HOOK_LOG"


class FinalNormWitness(VllmLoadHook):
    """Owns vLLM's final RMSNorm ("model.norm"); receives in place, and says where and what after an update."""

    def owns(self, name: str, module: Any) -> bool:
        return name == "model.norm"

    def after_update(self, module: Any, side: VllmSide) -> None:
        with open(os.environ[HOOK_LOG_ENV], "a") as log:
            log.write(f"{os.getpid()} {float(module.weight.sum())}\n")


class ToyLlama(Llama):
    architecture = "ToyLlamaForCausalLM"
    vllm_model = "vllm.model_executor.models.llama:LlamaForCausalLM"
    vllm_load_hooks = (FinalNormWitness(),)


FAMILY = register(ToyLlama())
