"""A submitted run seen from the login node: status, logs, cancel, wait.

Every function takes a run directory (job.json says which executor and job id) or, for
status, a bare Slurm job id. Slurm runs are tracked by hpcrl.slurm.tracking (sacct, else
squeue); local runs by their controller process and the head's exit.json. Waiting always
ends: a job the controller has forgotten is ENDED, and exit.json says how.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hpcrl.bus.config import REFUSED_FILE
from hpcrl.errors import SlurmError
from hpcrl.launch.requeues import describe_requeues
from hpcrl.rundir import (
    EXIT_FILE,
    JOB_FILE,
    LAUNCH_FILE,
    LOGS_DIR,
    METRICS_FILE,
    RECOVERIES_FILE,
    REQUEUES_FILE,
    read_json,
)
from hpcrl.slurm import tracking


@dataclass(frozen=True)
class Row:
    component: str
    state: str
    nodes: str = ""
    elapsed: str = ""


@dataclass(frozen=True)
class RunStatus:
    job_id: str
    executor: str
    state: str
    rows: tuple[Row, ...] = ()
    source: str = ""
    failures: tuple[str, ...] = ()
    last_metrics: str = ""
    run_dir: Path | None = None
    refused: tuple[tuple[str, int], ...] = ()
    """Messages the head's bus refused, by reason (forged, too large, ...): a flood shows here."""
    spare_nodes: int = 0
    """Idle nodes the job holds for lost tasks (cluster.spare_nodes)."""
    recoveries: tuple[str, ...] = ()
    """Each task the head started again on a spare node, inside the job (RECOVERIES_FILE)."""
    spares_used: int = 0
    """How many of them a recovery took (an in-place restart takes none)."""
    requeues: tuple[str, ...] = ()
    """Each requeue of the job (REQUEUES_FILE): outside the allocation, the last resort."""

    @property
    def done(self) -> bool:
        return self.state in tracking.TERMINAL

    def render(self) -> str:
        where = f" ({self.run_dir})" if self.run_dir else ""
        lines = [f"job {self.job_id or '-'} [{self.executor}]{where}: {self.state}"
                 + (f"  (from {self.source})" if self.source else "")]
        if self.rows:
            lines.append(f"  {'component':<12} {'state':<12} {'nodes':<16} elapsed")
            lines += [f"  {r.component:<12} {r.state:<12} {r.nodes:<16} {r.elapsed}" for r in self.rows]
        lines += [f"  failed: {f}" for f in self.failures]
        if self.spare_nodes:
            lines.append(f"  spare nodes: {self.spare_nodes} (used: {self.spares_used})")
        lines += [f"  recovered: {r}" for r in self.recoveries]
        lines += [f"  requeued: {r}" for r in self.requeues]
        if self.last_metrics:
            lines.append(f"  last metrics: {self.last_metrics}")
        if self.refused:
            lines.append(f"  bus refused {sum(n for _, n in self.refused)} message(s): "
                         + ", ".join(f"{reason} {n}" for reason, n in self.refused))
        return "\n".join(lines)


@dataclass(frozen=True)
class Run:
    """A run directory with a submitted job."""

    run_dir: Path
    executor: str
    job_id: str
    slurm_conf: str = ""
    groups: tuple[str, ...] = field(default=())
    process: dict | None = None
    """Local runs: the controller's identity at submit time (process_identity), to tell it from a later
    process given the same pid; None in a job.json written before it was recorded."""
    submitted_at: float = 0.0

    @classmethod
    def open(cls, run_dir: Path | str) -> Run:
        run_dir = Path(run_dir)
        if not (run_dir / JOB_FILE).is_file():
            hint = ("it was prepared by --dry-run but never submitted" if (run_dir / LAUNCH_FILE).is_file()
                    else "it is not a run directory")
            raise SlurmError(f"{run_dir} has no {JOB_FILE}: {hint}; submit with `hpcrl submit CONFIG`")
        job = read_json(run_dir / JOB_FILE)
        return cls(run_dir=run_dir, executor=job["executor"], job_id=str(job["job_id"]),
                   slurm_conf=job.get("slurm_conf", ""), groups=tuple(job.get("groups", ())),
                   process=job.get("process"), submitted_at=float(job.get("submitted_at", 0.0)))

    @property
    def env(self) -> dict[str, str]:
        return tracking.slurm_env(self.slurm_conf)

    def exit_record(self) -> dict | None:
        path = self.run_dir / EXIT_FILE
        return read_json(path) if path.is_file() else None


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on, or None when there is no such process. The command name
    (field 2) is cut at the last ')': it may hold spaces and parentheses."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()


