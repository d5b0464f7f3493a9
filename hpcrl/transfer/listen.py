"""Where gloo listens: on the loopback address when every rank of a group shares this machine.

    loopback = one_machine(PrefixStore("hpcrl-listen", store), rank=r, world=n)  # every rank calls it
    use_loopback()                     # torch's gloo groups of this process from now on (trainer/group.py)
    undo = use_loopback(); ...; undo()   # the same, put back at leave()
    loopback_environment()             # for processes started from here (vLLM's: inference/vllm_llm.py)
    ProcessGroupGloo(store, r, n, gloo_options(loopback=loopback, timeout=t))   # built here (transfer/gloo.py)

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
"""

from __future__ import annotations

import os
from collections.abc import Callable
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
