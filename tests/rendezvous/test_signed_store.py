"""The rendezvous store (hpcrl.rendezvous.store): torch's Store operations over signed requests,
parked waits, timeouts, and peers without the run's secret refused unread.

In-process: the server's thread and clients on this process's threads (a gloo group of three
ranks on three threads); the transports form through it across processes in test_execute.py.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from datetime import timedelta

import msgpack
import pytest
import torch
import torch.distributed as dist
import zmq

from hpcrl.bus.secret import Secret, load_secret
from hpcrl.bus.zap import as_client
from hpcrl.rendezvous import store as signed_store
from hpcrl.rendezvous.meet import SECRET_DIR_ENV, serve_private_store
from hpcrl.rendezvous.store import BusStore, StoreServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def served():
    secret = Secret(os.urandom(32))
    server = StoreServer(secret)
    clients: list[BusStore] = []

    def client(timeout_s: float = 10.0, key: Secret = secret) -> BusStore:
        clients.append(BusStore(server.address, key, timeout_s=timeout_s))
        return clients[-1]
    yield server, client, secret
    for c in clients:
        c.close()
    server.close()


def test_set_get_add_compare_set_check_delete_and_num_keys_behave_as_torchs_stores(served):
    _, client, _ = served
    store = client()
    store.set("a", "x")
    store.set("b", b"\x00\xff")
    assert store.get("a") == b"x" and store.get("b") == b"\x00\xff"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5 and store.get("n") == b"5"
    assert store.compare_set("c", "", "first") == b"first"        # missing + empty expected: set
    assert store.compare_set("c", "other", "no") == b"first"      # mismatch: the current value
    assert store.compare_set("c", "first", "second") == b"second"
    assert store.compare_set("gone", "x", "y") == b"x"           # missing, expected given: unchanged
    assert store.check(["a", "b"]) and not store.check(["a", "zz"])
    assert store.num_keys() == 4
    assert store.delete_key("a") and not store.delete_key("a")
    prefixed = dist.PrefixStore("p", store)  # what every group forms on
    prefixed.set("k", "v")
    assert prefixed.get("k") == b"v" and store.get("p/k") == b"v"


def test_a_get_of_a_missing_key_waits_until_another_client_sets_it(served):
    _, client, _ = served
    waiting, setter = client(), client()
    got: dict[str, bytes] = {}
    asked = threading.Event()

    def get() -> None:
        asked.set()
        got["v"] = waiting.get("late")
    reader = threading.Thread(target=get)
    reader.start()
    assert asked.wait(10)
    setter.set("late", "here")
    reader.join(10)
    assert got == {"v": b"here"}
    setter.wait(["late"], timedelta(seconds=1))  # already there: answered at once


def test_a_get_of_a_key_never_set_fails_at_the_stores_timeout_naming_the_key(served):
    _, client, _ = served
    store = client(timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timed out waiting for key.*never"):
        store.get("never")
    assert 0.4 < time.monotonic() - start < 5
    with pytest.raises(dist.DistStoreError, match="never"):
        store.wait(["never"], timedelta(seconds=0.2))


def test_a_peer_without_the_secret_is_refused_unread_and_a_replayed_request_too(served, monkeypatch):
    server, client, secret = served
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    as_client(sock, secret)  # a sniffer's connection: the PLAIN token (sent in clear), not the secret
    sock.connect(server.address)
    try:
        me = os.urandom(16)
        forged = msgpack.packb([me, 1, "set", ["owned", b"evil"]])
        sock.send_multipart([forged])                                    # unsigned
        sock.send_multipart([forged, signed_store._mac(os.urandom(32), signed_store._REQUEST, forged)])  # another key
        signed = signed_store._seal(secret.key, signed_store._REQUEST, [me, 2, "set", ["mine", b"ok"]])
        sock.send_multipart(signed)
        sock.send_multipart(signed)                                      # the same request again
        probe = signed_store._seal(secret.key, signed_store._REQUEST, [me, 3, "check", [["owned"]]])
        sock.send_multipart(probe)
        answers = []
        while len(answers) < 2:  # one connection is read in order: the probe's answer comes after the rest
            assert sock.poll(10_000), "the store did not answer a signed request"
            answers.append(signed_store._open(secret.key, signed_store._ANSWER, sock.recv_multipart()))
    finally:
        sock.close()
    assert answers == [[me, 2, True, None], [me, 3, True, False]]  # no answer to the forged or replayed ones
    assert server.refused() == {"bad_mac": 2, "replay": 1, "malformed": 0, "handshake": 0}
    assert client().get("mine") == b"ok"
    monkeypatch.setattr(signed_store, "_GRACE_S", 0.5)  # how long a client waits for an answer beyond the timeout
    outsider = client(timeout_s=0.1, key=Secret(os.urandom(32)))
    with pytest.raises(dist.DistStoreError, match="did not answer set"):
        outsider.set("owned", "evil")
    assert not client().check(["owned"])


def test_a_client_without_the_runs_plain_token_delivers_nothing_not_even_a_signed_request(served):
    server, client, secret = served
    signed = signed_store._seal(secret.key, signed_store._REQUEST, [os.urandom(16), 1, "set", ["owned", b"evil"]])
    socks, monitors = [], []
    for token in (None, Secret(os.urandom(32))):  # no credentials; another run's token
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if token is not None:
            as_client(sock, token)
        sock.setsockopt(zmq.SNDTIMEO, 2000)  # a refused handshake drops the pipe (and it is not retried)
        # The monitor first: the handshake can fail before connect() returns to us, and is not tried again.
        monitors.append(sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH))
        sock.connect(server.address)
        try:
            sock.send_multipart(signed)  # signed with the run's secret: only the handshake can refuse it
        except zmq.Again:
            pass  # refused before the send: the pipe is gone, nothing could be queued
        socks.append(sock)
    try:
        for monitor in monitors:  # each client's handshake failed (NULL: at the greeting; a wrong token: by ZAP)
            assert monitor.poll(10_000), "a client's handshake neither failed nor passed"
            monitor.recv_multipart()
        assert server.refused()["handshake"] >= 1  # the wrong token, counted by the store's handler
        assert not any(sock.poll(0) for sock in socks)
    finally:
        for sock in socks:
            sock.disable_monitor()
            sock.close()
        for monitor in monitors:
            monitor.close()
    assert not client().check(["owned"])
    assert {k: v for k, v in server.refused().items() if k != "handshake"} == \
        {"bad_mac": 0, "replay": 0, "malformed": 0}  # nothing reached the MAC check


def test_three_ranks_form_a_gloo_group_through_it_and_allreduce(served):
    _, client, _ = served
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    results: dict[int, list[float]] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            prefix = dist.PrefixStore("g0", client())
            pg = ProcessGroupGloo(prefix, r, 3, timedelta(seconds=30))
            t = torch.full((2,), float(r + 1))
            pg.allreduce([t]).wait()
            results[r] = t.tolist()
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(45)
    assert not errors, errors
    assert results == {r: [6.0, 6.0] for r in range(3)}


def test_hpcrl_runs_store_has_no_tcp_port_and_a_private_directory_removed_at_close(monkeypatch):
    monkeypatch.delenv(SECRET_DIR_ENV, raising=False)
    server = serve_private_store()
    where = os.environ[SECRET_DIR_ENV]
    try:
        assert server.address == f"ipc://{where}/store"
        assert stat.S_IMODE(os.stat(where).st_mode) == 0o700
        store = BusStore(server.address, load_secret(where), timeout_s=5)
        store.set("k", "v")
        assert store.get("k") == b"v"
        store.close()
    finally:
        server.close()
    assert not os.path.exists(where) and SECRET_DIR_ENV not in os.environ
