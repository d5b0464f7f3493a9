"""Where gloo listens: on the loopback address when every rank of a group shares this machine.

    loopback = one_machine(PrefixStore("hpcrl-listen", store), rank=r, world=n)  # every rank calls it
    use_loopback()                     # torch's gloo groups of this process from now on (trainer/group.py)
    undo = use_loopback(); ...; undo()   # the same, put back at leave()
    loopback_environment()             # for processes started from here (vLLM's: inference/vllm_llm.py)
    ProcessGroupGloo(store, r, n, gloo_options(loopback=loopback, timeout=t))   # built here (transfer/gloo.py)
    with sealing(): dist.init_process_group(...)   # the gloo listeners the group opened refuse everyone after

gloo's TCP transport keeps one listener per process group for the group's life, and authenticates
no peer: after the group formed it still accepts a stranger's connection and holds its socket,
even once the stranger closed it, and when the process runs out of file descriptors gloo's
listener thread throws and the process aborts (docs/FACTS.md, "gloo's listener"). Nothing in
this torch build can authenticate it (its gloo has the plain TCP transport only, no TLS). What we
can choose is the address: a group whose ranks all run on this machine's network stack never
needs the network, so its listener goes on the loopback address, which nobody off the machine
reaches. That covers `hpcrl run`, a job on the local executor, a trainer group on one node, a
group of one (join_alone), and vLLM's own groups (its tensor-parallel workers share a node).
A group that spans nodes keeps the node's address: the trainer group across nodes, and the
weight-transfer group between trainer and inference nodes; those are the documented listeners
that tests/rl/listening.py allows beyond loopback.

torch reads GLOO_SOCKET_IFNAME each time it makes a gloo group with its defaults (the default
group, and every group it makes from it later: new_group, device meshes), so use_loopback() and
loopback_environment() set it to the loopback interface for the whole process; the interface the
user chose for the node (their GLOO_SOCKET_IFNAME, if any) is kept in NODE_INTERFACE_ENV for a
group of ours that must still reach other nodes (gloo_devices builds its device explicitly).

The address alone leaves a listener open to every process of the machine (another user's, on a
shared node) and, for a group spanning nodes, to the network. So once a group has formed, its
listener is sealed: gloo (not lazy) connects its full mesh while the group is made, so after that
the listener has nothing left to accept, but gloo keeps it in its event loop for the group's life
and aborts the process if accept() fails, so it can be neither closed nor shut down. Instead the
socket gets a classic BPF filter that drops every packet (SO_ATTACH_FILTER, then SO_LOCK_FILTER
so nothing removes it): Linux runs a listener's filter on each incoming SYN, so a stranger's
connection never completes and nothing reaches gloo's accept(); the group's own connections, cloned from the listener before the filter existed, keep working
(docs/FACTS.md, "gloo's listener"). sealing() finds the group's listeners as the TCP listeners
of this process that appeared while it formed (/proc/self/fd matched with /proc/self/net/tcp{,6}).
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

#: torch's variable: the interfaces its default gloo devices bind (comma separated).
GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"
#: The interfaces a cross-node group of ours binds, once GLOO_INTERFACE_ENV points at loopback ("": the
#: address the host name resolves to, torch's default).
NODE_INTERFACE_ENV = "HPCRL_GLOO_NODE_IFNAME"
LOOPBACK_INTERFACE = "lo"
LOOPBACK_ADDRESS = "127.0.0.1"


def machine() -> str:
    """This process's network stack: the kernel's boot id and the inode of its network namespace.
    Two processes with the same value reach each other on the loopback address (the local cluster's
    nodes are network namespaces of one kernel: each its own loopback)."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"


def one_machine(store: Any, *, rank: int, world: int) -> bool:
    """Whether all `world` ranks of a group forming on `store` (a torch.distributed Store, a prefix of
    this formation's own) run on one machine's network stack. Every rank calls it, before the group's
    listener is made; it returns once all did (the store's timeout otherwise). A constant number
    of requests per rank: rank 0 publishes its machine, the others count who differs, and the last
    to arrive publishes the verdict."""
    if world == 1:
        return True
    if rank == 0:
        store.set("machine/0", machine())
    else:
        away = int(store.get("machine/0").decode() != machine())
        store.add("away", away)
        if store.add("arrived", 1) == world - 1:  # every other rank has counted itself
            store.set("verdict", str(store.add("away", 0)))
    return store.get("verdict").decode() == "0"


def node_interfaces() -> str:
    """The interfaces a group spanning nodes binds: the user's GLOO_SOCKET_IFNAME as it was before
    use_loopback/loopback_environment changed it ("" for torch's default, the host name's address)."""
    return os.environ.get(NODE_INTERFACE_ENV, os.environ.get(GLOO_INTERFACE_ENV, ""))


def loopback_environment() -> dict[str, str]:
    """The variables under which a process's default gloo groups listen on the loopback address only,
    the node's interfaces kept for gloo_devices(loopback=False)."""
    return {GLOO_INTERFACE_ENV: LOOPBACK_INTERFACE, NODE_INTERFACE_ENV: node_interfaces()}


def use_loopback() -> Callable[[], None]:
    """Every gloo group torch makes in this process from now on listens on the loopback address.
    Returns what puts the environment back as it was."""
    values = loopback_environment()
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)

    def undo() -> None:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    return undo


