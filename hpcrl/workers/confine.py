"""The walls of a code sandbox: bubblewrap's command line, and a cgroup bounding the whole sandbox.

    argv = bwrap_argv(binds={solution: "/hpcrl/solution.py"}, tmpfs_mib=16)   # + ["python", ...]
    group = Cgroup.make(limits, lambda: "...")     # None where no cgroup can be made (a normal user, no delegation)
    Popen(group.enter(argv) if group else argv)    # every process the sandbox starts is in the group
    group.oom_killed(); group.remove()             # kills what is left, then removes the group

bubblewrap (Debian's `bubblewrap`, 0.8.0 here) builds the sandbox: new user, mount, PID, IPC, UTS,
network and (where it can) cgroup namespaces; no capability; uid and gid 65534 inside; a root file
system holding only /usr (and the /bin, /lib, /lib64, /sbin links to it), /etc/ld.so.cache, the
Python prefixes (the venv's and its base interpreter's, each under its own path, read-only), a new
/proc and a minimal /dev, the harness files bound read-only under /hpcrl, and a private tmpfs of
`tmpfs_mib` at /tmp (the cwd and HOME: the one writable place); the rest of the root is read-only.
No host directory but those is visible: no home, run directory, /run, host /tmp or Unix socket.
The new network namespace has only its own loopback (the host's 127.0.0.1 and abstract Unix sockets
are out of reach). bwrap kills the sandbox when the process that started it dies (--die-with-parent).

The cgroup holds the whole sandbox (every process of it, the bwrap processes included): memory
(tmpfs pages included), processes and threads, and at most one CPU's bandwidth, at the weight of
one process (a lower weight made calls 2.5x slower on a loaded node: BENCHMARKS.md "Code sandbox"). cgroup v1 (memory, pids,
cpu controllers: root, as on these machines and CI) or v2 where the caller's cgroup delegates
memory and pids to its children (a writable subtree whose cgroup.subtree_control lists them).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import sys
import time
from pathlib import Path

from hpcrl.errors import HpcrlError

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: The uid and gid of the code inside its user namespace ("nobody").
INSIDE_ID = "65534"


class SandboxError(HpcrlError):
    """The sandbox cannot be built here: the sample has no score (an error), not a 0."""


def bwrap() -> str:
    """The bwrap executable, or SandboxError saying how to install it."""
    found = shutil.which("bwrap")
    if found is None:
        raise SandboxError("running untrusted code needs bubblewrap, which this node lacks: install it (Debian/Ubuntu: "
                           "apt-get install bubblewrap; RHEL: dnf install bubblewrap; tools/setup_env.sh does it as "
                           "root), then restart; hpcrl runs no code_tests or python_tool sandbox without it")
    return found


def bwrap_argv(binds: dict[Path, str], tmpfs_mib: int) -> list[str]:
    """bwrap's command line up to the command (module docstring); `binds` are host files shown read-only."""
    argv = [bwrap(), "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
            "--unshare-cgroup-try", "--uid", INSIDE_ID, "--gid", INSIDE_ID, "--cap-drop", "ALL",
            "--die-with-parent", "--new-session"]
    for top in ("bin", "lib", "lib64", "sbin"):
        path = Path("/") / top
        if path.is_symlink():
            argv += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            argv += ["--ro-bind", str(path), str(path)]
    argv += ["--ro-bind", "/usr", "/usr"]
    if Path("/etc/ld.so.cache").exists():
        argv += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    # The private /tmp before the interpreter's binds: bwrap mounts in order, and a venv under the host's
    # /tmp (a CI clone there) would otherwise be hidden by the tmpfs (execvp: no such file).
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(tmpfs_mib * 1024 * 1024), "--tmpfs", "/tmp"]
    for link, target in _python_paths():
        argv += ["--symlink", target, link] if target else ["--ro-bind", link, link]
    for host, inside in binds.items():
        argv += ["--ro-bind", str(host), inside]
    argv += ["--remount-ro", "/", "--chdir", "/tmp"]
    return argv


def _python_paths() -> list[tuple[str, str]]:
    """What the interpreter needs outside /usr: each prefix's directory read-only under its own path, and
    every symbolic link on the way to it (a venv reached through a link): (path, link target or "")."""
    found: dict[str, str] = {}
    for start in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                  os.path.dirname(sys.executable)}:
        path = os.path.abspath(start)
        for _ in range(40):  # follow the links one at a time (at most 40, as the kernel), recording each
            parts = Path(path).parts
            link = next((Path(*parts[:i]) for i in range(2, len(parts) + 1) if Path(*parts[:i]).is_symlink()), None)
            if link is None:
                break
            found.setdefault(str(link), os.readlink(link))
            path = os.path.normpath(os.path.join(link.parent, os.readlink(link), *parts[len(link.parts):]))
        if not path.startswith("/usr/"):
            found.setdefault(path, "")
    binds = [p for p, t in found.items() if not t]
    kept = [p for p in binds if not any(p.startswith(other + "/") for other in binds)]  # not inside another

    def inside_a_bind(path: str) -> bool:
        return any(path.startswith(bound + "/") for bound in kept)

    return [(p, t) for p, t in sorted(found.items()) if (t and not inside_a_bind(p)) or p in kept]


