"""Export a LoRA run's checkpoint: the adapter as a PEFT directory, or merged into a full Hugging Face checkpoint.

    adapters = read_adapters(checkpoint_dir, shape, lora)     # {HF adapter name: full tensor}, from DCP
    write_peft(out, adapters, lora, base=..., dtype=...)      # adapter_config.json + adapter_model.safetensors
    write_merged(out, adapters, lora, base=...)               # W + (alpha / rank) B A, file by file

The checkpoint's shards (hpcrl.trainer.checkpoint, any number of ranks) are read in one process without
building the model: DCP reshards them into whole tensors, which need only the adapters' names and shapes
(hpcrl.models.lora) and torchtitan's names for them (hpcrl.trainer.lora.adapter_names). The PEFT directory
holds the tensors under PEFT's names (`base_model.model.` + the model's own name), which `peft`'s
PeftModel.from_pretrained and vLLM's LoRA loader read. The merged checkpoint is the base model's
directory with every adapted weight W replaced by W + (alpha / rank) B A (PEFT's merge, in float32, then
the weight's own dtype), one safetensors file at a time; the base's other files are copied.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import Tensor

from hpcrl.config.schema import LoraConfig
from hpcrl.errors import TrainerError
from hpcrl.models import ModelShape
from hpcrl.models.lora import PEFT_PREFIX, adapter_parameters
from hpcrl.trainer import titan
from hpcrl.trainer.checkpoint import BASE_FILE
from hpcrl.trainer.lora import PEFT_CONFIG, PEFT_WEIGHTS, adapter_names


def read_adapters(directory: str | Path, shape: ModelShape, lora: LoraConfig) -> dict[str, Tensor]:
    """{HF adapter name: whole float32 tensor} of the trainer checkpoint under `directory`, checkpoint order."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    if not (directory / ".metadata").is_file():
        raise TrainerError(f"{directory} is not a complete trainer checkpoint (no .metadata)")
    if not (directory / BASE_FILE).is_file():
        raise TrainerError(f"{directory} holds every weight of a run without LoRA ([lora] table): there is no "
                           "adapter to export")
    names = adapter_names(shape, lora, titan.hf_to_titan_names(shape))
    dims = dict(adapter_parameters(shape, lora.rank, lora.targets))
    model = {names[name]: torch.empty(dims[name], dtype=torch.float32) for name in names}
    dcp.load({"model": model}, checkpoint_id=str(directory), no_dist=True)
    return {name: model[names[name]] for name in names}


def base_of(directory: str | Path) -> dict[str, str]:
    """The base model a LoRA checkpoint names (hpcrl.trainer.checkpoint.BASE_FILE: path, sha256)."""
    return json.loads((Path(directory) / BASE_FILE).read_text())


def peft_config(lora: LoraConfig, base: str) -> dict:
    """adapter_config.json of a PEFT LoRA adapter of `lora` on the model at `base`."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": sorted(lora.targets),
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
            "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}}


def write_peft(out: str | Path, adapters: dict[str, Tensor], lora: LoraConfig, *, base: str,
               dtype: torch.dtype = torch.float32) -> Path:
    """The PEFT directory `out` (created): adapter_config.json and adapter_model.safetensors."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({PEFT_PREFIX + name: t.to(dtype).contiguous() for name, t in adapters.items()},
              str(out / PEFT_WEIGHTS), metadata={"format": "pt"})
    (out / PEFT_CONFIG).write_text(json.dumps(peft_config(lora, base), indent=2) + "\n")
    return out


def write_merged(out: str | Path, adapters: dict[str, Tensor], lora: LoraConfig, *, base: str | Path) -> Path:
    """A full Hugging Face checkpoint under `out`: the base's files, every adapted weight W + (alpha/r) B A."""
    from safetensors.torch import load_file, save_file

    base, out = Path(base), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    scale = lora.alpha / lora.rank
    merged = set()
    for file in sorted(base.iterdir()):
        if file.is_dir():
            continue
        if file.suffix != ".safetensors":
            shutil.copyfile(file, out / file.name)
            continue
        tensors = load_file(str(file))
        for name, weight in tensors.items():
            a = adapters.get(f"{name[: -len('.weight')]}.lora_A.weight")
            if a is not None:
                b = adapters[f"{name[: -len('.weight')]}.lora_B.weight"]
                tensors[name] = (weight.float() + (b.float() @ a.float()) * scale).to(weight.dtype)
                merged.add(name)
        save_file(tensors, str(out / file.name), metadata={"format": "pt"})
    expected = {name[: -len(".lora_A.weight")] + ".weight" for name in adapters if name.endswith(".lora_A.weight")}
    if merged != expected:
        raise TrainerError(f"{base} lacks {len(expected - merged)} adapted weights, e.g. "
                           f"{sorted(expected - merged)[:3]}; is it the base model of this run?")
    return out
