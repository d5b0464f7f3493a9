"""Trainer state on disk with torch.distributed.checkpoint (DCP): model, optimizer, step.

Every rank writes its own shards in parallel (no gather); a checkpoint written by N ranks loads
on M ranks (DCP reshards on load), or in one process. The caller owns "complete or invisible":
write into a temporary directory, then rename it and write the run's manifest last
(hpcrl.rl does that; docs/ARCHITECTURE.md, state on disk).

    save(model, optimizer, step, directory)         # collective
    step = load(model, optimizer, directory)        # collective

LoRA (hpcrl.trainer.lora): `adapters_only=True` leaves the frozen base out (DCP's ignore_frozen_params:
the adapters and their optimizer state only), and `base_model.json` beside the shards names the base
model the adapters belong to: its path and a sha256 of its safetensors files (`base_identity`). A resume
on another base is refused (`check_base`), naming both.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from hpcrl.errors import TrainerError


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextmanager
def _single_process_quietly(distributed: bool):
    """Without a process group we pass no_dist=True, and DCP still warns that it is "assuming the
    intent is to save (load) in a single process" (every checkpoint of `hpcrl run`): that is our intent."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process",
                                    category=UserWarning)
        yield


#: Beside a LoRA checkpoint's shards: the base model the adapters were trained on.
BASE_FILE = "base_model.json"


def _options(adapters_only: bool):
    """The frozen base left out; on load not strict, since the base is not in the state (dcp.load already
    fails on any trainable parameter the checkpoint lacks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=False) if adapters_only else None


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, adapters_only: bool = False) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer, options=_options(adapters_only))
    return {"model": model_state, "optimizer": optimizer_state}


def base_identity(path: str | Path) -> dict[str, str]:
    """{"path", "sha256"} of a Hugging Face checkpoint directory: its resolved path and a sha256 over its
    safetensors files (names and bytes, in name order). Reads every byte once (about 10 s for 16 GB)."""
    digest = hashlib.sha256()
    root = Path(path)
    for file in sorted(root.glob("*.safetensors")):
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    return {"path": str(root.resolve()), "sha256": digest.hexdigest()}


def write_base(directory: str | Path, identity: dict[str, str]) -> None:
    """Record the base model of a LoRA checkpoint (one rank writes it, after `save`)."""
    (Path(directory) / BASE_FILE).write_text(json.dumps(identity, indent=1, sort_keys=True) + "\n")


def base_mismatch(directory: str | Path, identity: dict[str, str] | None) -> str:
    """Why the checkpoint under `directory` does not fit a trainer whose base is `identity` (None: a trainer
    without LoRA); "" when it fits."""
    file = Path(directory) / BASE_FILE
    saved = json.loads(file.read_text()) if file.is_file() else None
    if identity is None:
        return "" if saved is None else (f"{directory} holds LoRA adapters (of base {saved.get('path')}), but this "
                                         "config has no [lora] table; resume with the run's own config")
    if saved is None:
        return (f"{directory} holds every weight of a run without LoRA, but this config has a [lora] table; "
                "resume with the run's own config")
    if saved.get("sha256") != identity["sha256"]:
        return (f"{directory} holds LoRA adapters of the base model {saved.get('path')} (sha256 "
                f"{str(saved.get('sha256'))[:16]}...), but model.path is {identity['path']} (sha256 "
                f"{identity['sha256'][:16]}...); set model.path to the base the adapters were trained on")
    return ""


def save(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, directory: str | Path, *,
         adapters_only: bool = False) -> None:
    """Write this rank's shards of the model and optimizer, and the step count, under `directory`
    (adapters_only: the trainable parameters and their optimizer state, the frozen base left out)."""
    import torch.distributed.checkpoint as dcp

    state = _state(model, optimizer, adapters_only)
    state["step"] = torch.tensor(step)
    distributed = _distributed()
    with _single_process_quietly(distributed):
        dcp.save(state, checkpoint_id=str(directory), no_dist=not distributed)


def load(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path, *, rank: int = 0,
         adapters_only: bool = False) -> int:
    """Read `directory` into the model and optimizer (any sharding); the step it was saved at."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if not (Path(directory) / ".metadata").is_file():
        raise TrainerError(f"rank {rank}: {directory} is not a complete trainer checkpoint (no .metadata); "
                           "resume from the last checkpoint the run's manifest lists")
    state = _state(model, optimizer, adapters_only)
    state["step"] = torch.tensor(0)
    distributed = _distributed()
    with _single_process_quietly(distributed):
        dcp.load(state, checkpoint_id=str(directory), no_dist=not distributed)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_options(adapters_only))
    return int(state["step"])
