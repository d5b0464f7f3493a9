"""Every socket a run's processes listen on, and the list of those we know and why each may stay.

    sockets = listening({pid: "hpcrl run task", ...})     # (role, address, port) of each TCP listener
    check_listening(sockets, HPCRL_RUN)                    # fails on one not in the list, or too many

Issue 28: no port of a run may accept an unauthenticated peer for the run's life. Ours (the bus,
the rendezvous store) authenticate every message with the run's secret; what remains is gloo's
and vLLM's, listed here with the reason each cannot be closed or authenticated by us, so a new
listener fails the test that folds this check in (tests/rl/test_inprocess.py, test_job.py).
"""

from __future__ import annotations

import ipaddress
import socket

import psutil

#: `hpcrl run`: role -> (most listeners, why). The rendezvous store has no TCP port there (ipc://).
HPCRL_RUN = {
    "hpcrl run task": (1, "gloo's listener of the weight-transfer group's trainer end (gloo keeps it for the "
                          "group's life and authenticates no peer; on the loopback address here)"),
    "VLLM::EngineCore": (14, "vLLM's: the TCPStore of its own one-process world group and gloo's listeners of its "
                             "CPU groups (world, TP, PP, DP, EP, ...), plus the transfer group's vLLM end (gloo); "
                             "vLLM binds them to the loopback address"),
}


def is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.split("%")[0]).is_loopback


def listening(roles: dict[int, str | None]) -> list[tuple[str, str, int]]:
    """(role, address, port) of every TCP socket the processes `roles` (pid -> role, or None: the
    process's name, e.g. VLLM::EngineCore) listen on."""
    found = []
    for pid, role in roles.items():
        try:
            process = psutil.Process(pid)
            role = role or process.name()  # the whole name (/proc's comm is cut at 15 characters)
            conns = process.net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        found += [(role, c.laddr.ip, c.laddr.port) for c in conns
                  if c.status == psutil.CONN_LISTEN and c.family in (socket.AF_INET, socket.AF_INET6)]
    return sorted(found)


def check_listening(sockets: list[tuple[str, str, int]], allowed: dict[str, tuple[int, str]], *,
                    loopback_only: bool) -> None:
    """Fail on a listener of a role not in `allowed`, more than its count, or (with `loopback_only`:
    a run on one machine) any not on the loopback address."""
    listed = "\n".join(f"  {role}: {ip}:{port}" for role, ip, port in sockets)
    for role in {r for r, _, _ in sockets}:
        count = sum(1 for r, _, _ in sockets if r == role)
        most = allowed.get(role, (0, ""))[0]
        assert count <= most, (f"{role} listens on {count} TCP socket(s), {most} are listed (tests/rl/listening.py): "
                               f"a new listener must say what authenticates its peers, or be closed\n{listed}")
    if loopback_only:
        outside = [(r, ip, port) for r, ip, port in sockets if not is_loopback(ip)]
        assert not outside, f"listening beyond the loopback address: {outside}\n{listed}"
