"""Which group, replica and rank a task is, read from its environment (pure).

The head starts every group process with HPCRL_LAYOUT (`layout_env`: each group's name, component
index, tasks and ranks_per_replica). The rest comes from where the task runs:

  hetjob step   SLURM_HET_SIZE is set. A step started with `srun --het-group=i[,j...]` has no
                variable naming its component (measured on Slurm 22.05), so the component is
                derived: the step's components (HPCRL_STEP_COMPONENTS, or the components whose
                SLURM_JOB_NODELIST_HET_GROUP_i lies inside SLURM_STEP_NODELIST - components
                never share nodes) laid end to end by SLURM_NTASKS_HET_GROUP_i, then SLURM_PROCID
                picks the component and the rank within it.
  split job     HPCRL_GROUP names the group (one step per group); rank = SLURM_PROCID.
  local         HPCRL_GROUP and HPCRL_RANK, set by the local launcher (no Slurm at all).
  relaunched    HPCRL_GROUP and HPCRL_RELAUNCH_RANK: one task the head started again (a lost
                inference replica), under Slurm or not; HPCRL_LOCAL_RANK keeps its old local rank.

The replica is rank // ranks_per_replica (trainer: HSDP replica; inference: one engine per task).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from hpcrl.errors import SlurmError
from hpcrl.slurm.nodelist import expand_nodelist
from hpcrl.slurm.spec import GroupSlot


@dataclass(frozen=True, kw_only=True)
class TaskIdentity:
    group: str
    component: int
    rank: int
    """Rank within the group (0 .. group_size - 1)."""
    group_size: int
    replica: int
    local_rank: int
    node: str
    """Host name of the node (SLURMD_NODENAME under Slurm)."""
    node_index: int
    """Index of the node within the group's nodes."""

    def to_dict(self) -> dict:
        return dict(vars(self))


def layout_env(groups: Iterable[GroupSlot]) -> str:
    """The value of HPCRL_LAYOUT the head gives every task: what `identify_task` needs of each group."""
    return json.dumps({"groups": [{"name": g.name, "component": g.component.index, "tasks": g.component.tasks,
                                   "ranks_per_replica": g.ranks_per_replica} for g in groups]}, separators=(",", ":"))


def _layout(env: Mapping[str, str]) -> list[dict]:
    raw = env.get("HPCRL_LAYOUT")
    if not raw:
        raise SlurmError("HPCRL_LAYOUT is not set: group processes are started by the head "
                         "(hpcrl submit), which describes the groups in that variable")
    try:
        return json.loads(raw)["groups"]
    except (ValueError, KeyError, TypeError) as err:
        raise SlurmError(f"HPCRL_LAYOUT is not the JSON the head writes ({err}): {raw[:200]!r}") from None


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except KeyError:
        raise SlurmError(f"{name} is not set in this task's environment; is it running under srun?") from None
    except ValueError:
        raise SlurmError(f"{name}={env[name]!r} is not an integer") from None


def _by_component(layout: list[dict], component: int) -> dict:
    for group in layout:
        if group["component"] == component:
            return group
    raise SlurmError(f"component {component} (het group) is not in HPCRL_LAYOUT (components: "
                     f"{', '.join(str(g['component']) for g in layout)})")


def _by_name(layout: list[dict], name: str) -> dict:
    for group in layout:
        if group["name"] == name:
            return group
    raise SlurmError(f"HPCRL_GROUP={name!r} is not in HPCRL_LAYOUT ({', '.join(g['name'] for g in layout)})")


def step_components(env: Mapping[str, str]) -> list[int]:
    """The components (het-group indices) of this task's step, in task order."""
    if env.get("HPCRL_STEP_COMPONENTS"):
        return [int(i) for i in env["HPCRL_STEP_COMPONENTS"].split(",")]
    step_nodes = set(expand_nodelist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")))
    found = []
    for i in range(_int(env, "SLURM_HET_SIZE")):
        nodes = env.get(f"SLURM_JOB_NODELIST_HET_GROUP_{i}")
        if nodes and set(expand_nodelist(nodes)) <= step_nodes:
            found.append(i)
    if not found:
        raise SlurmError("no het group's nodes lie inside this step's nodes (SLURM_STEP_NODELIST="
                         f"{env.get('SLURM_STEP_NODELIST')!r}); set HPCRL_STEP_COMPONENTS")
    return found


def identify_task(env: Mapping[str, str]) -> TaskIdentity:
    """The identity of the task whose environment is `env` (see the module docstring)."""
    layout = _layout(env)
    local_rank = int(env.get("SLURM_LOCALID", env.get("HPCRL_LOCAL_RANK", "0")))
    if env.get("HPCRL_GROUP") and "HPCRL_RELAUNCH_RANK" in env:  # one task started again by the head
        group = _by_name(layout, env["HPCRL_GROUP"])
        rank = _int(env, "HPCRL_RELAUNCH_RANK")
        local_rank = int(env.get("HPCRL_LOCAL_RANK", "0"))  # its step has one task: SLURM_LOCALID is 0
        node = env.get("SLURMD_NODENAME") or env.get("HPCRL_NODE") or socket.gethostname()
        nodes = expand_nodelist(env.get(f"SLURM_JOB_NODELIST_HET_GROUP_{group['component']}", node))
        node_index = nodes.index(node) if node in nodes else 0
    elif env.get("HPCRL_GROUP") and "HPCRL_RANK" in env:  # local executor
        group = _by_name(layout, env["HPCRL_GROUP"])
        rank = _int(env, "HPCRL_RANK")
        node_index = int(env.get("HPCRL_NODE_INDEX", "0"))
        node = env.get("HPCRL_NODE") or socket.gethostname()
    elif env.get("HPCRL_GROUP"):  # split layout: one step per group
        group = _by_name(layout, env["HPCRL_GROUP"])
        rank = _int(env, "SLURM_PROCID")
        node_index = int(env.get("SLURM_NODEID", "0"))
        node = env.get("SLURMD_NODENAME") or socket.gethostname()
    elif env.get("SLURM_HET_SIZE"):  # hetjob step, possibly spanning several components
        procid = _int(env, "SLURM_PROCID")
        offset = 0
        for component in step_components(env):
            tasks = _int(env, f"SLURM_NTASKS_HET_GROUP_{component}")
            if procid < offset + tasks:
                break
            offset += tasks
        else:
            raise SlurmError(f"SLURM_PROCID={procid} is beyond the {offset} tasks of this step's components")
        group = _by_component(layout, component)
        rank = procid - offset
        node = env.get("SLURMD_NODENAME") or socket.gethostname()
        nodes = expand_nodelist(env.get(f"SLURM_JOB_NODELIST_HET_GROUP_{component}", node))
        node_index = nodes.index(node) if node in nodes else 0
    else:
        raise SlurmError("cannot tell which group this task is: neither HPCRL_GROUP nor SLURM_HET_SIZE "
                         "is set; group processes are started by the head (hpcrl submit)")
    return TaskIdentity(group=group["name"], component=group["component"], rank=rank,
                        group_size=group["tasks"], replica=rank // max(1, group["ranks_per_replica"]),
                        local_rank=local_rank, node=node, node_index=node_index)
