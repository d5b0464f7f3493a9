"""The trainer ranks' torch.distributed group: gloo on CPU; NCCL on GPUs, with gloo for CPU tensors.

Every trainer forms one, a single rank too (a world of 1 through an in-process HashStore: `hpcrl
run`, or a job with one trainer rank), so that one code path - FSDP2 with its MixedPrecisionPolicy -
trains every run; without a group the engine could only train in float32. Join on the thread that
runs the engine, after it has taken its CUDA device (hpcrl.roles.base.EngineThread).

    join(store, rank=r, world=n, device="cuda", timeout_s=600)    # ranks of a job: the head's store
    join_alone(device="cpu")                                      # one rank, nothing to meet
    ...
    leave()                                                       # at the end, or the process may hang

A group whose ranks all share this machine (a group of one, or ranks on one node) listens on the
loopback address, and every group's gloo listener is sealed once it formed: gloo's listeners
authenticate no peer (hpcrl.rendezvous.listen). Groups torch makes from it later (a device mesh's)
are sealed by whoever asks for them: `with sealing(): init_device_mesh(...)` (trainer/parallel.py).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from hpcrl.errors import TrainerError

#: Puts back the environment join() changed (the gloo interface), at leave().
_restore: list[Callable[[], None]] = []


def backend(device: str) -> str:
    """torch.distributed backend of trainer ranks on `device` ("cpu" or "cuda")."""
    return "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"


def join(store: Any, *, rank: int, world: int, device: str, timeout_s: float) -> None:
    """Join the default process group of `world` trainer ranks through `store`.

    When every rank runs on this machine, the group's gloo listeners are on the loopback address:
    this one, and every group torch makes from it until leave() (torch reads GLOO_SOCKET_IFNAME
    each time). The group's gloo listeners are sealed once it formed. NCCL's are NCCL's own
    (docs/FACTS.md, "gloo's listener"): made at the first collective, after this returned."""
    import torch.distributed as dist

    from hpcrl.rendezvous.listen import one_machine, sealing, use_loopback

    if dist.is_initialized():
        raise TrainerError("this process is already in a torch.distributed group; a trainer rank forms its own "
                           "(call hpcrl.trainer.group.leave() first)")
    if one_machine(dist.PrefixStore("hpcrl-listen", store), rank=rank, world=world):
        _restore.append(use_loopback())
    try:
        with sealing():
            dist.init_process_group(backend(device), store=store, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout_s))
    except BaseException:
        while _restore:
            _restore.pop()()
        raise


def join_alone(*, device: str) -> None:
    """A process group of this one rank (an in-process store: no port, no file)."""
    import torch.distributed as dist

    join(dist.HashStore(), rank=0, world=1, device=device, timeout_s=60)


def leave() -> None:
    """Destroy the default process group, if there is one, and put back the gloo interface."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    while _restore:
        _restore.pop()()