class Cgroup:
    """One sandbox's cgroup in each controller (module docstring); make() returns None where none can be made."""

    def __init__(self, dirs: dict[str, Path], version: int):
        self.dirs, self.version = dirs, version

    @classmethod
    def make(cls, memory_mib: int, processes: int) -> Cgroup | None:
        """A new group bounding `memory_mib` and `processes` (the sandbox's own bwrap processes included)."""
        name = f"hpcrl-sandbox-{os.getpid()}-{secrets.token_hex(4)}"
        for version, places in ((1, _v1_places()), (2, _v2_places())):
            if not places:
                continue
            made: dict[str, Path] = {}
            try:
                for controller, parent in places.items():
                    _remove_stale(parent)
                    made[controller] = parent / name
                    made[controller].mkdir()
                group = cls(made, version)
                group._limit(memory_mib * 1024 * 1024, processes)
                return group
            except OSError:
                cls(made, version).remove()
        return None

    def _limit(self, memory: int, processes: int) -> None:
        if self.version == 1:
            _write(self.dirs["memory"] / "memory.limit_in_bytes", memory)
            if (self.dirs["memory"] / "memory.memsw.limit_in_bytes").exists():  # no swap either
                _write(self.dirs["memory"] / "memory.memsw.limit_in_bytes", memory)
            _write(self.dirs["pids"] / "pids.max", processes)
            if "cpu" in self.dirs:
                _write(self.dirs["cpu"] / "cpu.cfs_period_us", 100_000)
                _write(self.dirs["cpu"] / "cpu.cfs_quota_us", 100_000)  # one CPU
        else:
            only = self.dirs["memory"]
            _write(only / "memory.max", memory)
            if (only / "memory.swap.max").exists():
                _write(only / "memory.swap.max", 0)
            _write(only / "pids.max", processes)
            if (only / "cpu.max").exists():
                _write(only / "cpu.max", "100000 100000")

    def enter(self, argv: list[str]) -> list[str]:
        """`argv` run by a shell that first moves itself into the group (so all it starts is in it)."""
        procs = [str(d / "cgroup.procs") for d in dict.fromkeys(self.dirs.values())]
        script = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
        return ["/bin/sh", "-c", script, "sh", *procs, "--", *argv]

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the group at its memory limit."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            text = (self.dirs["memory"] / name).read_text()
        except OSError:
            return False
        return any(line.split()[:1] == ["oom_kill"] and line.split()[1] != "0" for line in text.splitlines())

    def remove(self) -> None:
        """SIGKILL every process still in the group, then remove it."""
        for directory in dict.fromkeys(self.dirs.values()):
            deadline = time.monotonic() + 5
            while True:
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break  # left for the next sandbox of this node to remove (_remove_stale)
                    _kill_all(directory)
                    time.sleep(0.01)


def _kill_all(directory: Path) -> None:
    try:
        pids = [int(p) for p in (directory / "cgroup.procs").read_text().split()]
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _remove_stale(parent: Path) -> None:
    """Remove the groups of sandboxes whose worker died before removing them (empty by then)."""
    for stale in parent.glob("hpcrl-sandbox-*"):
        pid = stale.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _kill_all(stale)
            try:
                stale.rmdir()
            except OSError:
                pass


def _write(path: Path, value: object) -> None:
    path.write_text(f"{value}\n")


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path by controller ("" for cgroup v2's unified one), from /proc/self/cgroup."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _v1_places() -> dict[str, Path]:
    """Where this process may make v1 groups: memory and pids required, cpu where mounted too."""
    own = _own_cgroups()
    places: dict[str, Path] = {}
    for controller in ("memory", "pids", "cpu"):
        parent = CGROUP_ROOT / controller / own.get(controller, "/").lstrip("/")
        if controller in own and (parent / "cgroup.procs").exists() and os.access(parent, os.W_OK):
            places[controller] = parent
    return places if {"memory", "pids"} <= places.keys() else {}


def _v2_places() -> dict[str, Path]:
    """This process's v2 group, where it delegates memory and pids to children it may make."""
    own = _own_cgroups()
    if "" not in own or not (CGROUP_ROOT / "cgroup.controllers").exists():
        return {}
    parent = CGROUP_ROOT / own[""].lstrip("/")
    try:
        delegated = (parent / "cgroup.subtree_control").read_text().split()
    except OSError:
        return {}
    if not {"memory", "pids"} <= set(delegated) or not os.access(parent, os.W_OK):
        return {}
    return {"memory": parent}
