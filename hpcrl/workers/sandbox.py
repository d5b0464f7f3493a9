"""Run a completion's code against tests in throw-away sandboxes: the code_tests reward and python_tool's tool.

    outcome = run_tests(extract_code(completion), tests, Limits(cpu_s=4, wall_s=6))
    outcome.passed, outcome.reason        # True, ""   or   False, "killed at the CPU-time limit (4 s)"
    outcome, output = run_code(code, Limits())   # code alone, and what it printed (hpcrl.env's python tool)

The worker calling these (a reward or environment pool's worker, never the head) writes the code (and
the row's tests) into a fresh host directory that no sandbox sees, makes a cgroup for each sandbox and
starts each sandbox with bubblewrap (hpcrl.workers.confine: new user, mount, PID, IPC, UTS and network
namespaces, no capability, read-only /usr and Python prefixes, a private tmpfs at /tmp as the one
writable place; no home, run directory, /run, host /tmp or socket; no network, the host's 127.0.0.1
and abstract Unix sockets included). Inside, hpcrl/workers/_sandbox_boot.py sets per-process limits
and runs the code. run_tests starts two sandboxes (_sandbox_boot.py's docstring): S runs the code and
answers calls; T reads the tests first and runs them against proxies of the code's names, and sends
its verdict on a pipe only T holds. A solution cannot read, empty or patch the tests, exit early to
pass, or return an always-equal object: it is scored by what it answers.

    CPU time   RLIMIT_CPU per process (SIGXCPU, then SIGKILL a second later); the cgroup (where there is
               one) caps the whole sandbox at one CPU's bandwidth
    memory     the cgroup's limit for all its processes and its tmpfs together (the kernel kills at it;
               the tests' sandbox has a cgroup of its own, so the code cannot starve it);
               RLIMIT_AS per process too (an allocation past it raises MemoryError)
    processes  the cgroup's pids limit for the whole sandbox, root included; without a cgroup (a normal
               user on a node that delegates none) RLIMIT_NPROC, counted per user namespace
               (Linux >= 5.14), bounds each sandbox; as root without a cgroup it refuses (SandboxError),
               since RLIMIT_NPROC does not bind root
    output     RLIMIT_FSIZE on every file it writes, its stdout and stderr included; the tmpfs's size
    wall time  the worker kills each sandbox's bwrap and every process of the cgroup, then removes the
               cgroup and the host directory; should the worker itself be killed (the pool's timeout),
               bwrap kills its sandbox (--die-with-parent)

A failing or killed run is a legitimate 0 with its reason; a sandbox that cannot be built (no bwrap,
no user namespaces, root with no cgroup) is a SandboxError, so the sample is an error and its group is
held out, never silently 0. Not covered: what the kernel exposes to any unprivileged process (its
version, /proc/cpuinfo), and kernel bugs reachable from a user namespace; a node that forbids user
namespaces cannot run code_tests at all.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcrl.workers.confine import Cgroup, SandboxError, bwrap_argv

__all__ = ["Limits", "Outcome", "SandboxError", "check_sandbox", "extract_code", "run_code", "run_tests"]

BOOT = Path(__file__).with_name("_sandbox_boot.py")
INSIDE = "/hpcrl"
_FENCED = re.compile(r"```(?:python|py|python3)[ \t]*\n(.*?)```", re.DOTALL)
#: The sandbox's own processes, beside the code's: bwrap and its init.
OWN_PROCESSES = 2
#: The processes of the tests' sandbox (bwrap, its init, Python), in a cgroup of its own: the code's fork
#: bomb or memory cannot keep the tests from starting (a sandbox that cannot start is an error, not a 0).
TESTS_PROCESSES = 8
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What one run of a completion's code may use."""

    cpu_s: float = 4.0
    """CPU seconds of each process it starts (and one CPU's bandwidth for the whole sandbox, with a cgroup)."""
    wall_s: float = 6.0
    """Seconds from start to kill, whatever it is doing; keep it under reward.timeout_s."""
    memory_mib: int = 1024
    """Memory of the whole sandbox (its cgroup: all its processes and its tmpfs), and address space of each
    process, MiB."""
    processes: int = 32
    """Processes and threads of the code together (its cgroup; without one, of each user namespace)."""
    output_kib: int = 1024
    """Largest file it may write (its stdout and stderr included), KiB."""
    files_mib: int = 16
    """Size of its one writable directory, /tmp (a tmpfs, counted in memory_mib too), MiB."""


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
    """Run `code` in one sandbox and `tests` against it from another (module docstring); raises SandboxError
    when none can be built."""
    with _Sandbox(code, limits) as box:
        return box.tests(tests)


