"""Starting one group: the argv of its srun step (pure) and the running step (processes).

    hetjob  srun --het-group=i --nodes=N --ntasks=T --ntasks-per-node=K --output=.../rank%t.log
    split   srun --nodes=N --ntasks=T --nodelist=<the group's node range> --output=...
    local   T processes on this machine, each the leader of its own process group

`%t` in an srun output path is the task's rank within the step, i.e. within the group; `%j`
is avoided on purpose (in a hetjob it expands to each component's own id). srun returns the
largest exit code of its tasks; the local step does the same.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from hpcrl.rundir import LOGS_DIR, log_path
from hpcrl.slurm.spec import GroupSlot


def srun_argv(slot: GroupSlot, *, layout: str, run_dir: Path, python: str,
              nodelist: list[str] | None = None) -> list[str]:
    """The srun command line starting every task of `slot` (pure)."""
    argv = ["srun", "--unbuffered", "--kill-on-bad-exit=0", f"--job-name={slot.name}"]
    if layout == "hetjob":
        argv.append(f"--het-group={slot.component}")
    else:
        assert nodelist is not None, "a split step needs the group's nodes"
        argv.append(f"--nodelist={','.join(nodelist)}")
    argv += [f"--nodes={slot.nodes}", f"--ntasks={slot.tasks}", f"--ntasks-per-node={slot.tasks_per_node}",
             f"--output={Path(run_dir) / LOGS_DIR / slot.name / 'rank%t.log'}",
             python, "-u", "-m", slot.module, slot.name]
    return argv


@dataclass
class Step:
    """A started group: one srun process, or one process per task (local)."""

    slot: GroupSlot
    procs: list[subprocess.Popen]
    local: bool
    returncode: int | None = field(default=None)
    first_rank: int = 0
    """Group rank of the step's first task (not 0 for one task started again)."""

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.slot.tasks)

    def poll(self) -> int | None:
        """None while any process runs; then the largest exit code (a signal counts as 128+N)."""
        if self.returncode is None:
            codes = [code for code in (p.poll() for p in self.procs) if code is not None]
            if len(codes) < len(self.procs):  # some still run
                return None
            self.returncode = max(128 - c if c < 0 else c for c in codes)
        return self.returncode

    def terminate(self) -> None:
        """SIGTERM every process (local: its whole process group)."""
        for proc in self.procs:
            try:
                if self.local:  # the whole process group: children outlive a task killed by SIGKILL
                    os.killpg(proc.pid, signal.SIGTERM)
                elif proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass  # ended between poll() and the signal

    def kill(self) -> None:
        """SIGKILL what is left (local: the whole process group)."""
        for proc in self.procs:
            try:
                if self.local:
                    os.killpg(proc.pid, signal.SIGKILL)
                elif proc.poll() is None:
                    proc.kill()
            except ProcessLookupError:
                pass  # ended in between


def start_slurm_step(slot: GroupSlot, *, layout: str, run_dir: Path, python: str,
                     env: Mapping[str, str], nodelist: list[str] | None = None) -> Step:
    step_env = dict(env)
    if layout == "hetjob":
        step_env["HPCRL_STEP_GROUPS"] = str(slot.component)
    else:
        step_env["HPCRL_GROUP"] = slot.name
    argv = srun_argv(slot, layout=layout, run_dir=run_dir, python=python, nodelist=nodelist)
    proc = subprocess.Popen(argv, env=step_env, stdin=subprocess.DEVNULL)
    return Step(slot=slot, procs=[proc], local=False)


def start_replacement(slot: GroupSlot, rank: int, *, executor: str, layout: str, run_dir: Path, python: str,
                      env: Mapping[str, str], node: str | None = None) -> Step:
    """Start rank `rank` of `slot` again, alone (its log is appended to), e.g. a lost inference replica.

    Under Slurm: an srun step of one task in the group's component (hetjob) or on `node` (split),
    sharing the allocation with whatever the old step left (--overlap)."""
    one = replace(slot, nodes=1, tasks_per_node=1)
    task_env = {**env, "HPCRL_GROUP": slot.name, "HPCRL_RELAUNCH_RANK": str(rank)}
    log = log_path(run_dir, slot.name, rank)
    if executor == "local":
        with open(log, "ab") as out:
            proc = subprocess.Popen([python, "-u", "-m", slot.module, slot.name], env=task_env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return Step(slot=one, procs=[proc], local=True, first_rank=rank)
    argv = ["srun", "--unbuffered", "--overlap", f"--job-name={slot.name}-{rank}", "--nodes=1", "--ntasks=1"]
    argv += [f"--het-group={slot.component}"] if layout == "hetjob" else []
    argv += [f"--nodelist={node}"] if node else []
    argv += ["--open-mode=append", f"--output={log}", python, "-u", "-m", slot.module, slot.name]
    proc = subprocess.Popen(argv, env=task_env, stdin=subprocess.DEVNULL)
    return Step(slot=one, procs=[proc], local=False, first_rank=rank)


def start_local_step(slot: GroupSlot, *, run_dir: Path, python: str, env: Mapping[str, str]) -> Step:
    procs = []
    for rank in range(slot.tasks):
        task_env = {**env, "HPCRL_GROUP": slot.name, "HPCRL_RANK": str(rank),
                    "HPCRL_NODE_INDEX": str(rank // slot.tasks_per_node),
                    "HPCRL_LOCAL_RANK": str(rank % slot.tasks_per_node)}
        with open(log_path(run_dir, slot.name, rank), "ab") as log:
            procs.append(subprocess.Popen([python, "-u", "-m", slot.module, slot.name], env=task_env,
                                          stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    return Step(slot=slot, procs=procs, local=True)
