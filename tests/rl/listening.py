"""Every socket a run's processes listen on, and the list of those we know, where each may bind, and why.

    sockets = listening({pid: "hpcrl run task", ...})     # (role, pid, address, port) of each TCP listener
    sockets = listening(job_processes(run_dir))            # a job's: head, group tasks, vLLM's engines
    check_listening(sockets, HPCRL_RUN)                    # fails on one not listed, or on a wrong address
    env = {**os.environ, **as_on_a_node()}                 # gloo's default on the node's address, as on a cluster

Issue 28: no port of a run may accept an unauthenticated peer for the run's life. Ours (the bus,
the rendezvous store) authenticate every message with the run's secret; what remains is gloo's
and vLLM's, listed here per role with how many a process may have, how many of those may be on
an address other than loopback, and why each cannot be closed or authenticated by us. gloo's TCP
listener authenticates no peer: after its group formed it accepts a stranger's connection and
keeps its socket, junk sent on it does not disturb the group, and enough such connections to
exhaust the process's file descriptors abort it ("accept: Too many open files" thrown in gloo's
listener thread; docs/FACTS.md, "gloo's listener"). So a group whose ranks share a machine
listens on the loopback address (hpcrl.rendezvous.listen), and only a group that spans nodes - the
trainer ranks' across nodes, the weight-transfer group between trainer and inference nodes - may
be on the node's. Each gloo listener is sealed once its group formed (a
socket filter that drops every packet: hpcrl.rendezvous.listen), so check_listening also connects
to every listener of a role that does not authenticate, from the listener's network namespace,
and fails on one that accepts. A new listener, one on the node's address where loopback would
do, or one left open fails the tests that fold this check in (tests/rl/test_inprocess.py,
tests/rl/test_job.py).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from hpcrl.rendezvous.listen import tcp_listeners


@dataclass(frozen=True)
class Allowed:
    """What one process of a role may listen on: `most` TCP sockets, of which `beyond_loopback` on an
    address other than loopback (the node's, or every interface), and why."""

    most: int
    beyond_loopback: int
    why: str
    authenticates: bool = False
    """Whether its listeners accept a connection and authenticate what comes on it (ours, Slurm's);
    else each must refuse every connection (gloo's and vLLM's: sealed once their group formed)."""


_GLOO = ("gloo's (no authentication: a stranger's connection would be accepted and kept, enough of them abort "
         "the process; kept for the group's life, so sealed once the group formed: a drop-all socket filter, "
         "every connection refused, hpcrl.rendezvous.listen)")
_VLLM_OWN = ("vLLM's own: gloo's listeners of its CPU groups (world, TP, PP, DP, EP, ...); on the loopback address "
             "(VLLM_HOST_IP and GLOO_SOCKET_IFNAME of vLLM's processes: hpcrl.inference.vllm_llm), its "
             "tensor-parallel workers sharing one node; sealed by hpcrl in each worker before the weight-transfer "
             "group forms (hpcrl.transfer.vllm_engine)")
_TRANSFER_VLLM_END = "the weight-transfer group's vLLM end, " + _GLOO

#: `hpcrl run`: everything on one machine, so every listener on the loopback address. The rendezvous
#: store has no TCP port there (ipc://).
HPCRL_RUN = {
    "hpcrl run task": Allowed(1, 0, "the weight-transfer group's trainer end, " + _GLOO),
    "VLLM::EngineCore": Allowed(14, 0, f"{_VLLM_OWN}; and {_TRANSFER_VLLM_END}, its ranks on this machine"),
}

_HEAD = Allowed(2, 2, "the control bus (ZeroMQ ROUTER) and the rendezvous store (rendezvous/store.py): PLAIN "
                      "with the run's token at the connection, then every message HMAC-signed with the run's "
                      "secret and checked before it is unpacked; on every interface", authenticates=True)

#: A job on the local executor: every task on this machine, so only the head's two are beyond loopback.
JOB = {
    "head": _HEAD,
    "trainer": Allowed(3, 0, "the trainer ranks' process group, the group torch makes from it, and the "
                             f"weight-transfer group's trainer end: {_GLOO}; every rank on this machine"),
    "inference": Allowed(14, 0, f"its vLLM engine core runs in this process (hpcrl.roles.inference): {_VLLM_OWN}; "
                                f"and {_TRANSFER_VLLM_END}, its ranks on this machine"),
    "reward": Allowed(0, 0, "none"),
}

#: The same job under Slurm, each group on nodes of its own: the groups that span nodes (the trainer
#: ranks' across nodes, the weight-transfer group's ends) on the node's address, vLLM's own still on
#: loopback; and each group's srun (Slurm's own listeners, for its step's messages and I/O,
#: authenticated by Slurm: munge credentials, and the step's I/O key for the I/O connections).
SLURM_JOB = {
    **JOB,
    "trainer": Allowed(3, 3, "the trainer ranks' process group and the group torch makes from it (on the "
                             "node's address when the ranks span nodes, else loopback), and the weight-transfer "
                             f"group's trainer end (the node's address): {_GLOO}"),
    "inference": Allowed(14, 1, f"its vLLM engine core runs in this process: {_VLLM_OWN}; and "
                                f"{_TRANSFER_VLLM_END}, on the node's address: the trainer ranks on other nodes "
                                "connect to it"),
    "srun": Allowed(4, 4, "Slurm's: srun's listeners for its step's messages from slurmd/slurmstepd and its tasks' "
                          "I/O connections, authenticated by Slurm (munge, the step's I/O key)", authenticates=True),
}


def as_on_a_node() -> dict[str, str]:
    """GLOO_SOCKET_IFNAME naming an interface of this machine with an address other than loopback: a
    run under it binds gloo's default listeners to that address, as on a cluster node whose name
    resolves to its network address (here the name resolves to loopback, which would hide a group
    left on the default)."""
    for name, addresses in sorted(psutil.net_if_addrs().items()):
        if any(a.family == socket.AF_INET and not is_loopback(a.address) for a in addresses):
            return {"GLOO_SOCKET_IFNAME": name}
    raise AssertionError(f"no network interface with an IPv4 address other than loopback on this machine "
                         f"({sorted(psutil.net_if_addrs())}): the listening tests need one to tell a listener on "
                         "the node's address from one on loopback")


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
    """(address, port) of the TCP sockets process `pid` listens on: hpcrl.rendezvous.listen.tcp_listeners, which
    reads the tables of the process's own network namespace (psutil reads the caller's, and the local
    cluster's nodes each have their own), matched by socket inode to the process's descriptors."""
    return list(tcp_listeners(pid).values())


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


def accepting(targets: list[tuple[str, int]], *, timeout_s: float = 1.5) -> list[tuple[str, int]]:
    """Those of the listeners `targets` ((address, port) in this network namespace; 0.0.0.0 or :: as
    the loopback address) that complete a TCP connection within `timeout_s`, all tried at once.
    A sealed listener drops the SYN: its connection stays pending and is closed unanswered."""
    pending, accepted = {}, []
    for ip, port in targets:
        ip = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(ip, ip)
        sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.connect_ex((ip, port))
        pending[sock] = (ip, port)
    deadline = time.monotonic() + timeout_s
    try:
        while pending and (left := deadline - time.monotonic()) > 0:
            _, writable, _ = select.select([], list(pending), [], left)
            for sock in writable:
                where = pending.pop(sock)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    accepted.append(where)
                sock.close()
    finally:
        for sock in pending:
            sock.close()
    return accepted


def accepting_from(pids: list[int], targets: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """accepting(targets) from the network namespace of the processes `pids` (all in one; nsenter
    where it is not ours: the local cluster's nodes)."""
    pid = next(p for p in pids if os.path.exists(f"/proc/{p}/ns/net"))  # StopIteration: all ended
    if os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino:
        return accepting(targets)
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from listening import accepting; "
            "print(json.dumps(accepting([tuple(t) for t in json.loads(sys.argv[2])])))")
    out = subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", sys.executable, "-c", code,
                          str(Path(__file__).parent), json.dumps(targets)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [tuple(t) for t in json.loads(out)]


def accepting_listeners(sockets: list[tuple[str, int, str, int]]) -> set[tuple[int, str, int]]:
    """(pid, address, port) of those of `sockets` that complete a TCP connection, tried at once from
    each listener's network namespace (a process that ended meanwhile listens on nothing)."""
    spaces: dict[int, list[tuple[int, str, int]]] = {}
    for _, pid, ip, port in sockets:
        try:
            spaces.setdefault(os.stat(f"/proc/{pid}/ns/net").st_ino, []).append((pid, ip, port))
        except FileNotFoundError:
            continue
    found = set()
    for members in spaces.values():
        try:
            accepted = set(accepting_from([p for p, _, _ in members], [(ip, port) for _, ip, port in members]))
        except (StopIteration, FileNotFoundError, subprocess.CalledProcessError):  # its processes ended
            continue
        found |= {(p, ip, port) for p, ip, port in members
                  if ({"0.0.0.0": "127.0.0.1", "::": "::1"}.get(ip, ip), port) in accepted}
    return found


def check_listening(sockets: list[tuple[str, int, str, int]], allowed: dict[str, Allowed]) -> None:
    """Fail on a process listening on more TCP sockets than its role's `allowed` (none for a role not
    there), or on more beyond the loopback address than that allows, or on one that accepts a
    connection though its role does not authenticate (a gloo listener left unsealed)."""
    listed = "\n".join(f"  {role} (pid {pid}): {ip}:{port}" for role, pid, ip, port in sockets)
    unsealed = accepting_listeners([s for s in sockets if not allowed.get(s[0], Allowed(0, 0, "")).authenticates])
    for role, pid in sorted({(r, p) for r, p, _, _ in sockets}):
        mine = [ip for _, p, ip, _ in sockets if p == pid]
        outside = [ip for ip in mine if not is_loopback(ip)]
        rule = allowed.get(role, Allowed(0, 0, ""))
        assert len(mine) <= rule.most, (
            f"{role} (pid {pid}) listens on {len(mine)} TCP socket(s), {rule.most} are listed (tests/rl/listening.py): "
            f"a new listener must say what authenticates its peers, or be closed\n{listed}")
        assert len(outside) <= rule.beyond_loopback, (
            f"{role} (pid {pid}) listens on {len(outside)} TCP socket(s) beyond the loopback address ({outside}), "
            f"{rule.beyond_loopback} are listed (tests/rl/listening.py): a group whose ranks share a machine must "
            f"listen on loopback (hpcrl.rendezvous.listen)\n{listed}")
        open_ = sorted((ip, port) for p, ip, port in unsealed if p == pid)
        assert not open_, (
            f"{role} (pid {pid}) accepted a TCP connection on {open_}: its listeners authenticate nobody, so "
            f"each must be sealed once its group formed (hpcrl.rendezvous.listen.sealing)\n{listed}")