def run_code(code: str, limits: Limits = Limits(), *, output_chars: int = 4000) -> tuple[Outcome, str]:
    """Run `code` alone in a sandbox: whether it ran to its end (with the reason if not) and the last
    `output_chars` of what it printed, stdout then stderr (the python_tool environment's tool)."""
    with _Sandbox(code, limits) as box:
        return box.alone(output_chars)


class _Sandbox:
    """One call's host directory (solution.py, tests.py, the output files: never visible inside), its
    cgroup and its processes; leaving it kills them all and removes both."""

    def __init__(self, code: str, limits: Limits):
        self.limits = limits
        _remove_stale_dirs()
        self.dir = Path(tempfile.mkdtemp(prefix=f"hpcrl-code-{os.getpid()}-"))
        (self.dir / "solution.py").write_text(code)
        self.processes: list[subprocess.Popen] = []
        self.group = Cgroup.make(limits.memory_mib, limits.processes + OWN_PROCESSES)
        self.groups = [self.group]
        if self.group is None and os.geteuid() == 0:
            self.close()
            raise SandboxError("running untrusted code as root needs a cgroup to bound its processes and memory (root "
                               "is exempt from RLIMIT_NPROC), and none could be made here: mount cgroup v1's memory "
                               "and pids controllers writable, delegate a cgroup v2 subtree with memory and pids, or "
                               "run the workers as a normal user")
        self.deadline = time.monotonic() + limits.wall_s

    def __enter__(self) -> _Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for process in self.processes:
            _kill_group(process.pid)
        for group in self.groups:
            if group is not None:
                group.remove()
        for process in self.processes:
            process.wait(timeout=10)
        for path in self.dir.iterdir():
            path.unlink()
        self.dir.rmdir()

    def _start(self, mode: str, file: str, fds: dict[str, int], stdout: Path,
               group: Cgroup | None) -> tuple[subprocess.Popen, int]:
        """`_sandbox_boot.py mode` in a new sandbox seeing `file` of the host dir; the process and the read
        end of its "up" pipe."""
        up_r, up_w = os.pipe()
        config = {**asdict(self.limits), "up": up_w, **fds}
        argv = bwrap_argv({BOOT: f"{INSIDE}/{BOOT.name}", self.dir / file: f"{INSIDE}/{file}"}, self.limits.files_mib)
        argv += ["--", sys.executable, "-I", f"{INSIDE}/{BOOT.name}", mode, json.dumps(config)]
        with open(stdout, "wb") as out, open(stdout.with_suffix(".stderr"), "wb") as err:
            process = subprocess.Popen(group.enter(argv) if group else argv, stdin=subprocess.DEVNULL,
                                       stdout=out, stderr=err, env=_ENV, pass_fds=(up_w, *fds.values()),
                                       start_new_session=True)
        self.processes.append(process)
        os.close(up_w)
        return process, up_r

    def _started(self, process: subprocess.Popen, up: int, name: str, group: Cgroup | None) -> None:
        """Raise SandboxError if the sandbox exited before its boot said "up" (bwrap could not build it, or Python
        not start in it); killed before that (by a signal: the memory limit the code next door filled) is not."""
        os.set_blocking(up, False)
        try:
            said = os.read(up, 3)
        except BlockingIOError:
            said = b""
        os.close(up)
        status = process.poll()
        if said != b"up\n" and status is not None and 0 <= status <= 128 and not (group and group.oom_killed()):
            why = _last_line(self.dir / f"{name}.stderr") or f"exit code {process.returncode}"
            raise SandboxError(f"the code sandbox could not start here: {why}. Fix: bubblewrap needs user namespaces "
                               "(sysctl user.max_user_namespaces > 0; on Debian/Ubuntu also kernel."
                               "unprivileged_userns_clone = 1 and kernel.apparmor_restrict_unprivileged_userns = 0)")

    def tests(self, tests: str) -> Outcome:
        (self.dir / "tests.py").write_text(tests)
        requests_r, requests_w = os.pipe()  # T -> S
        replies_r, replies_w = os.pipe()  # S -> T
        verdict_r, verdict_w = os.pipe()  # T -> here
        tests_group = Cgroup.make(self.limits.memory_mib, TESTS_PROCESSES) if self.group else None
        self.groups.append(tests_group)
        try:
            solution, solution_up = self._start("serve", "solution.py", {"requests": requests_r, "replies": replies_w},
                                                self.dir / "solution.stdout", self.group)
            tester, tester_up = self._start("test", "tests.py", {"requests": requests_w, "replies": replies_r,
                                                                 "verdict": verdict_w}, self.dir / "tests.stdout",
                                            tests_group)
        finally:
            for fd in (requests_r, requests_w, replies_r, replies_w, verdict_w):
                os.close(fd)
        try:
            line, timed_out = _read_until_eof(verdict_r, self.deadline)
        finally:
            os.close(verdict_r)
        tester.poll()
        self._started(tester, tester_up, "tests", tests_group)
        try:
            verdict = json.loads(line) if line else {}
        except ValueError:
            verdict = {}
        if verdict.get("passed") is True:
            os.close(solution_up)
            return Outcome(True, "")
        if not timed_out:  # S ends once T has: its end may say more (a limit) than T's "ended"
            _wait(solution, self.deadline)
        self._started(solution, solution_up, "solution", self.group)
        reason = str(verdict.get("reason") or f"the tests' process ended without a verdict (exit {tester.returncode})")
        return Outcome(False, self._why(solution, timed_out, reason))

    def alone(self, output_chars: int) -> tuple[Outcome, str]:
        process, up = self._start("run", "solution.py", {}, self.dir / "solution.stdout", self.group)
        timed_out = not _wait(process, self.deadline)
        self._started(process, up, "solution", self.group)
        output = _output(self.dir, output_chars)
        if process.returncode == 0:
            return Outcome(True, ""), output
        reason = _last_line(self.dir / "solution.stderr") or f"exit code {process.returncode}"
        return Outcome(False, self._why(process, timed_out, reason)), output

    def _why(self, process: subprocess.Popen, timed_out: bool, reason: str) -> str:
        """The reason of a run that did not pass: a limit that ended the code's process, else `reason`."""
        limits = self.limits
        if timed_out:
            return f"killed at the wall-time limit ({limits.wall_s:g} s)"
        if self.group is not None and self.group.oom_killed():
            return f"killed at the memory limit ({limits.memory_mib} MiB for the whole sandbox)"
        status = process.returncode
        number = status - 128 if isinstance(status, int) and status > 128 else None  # bwrap: 128 + the signal
        if number in (signal.SIGXCPU, signal.SIGKILL):
            return f"killed at the CPU-time limit ({limits.cpu_s:g} s)"
        if number == signal.SIGXFSZ:
            return f"killed at the output limit ({limits.output_kib} KiB)"
        if number is not None and number in signal.valid_signals():
            return f"killed by {signal.Signals(number).name}"
        if "MemoryError" in reason:
            return f"{reason} (memory limit {limits.memory_mib} MiB)"
        if "Resource temporarily unavailable" in reason:
            return f"{reason} (process limit {limits.processes})"
        return reason


def _read_until_eof(fd: int, deadline: float, limit: int = 65536) -> tuple[bytes, bool]:
    """What the pipe holds once its writers are gone (at most `limit` bytes), and whether the deadline came first."""
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return data, True
        chunk = os.read(fd, 65536)
        if not chunk:
            return data, False
        data = (data + chunk)[:limit]


def _wait(process: subprocess.Popen, deadline: float) -> bool:
    """Whether `process` ended before the deadline."""
    try:
        process.wait(timeout=max(0.0, deadline - time.monotonic()))
        return True
    except subprocess.TimeoutExpired:
        return False


def _remove_stale_dirs() -> None:
    """Remove the host directories of calls whose worker was killed before removing them (the pool's timeout)."""
    for stale in Path(tempfile.gettempdir()).glob("hpcrl-code-*-*"):
        pid = stale.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # gone already


def _output(workdir: Path, chars: int) -> str:
    """The last `chars` characters of the run's stdout then stderr."""
    text = "".join(_tail(workdir / name, chars * 4) for name in ("solution.stdout", "solution.stderr"))
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
