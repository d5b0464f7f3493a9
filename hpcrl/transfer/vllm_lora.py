"""The receiving end of a LoRA sync inside one vLLM worker: each policy version gets a LoRA slot, written in place.

vLLM 0.32 loads an adapter only from a directory (LoRARequest.lora_path; worker_manager.py `_load_adapter`) and
copies it into a slot of every LoRA layer (model_manager.py `activate_adapter` -> `set_lora`). A sync writes the
slot itself instead, no file and no copy:

    slots = LoraSlots(model, plan, tp_rank=r, alpha=32.0)    # model.lora_manager: vLLM's LoRAModelManager
    targets = slots.begin(version)     # register the version's adapter id, zero its slot: plan dest -> view
    ... execute.receive(..., targets) ...
    slots.finish()                     # B *= alpha / rank, as vLLM's LoRALayerWeights.optimize does at load

`begin` registers an empty LoRAModel under id `adapter_id(version)` (version + 1) in vLLM's manager and activates it: vLLM gives it the
first free slot and zeroes that slot in every LoRA layer (`reset_lora`), and a request with
LoRARequest(lora_int_id=adapter_id(version)) then finds the adapter resident, so vLLM never reads its path
(LRUCacheWorkerLoRAManager.add_adapter). Slot tensors (hpcrl/plan/transfer/lora.py):
`lora_a_stacked[slice][slot, 0, :rank, :]` (the lm_head's: `lora_a_stacked[slot, 0, :rank, :]`) receives A in place; `lora_b_stacked[slice][slot, 0, :, :rank]` too when
rank = max_lora_rank, else (vLLM's ranks are 1, 8, 16, ...) B arrives in a buffer copied there at finish.

Versions: at most `max_loras` (the engine starts with max_policy_lag + 1) are resident; `begin` evicts the
oldest first. A version's slot is never written again while it is resident, so a request that started on
it finishes on it. Evicted, its id is free in vLLM again, and a request for it fails (its path names it).
vLLM's own Worker.finish_weight_update drops every adapter (reset_lora_state: after new *base* weights), so
a LoRA sync does not go through it (hpcrl.inference.vllm_worker).
"""

from __future__ import annotations

from typing import Any

import torch

from hpcrl.errors import TransferError
from hpcrl.plan.transfer.plan import TransferPlan


def adapter_id(version: int) -> int:
    """vLLM's adapter id of a policy version: version + 1 (vLLM's ids start at 1; a run syncs version 0, its
    initial adapter, at start)."""
    return version + 1


def slot_path(version: int) -> str:
    """The LoRARequest.lora_path of a version received in place: no such directory; vLLM reads it only for
    an evicted version, and its error then names the version."""
    # Absolute: vLLM takes any other path that does not exist for a Hugging Face repository to download.
    return f"/hpcrl-in-place-lora/policy-version-{version}"


class LoraSlots:
    """hpcrl's policy versions in one worker's vLLM LoRA manager (module docstring)."""

    def __init__(self, model: torch.nn.Module, plan: TransferPlan, *, tp_rank: int, alpha: float, where: str,
                 resident: list[int] | None = None) -> None:
        """`resident`: the versions an earlier plan of this engine put in the slots (oldest first)."""
        manager: Any = getattr(model, "lora_manager", None)
        rank = plan.inference.lora_rank
        if manager is None:
            raise TransferError(f"{where}: the plan moves LoRA adapters but this engine serves no LoRA; start vLLM "
                                "with enable_lora (VllmEngine with lora_rank)")
        config = manager.lora_config
        if config.fully_sharded_loras:
            raise TransferError(f"{where}: vLLM runs fully_sharded_loras, which hpcrl's LoRA plan does not lay out; "
                                "start it without")
        if config.max_lora_rank < rank:
            raise TransferError(f"{where}: vLLM's max_lora_rank {config.max_lora_rank} is below [lora] rank {rank}")
        if alpha <= 0:
            raise TransferError(f"{where}: LoRA alpha {alpha} must be positive ([lora] alpha)")
        self.manager, self.plan, self.tp_rank, self.where = manager, plan, tp_rank, where
        self.scaling = alpha / rank  # vLLM's PEFTHelper: lora_alpha / r (no rsLoRA)
        self.resident: list[int] = list(resident or ())  # versions, oldest first
        self._b: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # (slot view, buffer or None) of each B

    def _slot_view(self, name: str, index: int) -> torch.Tensor:
        """The 2-D [slot, 0] tensor of plan dest `name` ('<module>.lora_a_stacked.<slice>')."""
        module_name, stacked, piece = name.rsplit(".", 2)
        module = self.manager.modules.get(module_name)
        if module is None or not hasattr(module, stacked):
            raise TransferError(f"{self.where}: vLLM has no LoRA layer {module_name!r} with {stacked} (the served "
                                "model or its LoRA modules differ from the plan)")
        stack = getattr(module, stacked)
        if isinstance(stack, torch.Tensor):  # the lm_head's LogitsProcessorWithLoRA: one tensor, no slices
            if piece != "0":
                raise TransferError(f"{self.where}: vLLM's LoRA layer {module_name!r} has one {stacked}, no slice {piece}")
            return stack[index, 0]
        return stack[int(piece)][index, 0]

    def begin(self, version: int) -> dict[str, torch.Tensor]:
        """Make `version` resident in a zeroed slot (evicting the oldest version if the slots are full) and return
        the tensor each plan dest is received into."""
        from vllm.lora.lora_model import LoRAModel

        if version < 0:
            raise TransferError(f"{self.where}: LoRA policy version {version} is negative")
        manager, ident = self.manager, adapter_id(version)
        if version in self.resident:  # the same version again (a retried sync): take a fresh slot for it
            self.resident.remove(version)
            manager.remove_adapter(ident)
        while len(self.resident) >= manager.lora_slots or len(manager) >= manager.capacity:
            if not self.resident:
                raise TransferError(f"{self.where}: vLLM's LoRA slots hold adapters hpcrl did not put there (ids "
                                    f"{sorted(manager.list_adapters())}, slots {manager.lora_index_to_id}); a LoRA "
                                    "engine that receives syncs serves only its synced versions")
            manager.remove_adapter(adapter_id(self.resident.pop(0)))
        manager._registered_adapters[ident] = LoRAModel(ident, self.plan.inference.lora_rank, {})
        manager.activate_adapter(ident)  # first free slot, zeroed in every LoRA layer (reset_lora)
        index = manager.lora_index_to_id.index(ident)
        self.resident.append(version)
        targets, self._b = {}, []
        rank = self.plan.inference.lora_rank
        for d in self.plan.dests:
            view = self._slot_view(d.name, index)
            if ".lora_a_stacked." in d.name:
                targets[d.name] = view[:rank]
                continue
            direct = view.shape[1] == rank  # else B's columns are strided: receive into a buffer
            target = view if direct else torch.empty(d.local_shape, dtype=view.dtype, device=view.device)
            targets[d.name] = target
            self._b.append((view[:, :rank], None if direct else target))
        return targets

    def finish(self) -> None:
        """Scale every received B by alpha / rank in its slot, as vLLM does when it loads an adapter."""
        with torch.no_grad():
            for view, buffer in self._b:
                if buffer is not None:
                    view.copy_(buffer)
                if self.scaling != 1:  # LoRALayerWeights.optimize: lora_b *= scaling, skipped at 1
                    view.mul_(self.scaling)
        self._b = []
