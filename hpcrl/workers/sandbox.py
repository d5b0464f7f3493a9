"""Run a completion's code against tests in a throw-away sandbox process: the code_tests reward.

    outcome = run_tests(extract_code(completion), tests, Limits(cpu_s=4, wall_s=6))
    outcome.passed, outcome.reason        # True, ""   or   False, "killed at the CPU-time limit (4 s)"
    outcome, output = run_code(code, Limits())   # code alone, and what it printed (hpcrl.env's python tool)

The reward pool's worker (never the head) starts `python -I _sandbox_boot.py` in a new session, in a
fresh temporary directory (removed afterwards) holding solution.py (the code) and tests.py (the
row's `answer`: Python run after the code in the same module namespace, e.g. `assert add(1, 2) == 3`
lines, or a `check(add)` call). The boot process enters new user, network and PID namespaces and
forks the namespace's first process, which runs the code under the limits:

    CPU time   RLIMIT_CPU (SIGXCPU, then SIGKILL a second later)
    memory     RLIMIT_AS (an allocation past it raises MemoryError)
    processes  RLIMIT_NPROC, counted per user namespace (Linux >= 5.14) so it binds each sandbox
               alone; root is exempt from it, so the PID namespace's pid_max (Linux >= 6.14, at
               least 301) bounds root's fork bombs
    output     RLIMIT_FSIZE on every file it writes, its stdout and stderr included
    wall time  the worker kills the namespace's first process, which takes every process of the
               namespace with it, and the boot's process group; should the worker itself be killed
               (the pool's timeout), the boot and the first process die with it (PR_SET_PDEATHSIG)
    network    a new network namespace: no interface but a loopback that is down, so even
               127.0.0.1 is unreachable

Passing means the tests ran to their end (a nonce only the harness knows is written after them):
code that exits early does not pass (code that digs the nonce out of the interpreter's frames could;
this guards against accidents and reward hacking by early exit, not against such an adversary). A failing or killed run is a legitimate 0 with its reason; a
sandbox that cannot be built (user namespaces disabled) is a SandboxError, so the sample is an error
and its group is held out, never silently 0. Not covered: the code runs as the pool's user and can
read what that user can read; run reward tasks as a dedicated user where that matters.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcrl.errors import HpcrlError

BOOT = Path(__file__).with_name("_sandbox_boot.py")
_FENCED = re.compile(r"```(?:python|py|python3)[ \t]*\n(.*?)```", re.DOTALL)


class SandboxError(HpcrlError):
    """The sandbox cannot be built here: the sample has no score (an error), not a 0."""


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What one run of a completion's code may use."""

    cpu_s: float = 4.0
    """CPU seconds of its first process (and each process it starts)."""
    wall_s: float = 6.0
    """Seconds from start to kill, whatever it is doing; keep it under reward.timeout_s."""
    memory_mib: int = 1024
    """Address space of each process, MiB."""
    processes: int = 32
    """Processes and threads together, the sandbox's own boot process included."""
    output_kib: int = 1024
    """Largest file it may write (its stdout and stderr included), KiB."""


@dataclass(frozen=True)
class Outcome:
    passed: bool
    reason: str
    """Why it failed ("" when it passed): the last line of its error, or the limit that killed it."""


def check_sandbox() -> None:
    """Raise SandboxError unless a sandbox can be built here and runs code: empty code and a `pass` test pass."""
    outcome = run_tests("", "pass", Limits(wall_s=10))
    if not outcome.passed:
        raise SandboxError(f"a sandbox running no code did not pass here: {outcome.reason}")


def extract_code(completion: str) -> str:
    """The last ```python fenced block of the completion, else the whole completion."""
    blocks = _FENCED.findall(completion)
    return blocks[-1] if blocks else completion


def run_tests(code: str, tests: str, limits: Limits = Limits()) -> Outcome:
    """Run `code` then `tests` in a sandbox (module docstring); raises SandboxError when none can be built."""
    return _sandboxed(code, tests, limits)[0]


def run_code(code: str, limits: Limits = Limits(), *, output_chars: int = 4000) -> tuple[Outcome, str]:
    """Run `code` alone in a sandbox: whether it ran to its end (with the reason if not) and the last
    `output_chars` of what it printed, stdout then stderr (the python_tool environment's tool)."""
    return _sandboxed(code, "", limits, output_chars)


