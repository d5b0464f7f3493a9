"""Parameters by Hugging Face name: load HF safetensors into FSDP shards, expose each rank's shards.

Trainer parameters hold HF tensors unchanged (same rows, same order; see hpcrl.trainer.titan),
so FSDP2's Shard(0) placement makes each rank's local tensor a contiguous range of the HF
tensor's rows, with torch.chunk semantics (a [3, 8] weight over 2 ranks: rows 0-1 and row 2;
a rank may hold zero rows). Loading reads only those rows from the safetensors files (no
collective, no full tensor in memory); `local_shards` gives them to the weight transfer.

    shards = local_shards(model, names)          # {hf_name: LocalShard(tensor, global_shape, dim0_offset)}
                                                 # (a MoE expert stack: its HF name without the expert
                                                 # index, seen 2-D as (experts x rows, columns))
    full = full_state_dict_hf(model, names)      # collective: every rank gets every full tensor
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from hpcrl.errors import TrainerError
from hpcrl.trainer.titan import RopeScaling, YarnRopeScaling, clean_name, expert_stack_name

#: HF checkpoint entries that are not parameters of the model.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LocalShard(NamedTuple):
    """This rank's rows of one parameter."""

    tensor: Tensor
    """The rows [dim0_offset, dim0_offset + tensor.shape[0]); a view of the live parameter: read only."""
    global_shape: tuple[int, ...]
    """Shape of the whole parameter (the HF tensor)."""
    dim0_offset: int
    """First row of the whole parameter held here."""


def local_rows(param: Tensor) -> tuple[Tensor, int]:
    """(local tensor, first global row) of a parameter, sharded (DTensor) or not.

    A 3-D parameter (a MoE layer's expert stack, (E, rows, columns): hpcrl.trainer.titan) is seen
    2-D, (E * rows, columns), a view: FSDP2's Shard(0) holds whole experts, so its local rows are
    still one contiguous range."""
    if not isinstance(param, DTensor):
        return _as_rows(param.detach()), 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = param.to_local().detach()
    local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(local.shape) != tuple(local_shape) or any(offset[1:]):
        raise TrainerError(f"parameter of shape {tuple(param.shape)} is placed {param.placements}: "
                           "only dim-0 sharding (FSDP2 Shard(0)) is supported by the HF shard view")
    item_rows = param.shape[1] if param.dim() == 3 else 1
    return _as_rows(local), int(offset[0]) * item_rows


def _as_rows(tensor: Tensor) -> Tensor:
    """A 3-D expert stack (E, rows, columns) as (E * rows, columns); other tensors as they are."""
    return tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() == 3 else tensor


def _row_shape(param: Tensor) -> tuple[int, ...]:
    """The global shape `_rows` views `param` in."""
    shape = tuple(param.shape)
    return (shape[0] * shape[1], shape[2]) if len(shape) == 3 else shape


def is_adapter(name: str) -> bool:
    """Whether a parameter (HF or torchtitan name) is a LoRA adapter's (hpcrl.trainer.lora)."""
    return name.endswith((".lora_A.weight", ".lora_B.weight"))


def parameters_by_hf_name(model: nn.Module, hf_to_titan: dict[str, str], *, rank: int) -> dict[str, Tensor]:
    """{hf_name: parameter}; every HF name must have exactly one parameter and vice versa. A map names
    either the model's own weights or its LoRA adapters (hpcrl.trainer.lora): the parameters of the other
    kind are not its concern."""
    adapters = any(map(is_adapter, hf_to_titan.values()))
    params = {clean_name(n): p for n, p in model.named_parameters()}
    missing = [t for t in hf_to_titan.values() if t not in params]
    extra = sorted(n for n in set(params) - set(hf_to_titan.values()) if is_adapter(n) == adapters)
    if missing or extra:
        raise TrainerError(f"rank {rank}: model and HF names disagree: no parameter for {missing[:3]}, "
                           f"no HF name for {extra[:3]}")
    return {hf: params[titan] for hf, titan in hf_to_titan.items()}


