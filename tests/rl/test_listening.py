"""Where gloo listens (hpcrl.rendezvous.listen): on loopback when a group's ranks share a machine, else on the node's;
and that every gloo listener of ours refuses all connections once its group formed (sealed).

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
from listening import _listeners_of, accepting, as_on_a_node, is_loopback

from hpcrl.rendezvous.listen import GLOO_INTERFACE_ENV, GLOO_LAZY_ENV, NODE_INTERFACE_ENV, gloo_devices, one_machine
from hpcrl.rendezvous.meet import SECRET_DIR_ENV, client_store, serve_private_store
from hpcrl.trainer import group
from hpcrl.trainer.parallel import make_dp_mesh
from hpcrl.transfer.gloo import open_gloo_group

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


def new_set(before: set[tuple[str, int]]) -> set[tuple[str, int]]:
    return set(_listeners_of(os.getpid())) - before


def form_transfer_group(store: str, generation: int = 0) -> dict:
    """Both ranks of a transfer group, each on a thread of this process."""
    groups, errors = {}, []

    def rank(r: int) -> None:
        try:
            groups[r] = open_gloo_group(store=store, rank=r, world_size=2, timeout_s=30, generation=generation)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return groups


def all_reduce_ones(groups: dict) -> list[list[float]]:
    tensors = [torch.ones(2), torch.ones(2)]
    for work in [groups[r].pg.allreduce([tensors[r]]) for r in range(2)]:
        work.wait()
    return [t.tolist() for t in tensors]


def test_a_transfer_group_listens_on_loopback_refuses_strangers_once_formed_and_another_forms_after_it(store):
    before = set(_listeners_of(os.getpid()))
    groups = form_transfer_group(store)
    later = {}
    try:
        opened = set(_listeners_of(os.getpid())) - before
        assert len(opened) == 2 and all(is_loopback(ip) for ip, _ in opened), opened
        assert accepting(sorted(opened), timeout_s=1.0) == []  # sealed: the SYN is dropped
        assert all_reduce_ones(groups) == [[2.0, 2.0], [2.0, 2.0]]
        # a group formed afterwards: its listeners were not sealed before it formed, and are after
        later = form_transfer_group(store, generation=1)
        assert all_reduce_ones(later) == [[2.0, 2.0], [2.0, 2.0]]
        assert len(set(_listeners_of(os.getpid())) - before) == 4
        assert accepting(sorted(set(_listeners_of(os.getpid())) - before), timeout_s=1.0) == []
        assert all_reduce_ones(groups) == [[2.0, 2.0], [2.0, 2.0]]
    finally:
        for g in [*groups.values(), *later.values()]:
            g.close()


_RANKS = """
import os, resource, sys, threading, torch
from hpcrl.transfer.gloo import open_gloo_group
from hpcrl.rendezvous.listen import tcp_listeners
before, groups = set(tcp_listeners()), {}
ts = [threading.Thread(target=lambda r=r: groups.__setitem__(r, open_gloo_group(store=sys.argv[1], rank=r,
      world_size=2, timeout_s=30))) for r in range(2)]
[t.start() for t in ts]; [t.join() for t in ts]
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 64,) * 2)
print(" ".join(str(port) for inode, (ip, port) in tcp_listeners().items() if inode not in before), flush=True)
sys.stdin.readline()  # the stranger has had its go
tensors = [torch.ones(2), torch.ones(2)]
[w.wait() for w in [groups[r].pg.allreduce([tensors[r]]) for r in range(2)]]
print(tensors[0].tolist(), flush=True)
[g.close() for g in groups.values()]
# As every role process does (hpcrl/roles/serve.py): no interpreter teardown after gloo's work. A gloo worker
# thread drops its last reference to a finished allreduce after wait() returned; if that falls in the
# interpreter's finalization, taking the GIL ends the thread inside C++ and aborts the process (SIGABRT,
# "terminate called without an active exception": measured, 7 exits in 30 without this line).
os._exit(0)
"""


def test_a_stranger_with_more_connections_than_the_process_has_descriptors_gets_none_and_the_group_lives(store):
    """Unsealed, the 65th connection would make gloo's listener thread abort the process (docs/FACTS.md)."""
    ranks = subprocess.Popen([sys.executable, "-c", _RANKS, store], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        ports = [int(p) for p in ranks.stdout.readline().split()]
        assert len(ports) == 2, ports
        assert accepting([("127.0.0.1", p) for p in ports for _ in range(100)], timeout_s=2.0) == []
        ranks.stdin.write("go\n")
        ranks.stdin.flush()
        assert ranks.stdout.readline().strip() == "[2.0, 2.0]"
        assert ranks.wait(timeout=30) == 0
    finally:
        ranks.kill()


def netns_works() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(["unshare", "--net", "true"]).returncode == 0


def test_ranks_in_two_network_namespaces_are_not_on_one_machine_and_those_in_one_are(store):
    if not netns_works():
        pytest.skip("needs `unshare --net` (root, or unprivileged user namespaces) for a rank in a namespace of its own")
    for generation, where in enumerate([["unshare", "--net"], []]):  # another network namespace: another node
        prefix = f"formation-{generation}"
        # (a Python store must outlive the PrefixStore over it: torch keeps only its C++ half)
        code = ("import sys, torch.distributed as dist; from hpcrl.rendezvous.meet import client_store; "
                "from hpcrl.rendezvous.listen import one_machine; client = client_store(sys.argv[1], timeout_s=30); "
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
        mine = set(_listeners_of(os.getpid())) - before
        # the groups torch makes for the engine's mesh (none for one rank; a 2-rank job's: tests/rl/test_job.py)
        make_dp_mesh(dp_replicate=1, dp_shard=-1, device_type="cpu")
        assert len(mine) == 1 and accepting(sorted(new_set(before)), timeout_s=1.0) == []  # all sealed
        before_new = set(_listeners_of(os.getpid()))
        dist.new_group(backend="gloo")  # as torch makes more from the default group: on loopback, but not sealed
        other = set(_listeners_of(os.getpid())) - before_new
        assert len(other) == 1 and accepting(sorted(other), timeout_s=5.0) == sorted(other)  # what the check catches
        opened = new_listeners(before)
        assert all(is_loopback(ip) for ip in opened), opened
    finally:
        group.leave()
    assert os.environ[GLOO_INTERFACE_ENV] == node and NODE_INTERFACE_ENV not in os.environ


def test_a_group_is_refused_where_gloo_would_connect_lazily_through_the_listener_sealed_after_it(node, monkeypatch):
    monkeypatch.setenv(GLOO_LAZY_ENV, "1")
    with pytest.raises(RuntimeError, match=f"unset {GLOO_LAZY_ENV}"):
        group.join_alone(device="cpu")
    assert not dist.is_initialized()
