"""Every socket a run's processes listen on, and the list of those we know and why each may stay.

    sockets = listening({pid: "hpcrl run task", ...})     # (role, pid, address, port) of each TCP listener
    sockets = listening(job_processes(run_dir))            # a job's: head, group tasks, vLLM's engines
    check_listening(sockets, HPCRL_RUN, loopback_only=True)   # fails on one not listed, or too many

Issue 28: no port of a run may accept an unauthenticated peer for the run's life. Ours (the bus,
the rendezvous store) authenticate every message with the run's secret; what remains is gloo's
and vLLM's, listed here with the reason each cannot be closed or authenticated by us, so a new
listener fails the test that folds this check in (tests/rl/test_inprocess.py, test_job.py).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from pathlib import Path

import psutil

#: `hpcrl run`: role -> (most listeners, why). The rendezvous store has no TCP port there (ipc://).
HPCRL_RUN = {
    "hpcrl run task": (1, "gloo's listener of the weight-transfer group's trainer end (gloo keeps it for the "
                          "group's life and authenticates no peer; on the loopback address here)"),
    "VLLM::EngineCore": (14, "vLLM's: the TCPStore of its own one-process world group and gloo's listeners of its "
                             "CPU groups (world, TP, PP, DP, EP, ...), plus the transfer group's vLLM end (gloo); "
                             "on the address the host name resolves to: loopback for hpcrl run here, the "
                             "node's address in a job on the local cluster"),
}

#: A job's processes on one machine (the local executor or cluster): role -> (most listeners per
#: process, why). Gloo binds the address the host name resolves to: the node's on a cluster.
JOB = {
    "head": (2, "the control bus (ZeroMQ ROUTER) and the rendezvous store (transfer/bus_store.py): every message "
                "HMAC-signed with the run's secret and checked before it is unpacked; on every interface"),
    "trainer": (3, "gloo's listeners (unauthenticated, kept for each group's life): the trainer ranks' process "
                   "group, the group torch makes from it, and the weight-transfer group's trainer end"),
    "inference": (0, "none: its vLLM engine runs in a child process"),
    "reward": (0, "none"),
    "VLLM::EngineCore": HPCRL_RUN["VLLM::EngineCore"],
}


#: The same job under Slurm: each group's srun too (Slurm's own listeners, for its step's messages and
#: I/O, authenticated by Slurm: munge credentials, and the step's I/O key for the I/O connections).
SLURM_JOB = {**JOB, "srun": (4, "Slurm's: srun's listeners for its step's messages from slurmd/slurmstepd and its "
                                "tasks' I/O connections, authenticated by Slurm (munge, the step's I/O key)")}


def job_processes(run_dir: Path) -> dict[int, str | None]:
    """pid -> role of every live process of the job in `run_dir` on this machine, and their children
    (None: named by the process, e.g. VLLM::EngineCore): the head and the group tasks (`hpcrl.roles
    GROUP`), found by the run directory in their command line or HPCRL_RUN_DIR."""
    roles: dict[int, str | None] = {}
    for process in psutil.process_iter():
        try:
            command = " ".join(process.cmdline())
            if str(run_dir) not in command and process.environ().get("HPCRL_RUN_DIR") != str(run_dir):
                continue
            group = re.search(r"hpcrl\.roles (\w+)", command)
            if Path((process.cmdline() or [""])[0]).name == "srun":  # a group's step under Slurm: named by itself
                roles[process.pid] = "srun"
            elif group:
                roles[process.pid] = group.group(1)
            elif "hpcrl.launch.head" in command or "submitit.core._submit" in command:  # sbatch, or submitit's
                roles[process.pid] = "head"
            for child in process.children(recursive=True):
                roles.setdefault(child.pid, None)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return roles


def speaks_zeromq(port: int, *, timeout_s: float = 5.0) -> bool:
    """Whether the listener on this machine's `port` greets like ZeroMQ (ZMTP 3: 0xFF, 8 bytes, 0x7F),
    as the bus and the rendezvous store do and torch's TCPStore, which waits for its client, does not."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as conn:
        greeting = b""
        try:
            while len(greeting) < 10:
                more = conn.recv(10 - len(greeting))
                if not more:
                    break
                greeting += more
        except TimeoutError:
            pass
    return len(greeting) == 10 and greeting[0] == 0xFF and greeting[9] == 0x7F


def is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.split("%")[0]).is_loopback


def _listeners_of(pid: int) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets process `pid` listens on, read from /proc/<pid>/net/tcp{,6}:
    the tables of the process's own network namespace (psutil reads the caller's, and the local
    cluster's nodes each have their own), matched by socket inode to the process's descriptors."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table, width in (("tcp", 4), ("tcp6", 16)):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: TCP_LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # /proc prints each 32-bit word of the address in host (little-endian) order
            packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            ip = socket.inet_ntop(socket.AF_INET if width == 4 else socket.AF_INET6, packed)
            found.append((ip, int(port, 16)))
    return found


def listening(roles: dict[int, str | None]) -> list[tuple[str, int, str, int]]:
    """(role, pid, address, port) of every TCP socket the processes `roles` (pid -> role, or None: the
    process's name, e.g. VLLM::EngineCore) listen on."""
    found = []
    for pid, role in roles.items():
        try:
            role = role or psutil.Process(pid).name()  # the whole name (/proc's comm is cut at 15 characters)
            found += [(role, pid, ip, port) for ip, port in _listeners_of(pid)]
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            continue
    return sorted(found)


def check_listening(sockets: list[tuple[str, int, str, int]], allowed: dict[str, tuple[int, str]], *,
                    loopback_only: bool) -> None:
    """Fail on a process listening on more TCP sockets than its role's count in `allowed` (none for a
    role not there), or (with `loopback_only`: a run on one machine) on one beyond the loopback address."""
    listed = "\n".join(f"  {role} (pid {pid}): {ip}:{port}" for role, pid, ip, port in sockets)
    for role, pid in {(r, p) for r, p, _, _ in sockets}:
        count = sum(1 for _, p, _, _ in sockets if p == pid)
        most = allowed.get(role, (0, ""))[0]
        assert count <= most, (f"{role} (pid {pid}) listens on {count} TCP socket(s), {most} are listed "
                               "(tests/rl/listening.py): a new listener must say what authenticates its peers, "
                               f"or be closed\n{listed}")
    if loopback_only:
        outside = [(r, ip, port) for r, _, ip, port in sockets if not is_loopback(ip)]
        assert not outside, f"listening beyond the loopback address: {outside}\n{listed}"
