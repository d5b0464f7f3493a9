"""Which GPUs one task uses: the GPUs Slurm gave its step on its node, narrowed by its local rank (pure).

Every GPU step of the launcher asks Slurm for all of the component's GPUs on each node
(`srun --gres=gpu:N`, hpcrl.launch.steps), so every task of a node sees the same list, and task
k of the node takes block k of it:

    step sees  CUDA_VISIBLE_DEVICES=4,5,6,7   tasks on the node 2, GPUs per task 2
    local rank 0 -> "4,5"     local rank 1 -> "6,7"

The list is taken as Slurm wrote it: indices need not start at 0 (a node shared with other jobs,
cgroup-constrained devices) and may be UUIDs or MIG ids. Where Slurm bound the task to its own
GPUs already (`--gpus-per-task` with its default per-task binding, or `--gpu-bind`), the task sees
exactly its share and keeps it. A restarted task is started alone on its old node with the same
--gres and its old local rank (HPCRL_LOCAL_RANK), so it gets the same block.

Inside the task the GPUs are then cuda:0 .. cuda:G-1: a trainer rank's device is cuda:0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hpcrl.errors import HpcrlError


class PlacementError(HpcrlError):
    """A task cannot be given its GPUs (the message says what it saw and what to change)."""


@dataclass(frozen=True, kw_only=True)
class GpuPlacement:
    visible: tuple[str, ...]
    """What the step showed this task (CUDA_VISIBLE_DEVICES as Slurm set it)."""
    mine: tuple[str, ...]
    """The task's own GPUs: its CUDA_VISIBLE_DEVICES from now on."""
    source: str
    """Where `visible` came from (the variable's name)."""

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(self.mine)


def _ids(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def step_gpus(env: Mapping[str, str]) -> tuple[tuple[str, ...], str]:
    """(the GPUs this task's step shows it, the variable they came from).

    CUDA_VISIBLE_DEVICES is what CUDA will enumerate, so it wins; without it (a cluster whose GRES
    plugin does not set it) SLURM_STEP_GPUS, then SLURM_JOB_GPUS, name the node's device indices."""
    for name in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        if name in env:
            return _ids(env[name]), name
    return (), ""


def place_gpus(env: Mapping[str, str], *, gpus_per_task: int, local_rank: int, tasks_on_node: int,
               what: str = "this task") -> GpuPlacement:
    """The GPUs of the task `local_rank` of `tasks_on_node` on its node, each using `gpus_per_task`."""
    if gpus_per_task < 1 or tasks_on_node < 1 or not 0 <= local_rank < tasks_on_node:
        raise PlacementError(f"{what}: cannot place local rank {local_rank} of {tasks_on_node} task(s) with "
                             f"{gpus_per_task} GPU(s) each")
    visible, source = step_gpus(env)
    if len(visible) == gpus_per_task:  # Slurm bound it already (or one task per node): its share
        return GpuPlacement(visible=visible, mine=visible, source=source)
    needed = tasks_on_node * gpus_per_task
    if len(set(visible)) != len(visible):
        raise PlacementError(f"{what}: {source}={','.join(visible)} names a GPU twice")
    if len(visible) < needed:
        seen = f"{source}={','.join(visible)}" if source else "no GPU (CUDA_VISIBLE_DEVICES, SLURM_STEP_GPUS unset)"
        raise PlacementError(
            f"{what} (local rank {local_rank}) needs {gpus_per_task} GPU(s) and its node's {tasks_on_node} task(s) "
            f"{needed} in all, but its step shows {seen}. Fix: start the step with --gres=gpu:{needed} (hpcrl's "
            f"steps do) on nodes that have {needed} GPUs, or check the cluster profile's gpus_per_node")
    start = local_rank * gpus_per_task
    return GpuPlacement(visible=visible, mine=visible[start:start + gpus_per_task], source=source)
