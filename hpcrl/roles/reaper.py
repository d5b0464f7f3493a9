"""Nothing a group task started outlives it: the task runs under a small supervisor that reaps.

    python -m hpcrl.roles inference      (what srun starts)
      supervisor  pid S   subreaper; passes TERM/HUP/USR1/USR2 on; exits as the task did
        task      pid T   the role: vLLM's LLM(...), the bus, ...
          EngineCore      (vLLM)  -+ if T dies (kill -9, OOM killer), these are re-parented to S,
            VLLM::Worker  (vLLM)  -+ which ends them (TERM, then KILL after a grace) before it exits
                                        (on GPUs; on CPU the engine core runs inside T, and a worker
                                        process exists only with tensor parallelism)

vLLM's engine process has no parent-death watch: when the task that built `LLM(...)` is killed,
its EngineCore and workers live on and keep their memory (GPUs, or ~5 GB of RAM each on CPU).
Slurm does not always help: proctrack/linuxproc loses re-parented processes, and with cgroups the
step lives on while its other tasks run (an inference step holds every replica of the group). So
each group task forks first thing: the parent marks itself a child subreaper (prctl), waits for the
task, then ends every process left below it, and exits with the task's status (re-raising the
task's signal, so srun and the head see what they saw before).

The supervisor is also the one that tells the head how the task ended (`on_exit`: hpcrl.roles.serve
sends the exit code as an authenticated BYE on the bus, hpcrl.bus.farewell), so a task killed
with -9 is reported at once, with its signal, instead of after the bus's heartbeat timeout.

TERM, HUP, USR1 and USR2 sent to the supervisor are passed on to the task. Slurm and the local
executor signal the whole process group or every process of the step, so the task may see one of
these twice: group tasks keep the default actions (end), for which that is the same as once.
SIGINT comes from a terminal or srun, which reach the task directly: the supervisor ignores it,
so a Ctrl-C is not doubled into the task's clean-up.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

#: prctl(2) option that makes orphaned descendants re-parent to this process instead of init.
PR_SET_CHILD_SUBREAPER = 36
#: Seconds the processes a task left get between SIGTERM (vLLM's engine cleans its shared memory) and SIGKILL.
GRACE_S = 5.0
#: Seconds the processes a task left get to end by themselves before they are signalled.
SETTLE_S = 0.5
FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)

log = logging.getLogger(__name__)


def _set_child_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _parents() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command name) of every process visible in /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:  # ended while we looked
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split at the last ')'.
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":  # a zombie holds nothing; reaping it is our waitpid's job
            table[int(entry)] = (int(fields[1]), name)
    return table


def descendants(pid: int) -> dict[int, str]:
    """pid -> command name of every live process below `pid` (children, their children, ...)."""
    table = _parents()
    below: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, name) in table.items():
            if ppid == parent and child not in below:
                below[child] = name
                frontier.append(child)
    return below


def live(pids) -> list[int]:
    """Those of `pids` that are still running (not ended, not zombies)."""
    table = _parents()
    return [pid for pid in pids if pid in table]


def session_pids(sid: int) -> list[int]:
    """The live processes of session `sid` (a process started with start_new_session and all it spawned)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def shared_memory_of(pids) -> set[str]:
    """/dev/shm files the processes map or hold open (vLLM's message queues: left behind when it is killed)."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                lines = maps.read().splitlines()
            for line in lines:
                if "/dev/shm/" in line:
                    found.add(line.split(None, 5)[-1].replace(" (deleted)", ""))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    found.add(target.replace(" (deleted)", ""))
        except OSError:
            pass
    return found


def _reap() -> None:
    """Collect every ended child (re-parented ones included) without blocking."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _signal_all(pids, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_below(me: int, wait_s: float, seen: dict[int, str]) -> dict[int, str]:
    """What is still below `me` after up to `wait_s` of letting it end; `seen` gathers every process met."""
    deadline = time.monotonic() + wait_s
    left = descendants(me)
    seen.update(left)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        _reap()
        left = descendants(me)
        seen.update(left)  # a process that ends hands its children to us: they appear here
    return left


def end_left_behind(grace_s: float, settle_s: float = 0.0) -> dict[int, str]:
    """SIGTERM every process below this one, SIGKILL what is left after `grace_s`; returns who was ended.

    Processes that end by themselves within `settle_s` are not signalled (e.g. multiprocessing's
    resource tracker, which ends when the task's end closes its pipe)."""
    me = os.getpid()
    left = _wait_below(me, settle_s, {})
    if not left:
        return {}
    ended = dict(left)
    _signal_all(left, signal.SIGTERM)
    left = _wait_below(me, grace_s, ended)
    while left:  # KILL until nothing is below us: a killed parent hands its children to us
        _signal_all(left, signal.SIGKILL)
        left = _wait_below(me, 0.02, ended)
    _reap()
    return ended


def _describe(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def _exit_as(status: int) -> None:
    code = os.waitstatus_to_exitcode(status)
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:  # die of the same signal, so srun reports the task as the task ended
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two keep their default action anyway
            signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


def exit_code(status: int) -> int:
    """The code a shell or srun reports for a wait status: the exit code, or 128 + the signal."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def supervise(label: str, on_exit: Callable[[int, str], object] | None = None) -> None:
    """Fork; return in the child (the task), never in the parent, which reaps and exits as the child did.

    `on_exit(code, how)` runs in the parent as soon as the task has ended (code as `exit_code`,
    how e.g. "killed by SIGKILL"), before what it left running is ended; its failure is logged
    and changes nothing else. Call this first thing in a process that will start others, before
    any thread exists. Where the kernel has no child subreapers (not Linux) it returns without
    forking, and `on_exit` is never called."""
    if not _set_child_subreaper():
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # none may end the parent before its handlers
    child = os.fork()
    if child == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in FORWARDED:
        signal.signal(sig, lambda sig, _frame: _forward(child, sig))
    signal.pthread_sigmask(signal.SIG_SETMASK, held)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:  # cannot happen while the task is our child; leave as if it had failed
            os._exit(1)
        if pid == child:
            break
    if on_exit is not None:
        try:
            on_exit(exit_code(status), _describe(status))
        except Exception as err:  # noqa: BLE001 - telling the head is best effort; reaping must go on
            log.error(f"{label}: could not report the task's end: {type(err).__name__}: {err}")
    ended = end_left_behind(GRACE_S, SETTLE_S)
    if ended:
        names = ", ".join(f"{name} (pid {pid})" for pid, name in sorted(ended.items()))
        log.warning(f"{label}: the task (pid {child}) {_describe(status)}; ended what it left running: {names}")
    _exit_as(status)


def _forward(child: int, sig: int) -> None:
    try:
        os.kill(child, sig)
    except ProcessLookupError:
        pass