def _cmdline(pid: int | str) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except (FileNotFoundError, ProcessLookupError):
        return []


def process_identity(pid: int, *, exec_wait_s: float = 2.0) -> dict | None:
    """What tells process `pid` from a later one given the same pid after it ended: its start time in
    clock ticks after boot (/proc/<pid>/stat field 22, set at fork, fixed for the life of a process)
    and its command line. Recorded in job.json when a local run is submitted; None when there is no
    such process. A child just returned by Popen may still show its parent's command line, or none,
    for a moment (the kernel closes the exec-error pipe Popen waits on before it sets up the new
    program's arguments): this waits up to `exec_wait_s` for the new one."""
    fields = _proc_stat(pid)
    if fields is None:
        return None
    start_ticks = int(fields[22 - 3])
    parent = _cmdline("self")
    deadline = time.monotonic() + exec_wait_s
    cmdline = _cmdline(pid)
    while (not cmdline or cmdline == parent) and time.monotonic() < deadline and fields[0] != "Z":
        time.sleep(0.005)
        cmdline, fields = _cmdline(pid), _proc_stat(pid) or ["Z"]
    return {"pid": pid, "start_ticks": start_ticks, "cmdline": cmdline}


def _started_at(ticks: int) -> float:
    """A start time in clock ticks after boot as seconds since the epoch (to about a second: btime is whole)."""
    btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                 if line.startswith("btime "))
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def _local_alive(pid: int, identity: dict | None = None, *, started_by: float = 0.0) -> bool:
    """True while the process runs (a zombie, ended but not reaped, counts as ended) and is the one
    meant: with `identity` (process_identity at submit time), the same start time and command line;
    with `started_by` (a time since the epoch) alone, started no later than that. Without either, any
    process with that pid. A pid the kernel gave to another process after ours ended is not ours:
    cancel must never signal it, status must not call the run RUNNING."""
    fields = _proc_stat(pid)
    if fields is None or fields[0] == "Z":
        return False
    if identity is not None:
        return (int(fields[22 - 3]) == identity.get("start_ticks")
                and (not identity.get("cmdline") or _cmdline(pid) == identity["cmdline"]))
    if started_by:
        return _started_at(int(fields[22 - 3])) <= started_by + 1.0  # btime's rounding
    return True


def _run_alive(run: Run) -> bool:
    """The local controller of `run` still runs (its pid is job_id; see _local_alive for reused pids)."""
    return _local_alive(int(run.job_id), run.process, started_by=run.submitted_at)


def _last_line(path: Path) -> str:
    if not path.is_file():
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 4096))
        lines = f.read().decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else ""


def _refused(run_dir: Path, record: dict | None) -> tuple[tuple[str, int], ...]:
    """The head's refused-message counters: exit.json's once the run ended, else the head's latest
    report (hpcrl.launch.head writes REFUSED_FILE when they change)."""
    counts = (record or {}).get("refused")
    if counts is None and (run_dir / REFUSED_FILE).is_file():
        counts = read_json(run_dir / REFUSED_FILE).get("refused")
    return tuple(sorted((str(k), int(v)) for k, v in (counts or {}).items()))