def gloo_devices(*, loopback: bool) -> list[Any]:
    """The gloo devices of a group built here: the loopback address's, else the node's (the
    interfaces of node_interfaces(), or the address the host name resolves to)."""
    from torch.distributed import ProcessGroupGloo

    if loopback:
        return [ProcessGroupGloo.create_device(hostname=LOOPBACK_ADDRESS)]
    names = [name for name in node_interfaces().split(",") if name]
    if names:
        return [ProcessGroupGloo.create_device(interface=name) for name in names]
    return [ProcessGroupGloo.create_default_device()]


def gloo_options(*, loopback: bool, timeout: timedelta) -> Any:
    """Options for `ProcessGroupGloo(store, rank, size, options)` whose listener binds gloo_devices(loopback=...)
    (the constructor with a timeout would read GLOO_SOCKET_IFNAME instead)."""
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stubs lack it (they say Options)
    options._timeout = timeout
    options._devices = gloo_devices(loopback=loopback)
    return options


#: torch's variable that makes gloo connect a group's pairs at their first use instead of at its
#: creation: the group would still need its listener after sealing() sealed it.
GLOO_LAZY_ENV = "TORCH_GLOO_LAZY_INIT"
_SO_ATTACH_FILTER = 26  # <asm-generic/socket.h>; Python's socket module does not name them
_SO_LOCK_FILTER = 44
_DROP_EVERYTHING = struct.pack("HBBI", 0x06, 0, 0, 0)  # struct sock_filter {BPF_RET | BPF_K, 0, 0, k=0}: accept 0 bytes


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]  # struct sock_fprog


def tcp_listeners(pid: int | str = "self") -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of the TCP sockets process `pid` listens on, read from
    /proc/<pid>/net/tcp{,6} (the tables of the process's own network namespace) and matched by inode
    to the process's descriptors."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    found = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] != "0A" or int(fields[9]) not in inodes:  # 0A: TCP_LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # /proc prints each 32-bit word of the address in host (little-endian) order
            packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found[int(fields[9])] = (socket.inet_ntop(family, packed), int(port, 16))
    return found


def seal(inode: int) -> bool:
    """Make this process's listening TCP socket `inode` refuse every connection from now on: a
    locked socket filter that drops every packet. Returns False when no descriptor of this process
    holds it any more. Already sealed (its filter locked) is fine."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != f"socket:[{inode}]":
                continue
            mine = os.dup(int(fd))
        except OSError:
            continue
        try:
            if os.fstat(mine).st_ino != inode:  # the descriptor was closed and reused meanwhile
                continue
            sock = socket.socket(fileno=mine)
            mine = -1  # the socket object closes it
            with sock:
                program = ctypes.create_string_buffer(_DROP_EVERYTHING)
                fprog = _SockFprog(1, ctypes.addressof(program))
                try:
                    sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, bytes(memoryview(fprog)))
                except PermissionError:  # a locked filter: sealed before
                    return True
                sock.setsockopt(socket.SOL_SOCKET, _SO_LOCK_FILTER, 1)
            return True
        finally:
            if mine >= 0:
                os.close(mine)
    return False


def refuse_lazy_gloo() -> None:
    """Raise if gloo would connect a group's pairs lazily (they would need the listener sealing() seals)."""
    if os.environ.get(GLOO_LAZY_ENV, "").strip().lower() not in ("", "0", "false", "no", "off"):
        raise RuntimeError(f"{GLOO_LAZY_ENV}={os.environ[GLOO_LAZY_ENV]} makes gloo connect a group's ranks at "
                           "their first collective, through a listener that hpcrl closes to strangers once the "
                           f"group is made (hpcrl.rendezvous.listen): unset {GLOO_LAZY_ENV}")


@contextmanager
def sealing() -> Iterator[list[tuple[str, int]]]:
    """Seal every TCP listener this process opens inside the block, once the block has run: around
    the making of gloo groups (not lazy: refuse_lazy_gloo), whose listeners have nothing left to
    accept then. Yields the list of (address, port) it sealed, filled at the end of the block.
    Nothing else may open a listener in the process meanwhile (it would be sealed too)."""
    refuse_lazy_gloo()
    before = set(tcp_listeners())
    sealed: list[tuple[str, int]] = []
    yield sealed
    for inode, where in tcp_listeners().items():
        if inode not in before and seal(inode):
            sealed.append(where)


def seal_all(*, loopback_only: bool) -> list[tuple[str, int]]:
    """Seal every TCP listener of this process (on the loopback address only, if `loopback_only`);
    for a process whose listeners there are all gloo's of groups already formed. Returns the
    (address, port) of each."""
    refuse_lazy_gloo()
    return [where for inode, where in tcp_listeners().items()
            if (not loopback_only or _is_loopback(where[0])) and seal(inode)]


def seal_loopback_gloo() -> list[tuple[str, int]]:
    """In a vLLM worker whose groups have formed: seal its listeners on the loopback address, gloo's
    (GLOO_SOCKET_IFNAME=lo and VLLM_HOST_IP=127.0.0.1 there: hpcrl.inference.vllm_llm). NCCL's
    listeners must stay open (its bootstrap accepts connections at run time): they are on NCCL's
    interface, which is never loopback while the node has another, unless NCCL_SOCKET_IFNAME
    names it; then nothing is sealed here (vLLM's listeners stay open to the node's processes)."""
    nccl = os.environ.get("NCCL_SOCKET_IFNAME", "")
    if not nccl.startswith("^") and any(name.strip().startswith(LOOPBACK_INTERFACE) for name in nccl.split(",")):
        return []
    return seal_all(loopback_only=True)


def _is_loopback(ip: str) -> bool:
    import ipaddress

    return ipaddress.ip_address(ip.split("%")[0]).is_loopback
