"""Starting one group: the argv of its srun step (pure) and the running step (processes).

    hetjob  srun --het-group=i --nodes=N --ntasks=T --ntasks-per-node=K [resources] --output=.../rank%t.log
    split   srun --nodes=N --ntasks=T --nodelist=<the group's node range> [resources] --output=...
            (and --no-kill when the job holds spare nodes: a lost node then ends only its own tasks,
            not the step's tasks on the other nodes; docs/FACTS.md)
    local   T processes on this machine, each the leader of its own POSIX process group (os.killpg)

[resources] are the component's, as in its #SBATCH block (hpcrl.config.components): --cpus-per-task
(srun does not inherit sbatch's since Slurm 22.05), --mem of each node, and --gres=gpu:N, all of
the node's GPUs of the component, which each task then narrows to its own block by its local rank
(hpcrl.plan.placement). A task started again alone gets the same --gres on the same node (-w) and
its old local rank, hence the same GPUs. OMP_NUM_THREADS is set to the task's CPUs.

`%t` in an srun output path is the task's rank within the step, i.e. within the group; `%j`
is avoided on purpose (in a hetjob it expands to each component's own id). srun returns the
largest exit code of its tasks; the local step does the same.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpcrl.config.components import mem_gib
from hpcrl.plan.placement import PlacementError, step_gpus
from hpcrl.rundir import LOGS_DIR, log_path
from hpcrl.slurm.spec import GroupSlot


def resource_args(slot: GroupSlot, *, tasks: int | None = None) -> list[str]:
    """srun options giving a step of `slot` its CPUs, memory and GPUs; `tasks` on one node (a task started
    again alone) asks that node's share of the memory instead of the whole node's."""
    c = slot.component
    args = [f"--cpus-per-task={c.cpus_per_task}"] if c.cpus_per_task else []
    if c.mem and c.mem != "0":
        if tasks is None:
            args.append(f"--mem={c.mem}")
        else:
            args.append(f"--mem={max(1, int(mem_gib(c.mem) * 1024 * tasks / c.tasks_per_node))}M")
    if c.gpus_per_node:
        args.append(f"--gres=gpu:{c.gpus_per_node}")
    return args


def task_env(slot: GroupSlot, env: Mapping[str, str]) -> dict[str, str]:
    """The environment of a step of `slot`: `env`, with OMP_NUM_THREADS = its CPUs per task (when known)."""
    out = dict(env)
    if slot.component.cpus_per_task:
        out["OMP_NUM_THREADS"] = str(slot.component.cpus_per_task)
    return out


def srun_argv(slot: GroupSlot, *, layout: str, run_dir: Path, python: str,
              nodelist: list[str] | None = None, no_kill: bool = False, again: bool = False) -> list[str]:
    """The srun command line starting every task of `slot` (pure); `no_kill`: a lost node ends only its tasks;
    `again`: the group started again inside the job (the trainer after a lost rank), beside what its old step
    may still hold (--overlap: a step with a task on a lost node lives until Slurm marks the node down), its
    logs appended to."""
    c = slot.component
    argv = ["srun", "--unbuffered", "--kill-on-bad-exit=0", f"--job-name={slot.name}"]
    argv += ["--no-kill"] if no_kill else []
    argv += ["--overlap", "--open-mode=append"] if again else []
    if layout == "hetjob":
        argv.append(f"--het-group={c.index}")
    else:
        assert nodelist is not None, "a split step needs the group's nodes"
        argv.append(f"--nodelist={','.join(nodelist)}")
    argv += [f"--nodes={c.nodes}", f"--ntasks={c.tasks}", f"--ntasks-per-node={c.tasks_per_node}",
             *resource_args(slot), f"--output={Path(run_dir) / LOGS_DIR / slot.name / 'rank%t.log'}",
             python, "-u", "-m", slot.module, slot.name]
    return argv


def replacement_argv(slot: GroupSlot, rank: int, *, layout: str, run_dir: Path, python: str,
                     node: str | None) -> list[str]:
    """The srun command line starting rank `rank` of `slot` again, alone, on `node` (pure)."""
    argv = ["srun", "--unbuffered", "--overlap", f"--job-name={slot.name}-{rank}", "--nodes=1", "--ntasks=1"]
    argv += [f"--het-group={slot.component.index}"] if layout == "hetjob" else []
    argv += [f"--nodelist={node}"] if node else []
    argv += [*resource_args(slot, tasks=1), "--open-mode=append", f"--output={log_path(run_dir, slot.name, rank)}",
             python, "-u", "-m", slot.module, slot.name]
    return argv


@dataclass
class Step:
    """A started group: one srun process, or one process per task (local)."""

    slot: GroupSlot
    procs: list[subprocess.Popen]
    local: bool
    ranks: range
    """Group ranks of the step's tasks: all of the group's, or the one task started again."""
    returncode: int | None = field(default=None)

    def poll(self) -> int | None:
        """None while any process runs; then the largest exit code (a signal counts as 128+N)."""
        if self.returncode is None:
            codes = [code for code in (p.poll() for p in self.procs) if code is not None]
            if len(codes) < len(self.procs):  # some still run
                return None
            self.returncode = max(128 - c if c < 0 else c for c in codes)
        return self.returncode

    def terminate(self) -> None:
        """SIGTERM every process (local: its whole POSIX process group)."""
        for proc in self.procs:
            try:
                if self.local:  # the whole POSIX process group: children outlive a task killed by SIGKILL
                    os.killpg(proc.pid, signal.SIGTERM)
                elif proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass  # ended between poll() and the signal

    def kill(self) -> None:
        """SIGKILL what is left (local: the whole POSIX process group)."""
        for proc in self.procs:
            try:
                if self.local:
                    os.killpg(proc.pid, signal.SIGKILL)
                elif proc.poll() is None:
                    proc.kill()
            except ProcessLookupError:
                pass  # ended in between


def start_slurm_step(slot: GroupSlot, *, layout: str, run_dir: Path, python: str,
                     env: Mapping[str, str], nodelist: list[str] | None = None, no_kill: bool = False,
                     again: bool = False) -> Step:
    step_env = task_env(slot, env)
    if layout == "hetjob":
        step_env["HPCRL_STEP_COMPONENTS"] = str(slot.component.index)
    else:
        step_env["HPCRL_GROUP"] = slot.name
    argv = srun_argv(slot, layout=layout, run_dir=run_dir, python=python, nodelist=nodelist, no_kill=no_kill,
                     again=again)
    proc = subprocess.Popen(argv, env=step_env, stdin=subprocess.DEVNULL)
    return Step(slot=slot, procs=[proc], local=False, ranks=range(slot.component.tasks))


def start_replacement(slot: GroupSlot, rank: int, *, executor: str, layout: str, run_dir: Path, python: str,
                      env: Mapping[str, str], node: str | None = None,
                      gpus: Mapping[tuple[str, int], str] | None = None) -> Step:
    """Start rank `rank` of `slot` again, alone (its log is appended to), e.g. a lost inference replica.

    Under Slurm: an srun step of one task in the group's component (hetjob) on `node`, the node the
    rank ran on or a spare node of the allocation (split), sharing the allocation with whatever the old step left (--overlap). The task keeps
    its local rank (HPCRL_LOCAL_RANK: ranks are laid out node by node), so it takes the same GPUs."""
    per_node = slot.component.tasks_per_node
    env_one = {**task_env(slot, env), "HPCRL_GROUP": slot.name, "HPCRL_RELAUNCH_RANK": str(rank),
               "HPCRL_LOCAL_RANK": str(rank % per_node)}
    log = log_path(run_dir, slot.name, rank)
    if executor == "local":
        env_one["HPCRL_NODE_INDEX"] = str(rank // per_node)
        if gpus and (slot.name, rank) in gpus:
            env_one["CUDA_VISIBLE_DEVICES"] = gpus[(slot.name, rank)]
        with open(log, "ab") as out:
            proc = subprocess.Popen([python, "-u", "-m", slot.module, slot.name], env=env_one, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return Step(slot=slot, procs=[proc], local=True, ranks=range(rank, rank + 1))
    argv = replacement_argv(slot, rank, layout=layout, run_dir=run_dir, python=python, node=node)
    proc = subprocess.Popen(argv, env=env_one, stdin=subprocess.DEVNULL)
    return Step(slot=slot, procs=[proc], local=False, ranks=range(rank, rank + 1))


def local_gpu_blocks(groups: Sequence[GroupSlot], env: Mapping[str, str]) -> dict[tuple[str, int], str]:
    """The local executor's GPUs (every group on this one machine): each GPU task its own block, group after
    group, of this process's CUDA_VISIBLE_DEVICES (or 0, 1, ... when it is unset)."""
    visible, _ = step_gpus(env)
    needed = sum(slot.component.tasks * slot.component.gpus_per_task for slot in groups if slot.module)
    if not needed:
        return {}
    pool = list(visible) if visible else [str(index) for index in range(needed)]
    if len(pool) < needed:
        raise PlacementError(f"the run's GPU tasks need {needed} GPUs on this machine, but CUDA_VISIBLE_DEVICES="
                             f"{','.join(pool)} shows {len(pool)}. Fix: show more GPUs, or lower the config's GPUs")
    blocks, start = {}, 0
    for slot in groups:
        if not slot.module:
            continue
        per_task = slot.component.gpus_per_task
        for rank in range(slot.component.tasks):
            if per_task:
                blocks[(slot.name, rank)] = ",".join(pool[start:start + per_task])
                start += per_task
    return blocks


def start_local_step(slot: GroupSlot, *, run_dir: Path, python: str, env: Mapping[str, str],
                     gpus: Mapping[tuple[str, int], str] | None = None) -> Step:
    procs, per_node = [], slot.component.tasks_per_node
    for rank in range(slot.component.tasks):
        one_env = {**task_env(slot, env), "HPCRL_GROUP": slot.name, "HPCRL_RANK": str(rank),
                   "HPCRL_NODE_INDEX": str(rank // per_node), "HPCRL_LOCAL_RANK": str(rank % per_node)}
        if gpus and (slot.name, rank) in gpus:
            one_env["CUDA_VISIBLE_DEVICES"] = gpus[(slot.name, rank)]
        with open(log_path(run_dir, slot.name, rank), "ab") as log:
            procs.append(subprocess.Popen([python, "-u", "-m", slot.module, slot.name], env=one_env,
                                          stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    return Step(slot=slot, procs=procs, local=True, ranks=range(slot.component.tasks))
