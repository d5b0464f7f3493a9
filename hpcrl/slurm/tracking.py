"""Where a job stands, with or without accounting (hetjob ids handled).

    sacct -j ID -X --parsable2 -o JobID,State,ExitCode,NodeList,Elapsed    when accounting works
                                           (once it has every component ended: it lags a live job)
    squeue -h --states=all -j ID -o %i|%T|%N|%M                            otherwise, and for live
                   jobs (Slurm keeps ended jobs in squeue for MinJobAge, 300 s by default)

A hetjob shows one row per component, `N+0`, `N+1`, ...; a plain job one row `N`. When
neither command knows the job any more, the state is ENDED (gone from the controller and no
accounting to say how): a terminal state, so nothing waits for ever; the run directory's
exit.json, written by the head, then says how it ended.

The parsers are pure and tested on recorded output; `query` runs the commands.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from hpcrl.errors import SlurmError

#: States after which a job never runs again by itself.
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                      "BOOT_FAIL", "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED", "ENDED"})
_FAILURES = ("FAILED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED")
_ACTIVE = ("RUNNING", "COMPLETING", "CONFIGURING", "STAGE_OUT", "SUSPENDED", "RESIZING", "SIGNALING")
_ID_RE = re.compile(r"^(\d+)(?:\+(\d+))?$")


@dataclass(frozen=True, kw_only=True)
class ComponentState:
    job_id: str
    """As Slurm prints it: "N+i" for hetjob component i, "N" for a plain job."""
    component: int
    state: str
    nodes: str = ""
    elapsed: str = ""
    exit_code: str = ""


@dataclass(frozen=True, kw_only=True)
class JobState:
    job_id: str
    state: str
    components: tuple[ComponentState, ...]
    source: str
    """"sacct", "squeue", or "none" (the controller has forgotten the job)."""

    @property
    def done(self) -> bool:
        return self.state in TERMINAL


def _component(job_id: str) -> int | None:
    match = _ID_RE.match(job_id)
    if not match:
        return None  # a step ("N+0.batch") or an array row
    return int(match.group(2) or 0)


def _first_word(state: str) -> str:
    return state.split()[0].upper() if state.strip() else "UNKNOWN"


def parse_sacct(text: str) -> list[ComponentState]:
    """Rows of `sacct -X --parsable2 -o JobID,State,ExitCode,NodeList,Elapsed` (with its header)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    names = lines[0].split("|")
    rows = []
    for line in lines[1:]:
        row = dict(zip(names, line.split("|")))
        component = _component(row.get("JobID", ""))
        if component is None:
            continue
        rows.append(ComponentState(job_id=row["JobID"], component=component, state=_first_word(row.get("State", "")),
                                   nodes=row.get("NodeList", ""), elapsed=row.get("Elapsed", ""),
                                   exit_code=row.get("ExitCode", "")))
    return sorted(rows, key=lambda r: r.component)


def parse_squeue(text: str) -> list[ComponentState]:
    """Rows of `squeue -h --states=all -o %i|%T|%N|%M`."""
    rows = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 2:
            continue
        component = _component(parts[0])
        if component is None:
            continue
        rows.append(ComponentState(job_id=parts[0], component=component, state=_first_word(parts[1]),
                                   nodes=parts[2] if len(parts) > 2 else "",
                                   elapsed=parts[3] if len(parts) > 3 else ""))
    return sorted(rows, key=lambda r: r.component)


def overall_state(states: list[str]) -> str:
    """One state for the run from its components' states.

    Terminal only when every component is: a run whose head has ended while other components
    still complete is COMPLETING, so a caller waiting for CANCELLED sees every component gone.
    """
    if not states:
        return "UNKNOWN"
    if any(s in _ACTIVE for s in states):
        return "RUNNING" if all(s == "RUNNING" for s in states) else "COMPLETING"
    for bad in _FAILURES:
        if bad in states:
            return bad
    if "CANCELLED" in states:
        return "CANCELLED"
    if all(s == "COMPLETED" for s in states):
        return "COMPLETED"
    if all(s in TERMINAL for s in states):
        return "ENDED"
    return next(s for s in states if s not in TERMINAL)  # PENDING, REQUEUED, ...


def _run(argv: list[str], env: Mapping[str, str] | None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30, env=dict(env) if env else None)
    except FileNotFoundError:
        raise SlurmError(f"{argv[0]} is not on PATH: run on a node of the Slurm cluster") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(argv)} did not answer in 30 s: is slurmctld up?") from None


def _squeue_rows(leader: str, env: Mapping[str, str] | None) -> list[ComponentState]:
    """squeue's rows of job `leader` (every component); [] when the controller no longer knows it."""
    done = _run(["squeue", "-h", "--states=all", "-j", leader, "-o", "%i|%T|%N|%M"], env)
    if done.returncode != 0 and "Invalid job id" not in done.stderr:
        raise SlurmError(f"squeue failed for job {leader}: {done.stderr.strip()[-300:]}")
    return [r for r in parse_squeue(done.stdout) if r.job_id.split("+")[0] == leader] if done.returncode == 0 else []


def query(job_id: str, env: Mapping[str, str] | None = None) -> JobState:
    """The job's state: sacct's when accounting works and has the whole job ended, else squeue's.

    slurmdbd records asynchronously: for a moment sacct can show a started job PENDING, or
    only some components of a hetjob. So sacct speaks when it has every component squeue lists
    and they have ended, or when the controller has forgotten the job; squeue otherwise.
    """
    leader = job_id.split("+")[0]
    accounted = None
    done = _run(["sacct", "-j", leader, "-X", "--parsable2", "-o", "JobID,State,ExitCode,NodeList,Elapsed"], env)
    if done.returncode == 0:
        rows = [r for r in parse_sacct(done.stdout) if r.job_id.split("+")[0] == leader]
        if rows:
            accounted = JobState(job_id=leader, state=overall_state([r.state for r in rows]),
                                 components=tuple(rows), source="sacct")
    rows = _squeue_rows(leader, env)
    if not rows:
        return accounted or JobState(job_id=leader, state="ENDED", components=(), source="none")
    if accounted and accounted.done and len(accounted.components) >= len(rows):
        return accounted
    return JobState(job_id=leader, state=overall_state([r.state for r in rows]), components=tuple(rows),
                    source="squeue")


def requeue_under_way(states: list[str]) -> bool:
    """True when some components of a hetjob that still runs are already back in the queue: Slurm is
    requeueing it (a node failed), component by component. Pure."""
    words = [_first_word(state) for state in states]
    return any(w in ("PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD") for w in words) and any(
        w in _ACTIVE for w in words)


def being_requeued(job_id: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether Slurm is requeueing job `job_id` right now (see requeue_under_way); False when unsure."""
    try:
        rows = _squeue_rows(job_id.split("+")[0], env)
    except SlurmError:
        return False
    return requeue_under_way([r.state for r in rows])


def slurm_env(slurm_conf: str) -> dict[str, str]:
    """This process's environment, pointed at the cluster of `slurm_conf` when one is given."""
    env = dict(os.environ)
    if slurm_conf:
        env["SLURM_CONF"] = slurm_conf
    return env