def _recovery_entries(run_dir: Path) -> list[dict]:
    """RUN_DIR/recoveries.json's entries: the head's recoveries inside the job (hpcrl.launch.supervisor)."""
    path = run_dir / RECOVERIES_FILE
    return read_json(path).get("recoveries", []) if path.is_file() else []


def _recoveries(entries: list[dict]) -> tuple[str, ...]:
    """The recoveries, one line each."""
    lines = []
    for e in entries:
        back = (f"registered {e['registered_after_s']} s later" if e.get("registered_after_s") is not None
                else "not registered yet")
        if e.get("ready_after_s") is not None:
            back += f", serving {e['ready_after_s']} s later"
        when = time.strftime("%H:%M:%S", time.localtime(e["at"]))
        if "ranks" in e:  # the trainer group, started again whole inside the job (hpcrl.launch.supervisor)
            again = (f"running again {e['running_again_after_s']} s later from step {e['resumed_from_step']}"
                     if e.get("running_again_after_s") is not None else "not running again yet")
            lines.append(f"{e['group']} rank(s) {', '.join(map(str, e['ranks']))} lost on {e['lost_on']} at {when} "
                         f"({e['why']}): the group started again on {e['restarted_on']}, {back}, {again}")
            continue
        lines.append(f"{e['group']} rank {e['rank']} lost on {e['lost_on']} at {when} ({e['why']}): started again "
                     f"on {e['restarted_on']}, {back}")
    return tuple(lines)


def _spares_used(entries: list[dict]) -> int:
    return sum(len(e["spares_used"]) if "spares_used" in e else int(e["restarted_on"] != e["lost_on"])
               for e in entries)


def _requeues(run_dir: Path) -> tuple[str, ...]:
    path = run_dir / REQUEUES_FILE
    return describe_requeues(read_json(path)) if path.is_file() else ()


def _spare_nodes(run_dir: Path) -> int:
    path = run_dir / LAUNCH_FILE
    return int(read_json(path).get("spare_nodes", 0)) if path.is_file() else 0


def status(target: str | Path) -> RunStatus:
    """The status of a run directory or a Slurm job id."""
    if str(target).isdigit() and not Path(target).is_dir():
        job = tracking.query(str(target))
        return RunStatus(job_id=job.job_id, executor="slurm", state=job.state, source=job.source,
                         rows=tuple(Row(c.job_id, c.state, c.nodes, c.elapsed) for c in job.components))
    run = Run.open(target)
    record = run.exit_record()
    failures = tuple(f"group {f['group']} rank {f['rank']} on node {f['node']}: {f['why']}"
                     if f.get("rank") is not None else f"group {f['group']}: {f['why']}"
                     for f in (record or {}).get("failures", []))
    if record and record.get("error") and not failures and record["state"] == "FAILED":
        failures = (record["error"],)
    metrics = _last_line(run.run_dir / METRICS_FILE)
    refused = _refused(run.run_dir, record)
    if run.executor == "local":
        state = "RUNNING" if _run_alive(run) else (record or {}).get("state", "ENDED")
        return RunStatus(job_id=run.job_id, executor="local", state=state, failures=failures,
                         last_metrics=metrics, run_dir=run.run_dir, source="process", refused=refused)
    job = tracking.query(run.job_id, run.env)
    state = job.state
    if state == "ENDED" and record:
        state = record["state"]
    names = {i: name for i, name in enumerate(run.groups)}
    recovered = _recovery_entries(run.run_dir)
    rows = tuple(Row(names.get(c.component, c.job_id) if len(job.components) > 1 else "all",
                     c.state, c.nodes, c.elapsed) for c in job.components)
    return RunStatus(job_id=run.job_id, executor="slurm", state=state, rows=rows, source=job.source,
                     failures=failures, last_metrics=metrics, run_dir=run.run_dir, refused=refused,
                     spare_nodes=_spare_nodes(run.run_dir), recoveries=_recoveries(recovered),
                     spares_used=_spares_used(recovered), requeues=_requeues(run.run_dir))


