"""Trainer state on disk with torch.distributed.checkpoint (DCP): model, optimizer, step.

Every rank writes its own shards in parallel (no gather); a checkpoint written by N ranks loads
on M ranks (DCP reshards on load), or in one process. The caller owns "complete or invisible":
write into a temporary directory, then rename it and write the run's manifest last
(hpcrl.rl does that; docs/ARCHITECTURE.md, state on disk).

    save(model, optimizer, step, directory)         # collective
    step = load(model, optimizer, directory)        # collective
"""

from __future__ import annotations

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


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def save(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, directory: str | Path) -> None:
    """Write this rank's shards of the model and optimizer, and the step count, under `directory`."""
    import torch.distributed.checkpoint as dcp

    state = _state(model, optimizer)
    state["step"] = torch.tensor(step)
    distributed = _distributed()
    with _single_process_quietly(distributed):
        dcp.save(state, checkpoint_id=str(directory), no_dist=not distributed)


def load(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path, *, rank: int = 0) -> int:
    """Read `directory` into the model and optimizer (any sharding); the step it was saved at."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if not (Path(directory) / ".metadata").is_file():
        raise TrainerError(f"rank {rank}: {directory} is not a complete trainer checkpoint (no .metadata); "
                           "resume from the last checkpoint the run's manifest lists")
    state = _state(model, optimizer)
    state["step"] = torch.tensor(0)
    distributed = _distributed()
    with _single_process_quietly(distributed):
        dcp.load(state, checkpoint_id=str(directory), no_dist=not distributed)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return int(state["step"])