def local_shards(model: nn.Module, hf_to_titan: dict[str, str], *, rank: int = 0,
                 sharded: bool = False) -> dict[str, LocalShard]:
    """{hf_name: LocalShard} of this rank, in checkpoint order. No communication.

    sharded=True (an FSDP model) checks that every parameter is a DTensor: a gathered one would
    silently be reported as the whole tensor at offset 0.
    """
    out = {}
    for hf_name, param in parameters_by_hf_name(model, hf_to_titan, rank=rank).items():
        if sharded and not isinstance(param, DTensor):
            raise TrainerError(f"rank {rank}: {hf_name} is gathered, not sharded; reshard the FSDP "
                               "model (hpcrl.trainer.parallel.reshard) before reading its local shards")
        local, offset = local_rows(param)
        out[hf_name] = LocalShard(local, _row_shape(param), offset)
    return out


def full_state_dict_hf(model: nn.Module, hf_to_titan: dict[str, str], *, rank: int = 0) -> dict[str, Tensor]:
    """{hf_name: full tensor (CPU)} on every rank. A collective: all ranks call it together."""
    out = {}
    for hf_name, param in parameters_by_hf_name(model, hf_to_titan, rank=rank).items():
        full = (param.full_tensor() if isinstance(param, DTensor) else param).detach().to("cpu", copy=True)
        if full.dim() == 3:  # an expert stack: one tensor per expert, as HF checkpoints hold them
            prefix, _, suffix = hf_name.rpartition(".experts.")
            out.update({f"{prefix}.experts.{e}.{suffix}": expert.clone() for e, expert in enumerate(full)})
        else:
            out[hf_name] = full
    return out


def read_rope_scaling(path: str | Path) -> RopeScaling | YarnRopeScaling | None:
    """The checkpoint's RoPE scaling from its config.json (None: plain RoPE): Llama 3's, or YaRN as DeepSeek-V3
    and Kimi-K2 use it (an attention factor of 1 on cos/sin, which their mscale = mscale_all_dim gives).

    Other kinds (linear, dynamic, ...) are refused: the trainer's logits would differ from vLLM's.
    """
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    # transformers >= 5 writes rope_parameters (with rope_theta in it); older files rope_scaling.
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None
    if kind == "yarn":
        return _yarn(params, config_file)
    if kind != "llama3":
        raise TrainerError(f"{config_file}: rope scaling {kind!r} is not supported by the trainer; "
                           "only Llama 3's 'llama3' scaling is. Use a checkpoint without it")
    return RopeScaling(factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                       high_freq_factor=float(params["high_freq_factor"]),
                       original_max_position_embeddings=int(params["original_max_position_embeddings"]))


def _yarn(params: dict, config_file: Path) -> YarnRopeScaling:
    """YaRN's parameters as transformers reads them (`_compute_yarn_parameters`); refused when its attention
    factor on cos/sin is not 1 (torchtitan's MLA folds YaRN's scale into the softmax scale only)."""
    import math

    if "original_max_position_embeddings" not in params:
        raise TrainerError(f"{config_file}: YaRN scaling lacks 'original_max_position_embeddings' (the context the "
                           "model was pretrained with); add it to rope_scaling")
    factor = float(params["factor"])
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim \
            else get_mscale(factor)
    if abs(attention - 1.0) > 1e-12:
        raise TrainerError(f"{config_file}: YaRN with an attention factor of {attention:.6g} on cos/sin is not built "
                           "(DeepSeek-V3's and Kimi-K2's mscale = mscale_all_dim make it 1); use such a config")
    return YarnRopeScaling(factor=factor, original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                           beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                           mscale_all_dim=float(mscale_all_dim or 0.0), truncate=bool(params.get("truncate", True)))