def _sandboxed(code: str, tests: str, limits: Limits, output_chars: int = 0) -> tuple[Outcome, str]:
    workdir = Path(tempfile.mkdtemp(prefix="hpcrl-code-"))
    status_r, status_w = os.pipe()
    os.set_blocking(status_r, False)
    nonce = secrets.token_hex(16)
    env = {"PATH": os.defpath, "HOME": str(workdir), "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    process = None
    try:
        (workdir / "solution.py").write_text(code)
        (workdir / "tests.py").write_text(tests)
        with open(workdir / ".stdout", "wb") as out, open(workdir / ".stderr", "wb") as err:
            process = subprocess.Popen([sys.executable, "-I", str(BOOT)], cwd=workdir, env=env, stdin=subprocess.PIPE,
                                       stdout=out, stderr=err, pass_fds=(status_w,), start_new_session=True)
        assert process.stdin is not None
        process.stdin.write(json.dumps({"nonce": nonce, "status_fd": status_w, "parent": os.getpid(),
                                        **asdict(limits)}).encode())
        process.stdin.close()
        os.close(status_w)
        status_w = -1
        try:
            process.wait(timeout=limits.wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        reports = _read_reports(status_r)
        first = reports[0] if reports else {}
        _kill(process, first.get("pid"))
        if "setup_error" in first:  # the boot's first line; anything later the code may have written
            raise SandboxError(f"code_tests cannot isolate the code here: {first['setup_error']}. Fix: enable user "
                               "namespaces for this user (sysctl user.max_user_namespaces > 0; on Debian/Ubuntu also "
                               "kernel.unprivileged_userns_clone = 1 and kernel.apparmor_restrict_unprivileged_userns "
                               "= 0), or score code elsewhere")
        output = _output(workdir, output_chars) if output_chars else ""
        if any(r.get("passed") == nonce for r in reports):
            return Outcome(True, ""), output
        ended: dict = next((r for r in reversed(reports) if "signal" in r or "exit" in r), {})
        return Outcome(False, _why(ended, timed_out, limits, workdir / ".stderr")), output
    finally:
        if process is not None and process.poll() is None:
            _kill(process, None)
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)


def _read_reports(fd: int) -> list[dict]:
    """The status lines written so far (the pipe may still be open in a process being killed)."""
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    reports = []
    for line in data.splitlines():
        try:
            report = json.loads(line)
        except ValueError:
            continue  # not the harness's: the code wrote to the pipe
        if isinstance(report, dict):
            reports.append(report)
    return reports


def _kill(process: subprocess.Popen, first: object) -> None:
    """Kill the namespace's first process (all the namespace dies with it) if `first` is its host pid (a
    child of the boot process: a pid the code wrote cannot point elsewhere), then the boot's group."""
    if isinstance(first, int) and _parent_of(first) == process.pid:
        _signal(lambda: os.kill(first, signal.SIGKILL))
    _signal(lambda: os.killpg(process.pid, signal.SIGKILL))
    process.wait(timeout=10)


def _parent_of(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"^PPid:\s*(\d+)", status, re.MULTILINE)
    return int(found.group(1)) if found else None


def _signal(send) -> None:
    try:
        send()
    except (ProcessLookupError, PermissionError):
        pass  # gone already


def _why(ended: dict, timed_out: bool, limits: Limits, stderr: Path) -> str:
    """The reason of a run that did not pass."""
    if timed_out:
        return f"killed at the wall-time limit ({limits.wall_s:g} s)"
    number = ended.get("signal")
    if number in (signal.SIGXCPU, signal.SIGKILL):
        return f"killed at the CPU-time limit ({limits.cpu_s:g} s)"
    if number == signal.SIGXFSZ:
        return f"killed at the output limit ({limits.output_kib} KiB)"
    if isinstance(number, int):
        return f"killed by {signal.Signals(number).name}" if number in signal.valid_signals() else f"signal {number}"
    if ended.get("exit", 0) == 0:
        return "the code ended the process before the tests finished"
    last = _last_line(stderr)
    if "MemoryError" in last:
        return f"{last} (memory limit {limits.memory_mib} MiB)"
    if "Resource temporarily unavailable" in last:
        return f"{last} (process limit {limits.processes})"
    return last or f"exit code {ended['exit']}"


def _output(workdir: Path, chars: int) -> str:
    """The last `chars` characters of the run's stdout then stderr."""
    text = "".join(_tail(workdir / name, chars * 4) for name in (".stdout", ".stderr"))
    return text[-chars:]


def _tail(path: Path, size: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _last_line(path: Path, tail: int = 4096) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - tail))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""