def wait(target: str | Path, *, timeout_s: float, poll_s: float = 0.5) -> RunStatus:
    """Poll until the run reaches a terminal state; SlurmError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = status(target)
        if current.done:
            return current
        if time.monotonic() > deadline:
            raise SlurmError(f"job {current.job_id} is still {current.state} after {timeout_s:g} s; "
                             f"`hpcrl cancel {target}` stops it")
        time.sleep(poll_s)


def _signal_local(run: Run) -> None:
    """SIGTERM the run's local controller (submitit's, which forwards it to the head), never a process
    that got its pid after it ended. Through a pidfd where the kernel has them: the identity is checked
    on the process the pidfd holds, and a pidfd never signals a later process, so no reuse can slip in
    between the check and the signal."""
    pid = int(run.job_id)
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): check, then signal by pid
        if _run_alive(run):
            os.kill(pid, signal.SIGTERM)
        return
    try:
        if _run_alive(run):
            signal.pidfd_send_signal(pidfd, signal.SIGTERM)
    except ProcessLookupError:
        pass  # it ended since the check
    finally:
        os.close(pidfd)


def cancel(run_dir: str | Path) -> Run:
    """Cancel every component of the run (scancel of the hetjob leader, or SIGTERM locally)."""
    run = Run.open(run_dir)
    if run.executor == "local":
        _signal_local(run)
        return run
    if status(run_dir).done:
        return run  # nothing left to cancel
    done = subprocess.run(["scancel", run.job_id], capture_output=True, text=True, timeout=30, env=run.env)
    if done.returncode != 0 and "already completing or completed" not in done.stderr:
        raise SlurmError(f"scancel {run.job_id} failed: {done.stderr.strip()[-300:]}")
    return run


def _discover(logs: Path, group: str | None, rank: int | None) -> list[Path]:
    folders = [logs / group] if group else sorted(p for p in logs.iterdir() if p.is_dir()) if logs.is_dir() else []
    files = []
    for folder in folders:
        ranked = sorted(folder.glob("rank*.log"), key=lambda p: int(p.stem[4:]) if p.stem[4:].isdigit() else -1)
        files += [p for p in ranked if rank is None or p.stem == f"rank{rank}"]
    return files


def log_files(run_dir: str | Path, *, group: str | None = None, rank: int | None = None,
              must_exist: bool = True) -> list[Path]:
    """The run's task logs (logs/<group>/rank<k>.log), optionally of one group or rank."""
    logs = Path(run_dir) / LOGS_DIR
    if group is not None and not (logs / group).is_dir():
        known = sorted(p.name for p in logs.iterdir()) if logs.is_dir() else []
        raise SlurmError(f"no logs for group {group!r} in {logs}; groups: {', '.join(known) or 'none yet'}")
    files = _discover(logs, group, rank)
    if must_exist and rank is not None and not files:
        raise SlurmError(f"no log for {group or 'any group'} rank {rank} in {logs}")
    return files


def tail_logs(run_dir: str | Path, *, group: str | None = None, rank: int | None = None,
           poll_s: float = 0.5) -> Iterator[tuple[Path, str]]:
    """Yield (file, line) as logs appear and grow, until the run has ended and all are drained."""
    offsets: dict[Path, int] = {}
    while True:
        ended = status(run_dir).done
        for path in log_files(run_dir, group=group, rank=rank, must_exist=False):
            with open(path, "rb") as f:
                f.seek(offsets.get(path, 0))
                data = f.read()
            complete = data if ended else data[:data.rfind(b"\n") + 1]
            offsets[path] = offsets.get(path, 0) + len(complete)
            for line in complete.decode(errors="replace").splitlines():
                yield path, line
        if ended:
            return
        time.sleep(poll_s)