def _safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise TrainerError(f"{path} holds no *.safetensors files; point model.path at a Hugging Face "
                           "checkpoint (tools/make_tiny_model.py makes one)")
    return files


def load_hf_weights(model: nn.Module, hf_to_titan: dict[str, str], path: str | Path, *, rank: int = 0) -> None:
    """Copy each parameter's local rows from the safetensors files under `path` into the model."""
    from safetensors import safe_open

    path = Path(path)
    params = parameters_by_hf_name(model, hf_to_titan, rank=rank)
    seen: set[str] = set()
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for hf_name in handle.keys():
                if hf_name.endswith(_IGNORED_SUFFIXES):
                    continue
                stack = expert_stack_name(hf_name) if hf_name not in params else None
                if stack is not None and stack[0] in params:
                    _load_expert(params[stack[0]], stack[1], handle.get_slice(hf_name), hf_name, rank=rank)
                    seen.add(f"{stack[0]}#{stack[1]}")
                    continue
                if hf_name not in params:
                    if hf_name == "lm_head.weight" and "model.embed_tokens.weight" in params:
                        continue  # tied embeddings saved twice: the embedding is the one we keep
                    raise TrainerError(f"rank {rank}: {file.name} has {hf_name!r}, which the model "
                                       "has no parameter for; is model.preset the checkpoint's shape?")
                param = params[hf_name]
                entry = handle.get_slice(hf_name)
                if tuple(entry.get_shape()) != tuple(param.shape):
                    raise TrainerError(f"rank {rank}: {hf_name} is {tuple(entry.get_shape())} in {file.name} "
                                       f"but {tuple(param.shape)} in the model")
                local, offset = local_rows(param)
                with torch.no_grad():
                    local.copy_(entry[offset:offset + local.shape[0]])
                seen.add(hf_name)
    missing = [name for name, param in params.items() if name not in seen and not (
        param.dim() == 3 and all(f"{name}#{e}" in seen for e in range(param.shape[0])))]
    if missing:
        raise TrainerError(f"rank {rank}: {path} lacks {len(missing)} parameters, e.g. {missing[:3]}")


def _load_expert(stack: Tensor, expert: int, entry, hf_name: str, *, rank: int) -> None:
    """Copy one HF expert tensor into index `expert` of a 3-D stack, if this rank holds that expert."""
    if tuple(entry.get_shape()) != tuple(stack.shape[1:]):
        raise TrainerError(f"rank {rank}: {hf_name} is {tuple(entry.get_shape())} but the model's experts "
                           f"are {tuple(stack.shape[1:])}")
    if expert >= stack.shape[0]:
        raise TrainerError(f"rank {rank}: {hf_name} names expert {expert}, but the model has {stack.shape[0]}; "
                           "is model.preset the checkpoint's shape?")
    local, row = local_rows(stack)
    first = row // stack.shape[1]
    if first <= expert < first + local.shape[0] // stack.shape[1]:
        rows = stack.shape[1]
        with torch.no_grad():
            local[(expert - first) * rows:(expert - first + 1) * rows].copy_(entry[:])


def set_rows(param: Tensor, full: Tensor) -> None:
    """Copy this rank's rows of the whole tensor `full` into `param` (sharded or not)."""
    local, offset = local_rows(param)
    with torch.no_grad():
        local.copy_(_as_rows(full)[offset:offset + local.shape[0]])


def copy_weights(source: nn.Module, target: nn.Module, hf_to_titan: dict[str, str], *, rank: int = 0) -> None:
    """Copy every local shard of `source` into `target` (same shapes and sharding; no communication)."""
    src = parameters_by_hf_name(source, hf_to_titan, rank=rank)
    dst = parameters_by_hf_name(target, hf_to_titan, rank=rank)
    with torch.no_grad():
        for name, param in src.items():
            local_rows(dst[name])[0].copy_(local_rows(param)[0])
