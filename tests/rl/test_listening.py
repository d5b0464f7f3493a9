"""Where gloo listens (hpcrl.transfer.listen): on loopback when a group's ranks share a machine, else on the node's.

Every test runs with gloo's default on this machine's network address (GLOO_SOCKET_IFNAME naming
such an interface: listening.as_on_a_node), as on a cluster node whose name resolves to its
address; here the name resolves to 127.0.0.1, which would hide a group left on the default. The
real runs fold the same check in (test_inprocess.py, test_job.py: tests/rl/listening.py).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from listening import _listeners_of, as_on_a_node, is_loopback

from hpcrl.trainer import group
from hpcrl.transfer.gloo import open_gloo_group
from hpcrl.transfer.listen import GLOO_INTERFACE_ENV, NODE_INTERFACE_ENV, gloo_devices, one_machine
from hpcrl.transfer.rendezvous import SECRET_DIR_ENV, client_store, serve_private_store

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def node(monkeypatch) -> str:
    """The interface gloo's default binds in these tests (one with a network address)."""
    interface = as_on_a_node()[GLOO_INTERFACE_ENV]
    monkeypatch.setenv(GLOO_INTERFACE_ENV, interface)
    monkeypatch.delenv(NODE_INTERFACE_ENV, raising=False)
    return interface


@pytest.fixture
def store(monkeypatch, node):
    """The address of a rendezvous store on an ipc:// socket (reachable from another network namespace)."""
    monkeypatch.delenv(SECRET_DIR_ENV, raising=False)
    server = serve_private_store()
    yield server.address
    server.close()


def new_listeners(before: set[tuple[str, int]]) -> list[str]:
    return sorted(ip for ip, port in set(_listeners_of(os.getpid())) - before)


def test_a_transfer_group_whose_ranks_share_this_machine_listens_on_loopback_only(store):
    before = set(_listeners_of(os.getpid()))
    groups, errors = {}, []

    def rank(r: int) -> None:
        try:
            groups[r] = open_gloo_group(store=store, rank=r, world_size=2, timeout_s=30)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert not errors, errors
        opened = new_listeners(before)
        assert len(opened) == 2 and all(is_loopback(ip) for ip in opened), opened
        tensors = [torch.ones(2), torch.ones(2)]
        for work in [groups[r].pg.allreduce([tensors[r]]) for r in range(2)]:
            work.wait()
        assert [t.tolist() for t in tensors] == [[2.0, 2.0], [2.0, 2.0]]
    finally:
        for g in groups.values():
            g.close()


def netns_works() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(["unshare", "--net", "true"]).returncode == 0


def test_ranks_in_two_network_namespaces_are_not_on_one_machine_and_those_in_one_are(store):
    if not netns_works():
        pytest.skip("needs `unshare --net` (root, or unprivileged user namespaces) for a rank in a namespace of its own")
    for generation, where in enumerate([["unshare", "--net"], []]):  # another network namespace: another node
        prefix = f"formation-{generation}"
        # (a Python store must outlive the PrefixStore over it: torch keeps only its C++ half)
        code = ("import sys, torch.distributed as dist; from hpcrl.transfer.rendezvous import client_store; "
                "from hpcrl.transfer.listen import one_machine; client = client_store(sys.argv[1], timeout_s=30); "
                f"print(one_machine(dist.PrefixStore({prefix!r}, client), rank=1, world=2))")
        other = subprocess.Popen([*where, sys.executable, "-c", code, store], stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "PYTHONPATH": str(REPO)})
        client = client_store(store, timeout_s=30)
        mine = one_machine(dist.PrefixStore(prefix, client), rank=0, world=2)
        theirs, _ = other.communicate(timeout=60)
        client.close()
        assert other.returncode == 0
        assert (mine, theirs.strip()) == ((False, "False") if where else (True, "True")), where


def test_a_group_spanning_nodes_listens_on_the_nodes_interface_though_the_process_points_gloo_at_loopback(
        node, monkeypatch):
    """As in vLLM's processes (GLOO_SOCKET_IFNAME=lo for its own groups): the transfer group's end
    still binds the interface the user chose for the node."""
    monkeypatch.setenv(NODE_INTERFACE_ENV, node)
    monkeypatch.setenv(GLOO_INTERFACE_ENV, "lo")
    from torch.distributed import ProcessGroupGloo

    address = next(a.address for a in psutil.net_if_addrs()[node] if a.family == socket.AF_INET)
    before = set(_listeners_of(os.getpid()))
    options = ProcessGroupGloo._Options()
    options._devices = gloo_devices(loopback=False)
    pg = ProcessGroupGloo(dist.HashStore(), 0, 1, options)
    assert new_listeners(before) == [address]
    before = set(_listeners_of(os.getpid()))
    options._devices = gloo_devices(loopback=True)
    pg = ProcessGroupGloo(dist.HashStore(), 0, 1, options)
    assert new_listeners(before) == ["127.0.0.1"]
    del pg


def test_a_trainer_group_of_one_and_what_torch_makes_from_it_listen_on_loopback_until_it_is_left(node):
    before = set(_listeners_of(os.getpid()))
    group.join_alone(device="cpu")
    try:
        dist.new_group(backend="gloo")  # as torch makes more from the default group later (meshes, checkpoints)
        opened = new_listeners(before)
        assert len(opened) == 2 and all(is_loopback(ip) for ip in opened), opened
    finally:
        group.leave()
    assert os.environ[GLOO_INTERFACE_ENV] == node and NODE_INTERFACE_ENV not in os.environ
