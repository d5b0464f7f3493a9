"""The first code of a code_tests sandbox (hpcrl.workers.sandbox starts it as `python -I` this file).

Standard library only: it runs before anything else in the new process and imports nothing of hpcrl.

    stdin: {"nonce", "status_fd", "parent", "cpu_s", ...the Limits} (JSON, then /dev/null)
    0. die with the reward worker (PR_SET_PDEATHSIG), and the namespace's first process with this one,
       so a worker the pool kills (its timeout) takes its sandbox down with it
    1. unshare user, network and PID namespaces: no network (only a loopback that is down), no view
       of the host's processes, and everything the code starts dies with the namespace's first process
    2. fork that first process (PID 1 inside); it sets the limits, runs solution.py then tests.py in one
       namespace, and writes {"passed": nonce} to the status pipe only if both ran to the end
    3. report the first process's host pid, then how it ended, on the status pipe (one JSON a line)

The nonce is read before the code runs, so code that exits early (sys.exit, os._exit) cannot pass.
"""

import ctypes
import json
import os
import resource
import select
import signal
import sys
import traceback

CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x10000000, 0x40000000, 0x20000000
PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)
#: The smallest pid_max Linux accepts (RESERVED_PIDS + 1); per PID namespace since Linux 6.14.
MIN_PID_MAX = 301


def _report(fd: int, **fields) -> None:
    os.write(fd, (json.dumps(fields) + "\n").encode())


def _isolate() -> str | None:
    """Enter new user, network and PID namespaces; why not, or None."""
    uid, gid = os.getuid(), os.getgid()
    if _LIBC.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID) != 0:
        return f"unshare(user, network, PID namespaces) failed: {os.strerror(ctypes.get_errno())}"
    try:  # keep our own uid and gid inside, so files keep their owner
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError as err:
        return f"mapping the user namespace failed: {err}"
    return None


def _die_with_parent() -> None:
    """SIGKILL this process when its parent ends (the parent may have ended already: checked after)."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _limit(config: dict) -> None:
    """The first process's limits (inherited by all it starts). RLIMIT_NPROC counts per user namespace
    (Linux >= 5.14) but never binds root, so the namespace's pid_max bounds root's processes."""
    try:
        with open("/proc/sys/kernel/pid_max", "w") as f:  # this namespace's own (Linux >= 6.14); else refused
            f.write(str(max(MIN_PID_MAX, config["processes"] + 1)))
    except OSError:
        pass
    cpu = int(config["cpu_s"] + 0.999)
    memory = config["memory_mib"] * 1024 * 1024
    for limit, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (memory, memory)),
                         (resource.RLIMIT_NPROC, (config["processes"],) * 2),
                         (resource.RLIMIT_FSIZE, (config["output_kib"] * 1024,) * 2), (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(limit, value)


def _run(config: dict, status: int) -> None:
    """PID 1 of the namespace: the code, then the tests, in one module namespace."""
    _limit(config)
    nonce = config.pop("nonce")
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    for name in ("solution.py", "tests.py"):
        with open(name) as f:
            source = f.read()
        try:
            exec(compile(source, name, "exec"), scope)
        except SystemExit as stop:
            print(f"{name} exited (sys.exit({stop.code!r})) before the tests finished", file=sys.stderr)
            sys.stderr.flush()
            os._exit(1)
    _report(status, passed=nonce)


def main() -> None:
    config = json.loads(sys.stdin.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    _die_with_parent()
    if os.getppid() != config["parent"]:
        return  # the worker is gone already
    status = config["status_fd"]
    why = _isolate()
    if why is not None:
        _report(status, setup_error=why)
        return
    alive_r, alive_w = os.pipe()  # EOF on alive_r once this process is gone
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        _die_with_parent()
        if select.select([alive_r], [], [], 0)[0]:  # (getppid is 0 in a new PID namespace)
            os._exit(1)
        os.close(alive_r)
        code = 0
        try:
            _run(config, status)
        except BaseException:  # noqa: BLE001 - the code's own failure: its traceback is the reason
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    config.pop("nonce")
    _report(status, pid=pid)
    _, state = os.waitpid(pid, 0)
    if os.WIFSIGNALED(state):
        _report(status, signal=os.WTERMSIG(state))
    else:
        _report(status, exit=os.WEXITSTATUS(state))


if __name__ == "__main__":
    main()
