"""A torch.distributed Store whose table the head keeps, reached by authenticated requests only.

    server = StoreServer(secret, bind="tcp://0.0.0.0:0")     # the head (or `hpcrl run`, on ipc://)
    server.address                                           # hand it to the ranks
    store = BusStore(address, secret, timeout_s=600)         # every rank: a torch.distributed.Store
    dist.init_process_group("gloo", store=PrefixStore("g0", store), rank=r, world_size=n)
    server.close()

Why not torch's TCPStore: it accepts any peer that connects, for as long as it serves, and the
trainer group's collectives and vLLM's StatelessProcessGroup read pickled objects from it. Here a
connection must first pass ZeroMQ's PLAIN handshake with the run's token (hpcrl.bus.zap: a client
without it delivers nothing), and then every request and every answer carries an HMAC-SHA256 of its bytes under the run's secret
(hpcrl.bus.secret, the key of the control bus), checked before anything is unpacked: a peer
without the secret is dropped unread and counted, and a request is refused if its sequence number
is not above the last one seen from its client (no replays). The MAC's domain ("hpcrl-store",
then the direction) differs from the bus's, so no store message can pass for a bus message or
the other way round. Keys and values are bytes, as in torch; messages are limited to MAX_BYTES
(ZeroMQ's MAXMSGSIZE drops a larger one before it is read whole).

One message is two frames, [header, mac]: header = msgpack [client, seq, op, args] for a request,
[client, seq, ok, result] for its answer, mac = HMAC(secret, domain | header). `client` is 16
random bytes per client socket.

The server is one thread with its own ZeroMQ socket, so it answers while the head's event loop is
busy (a formation happens while the head awaits the ranks' calls). A `get`/`wait` of a key not
yet set is parked, not polled: it is answered when a request sets the key, or with a timeout error
at its deadline (the client's store timeout), whichever comes first.

The client is a Python subclass of torch.distributed.Store: torch's C++ calls back into the
methods below (set, get, add, compare_set, wait, check, delete_key, num_keys; docs/FACTS.md).
Each thread gets its own ZeroMQ socket (ZeroMQ sockets are not thread-safe, and a thread blocked
in `wait` must not hold back another's `set`); a blocked request releases the GIL inside ZeroMQ's
poll, so the rest of the process runs meanwhile.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import itertools
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import msgpack
import torch.distributed as dist
import zmq

from hpcrl.bus import zap
from hpcrl.bus.secret import Secret

log = logging.getLogger(__name__)

MAX_BYTES = 4 << 20
"""The largest request or answer (keys and values of a rendezvous are addresses and ids: bytes to kilobytes)."""
_MAC = 32
_CLIENT = 16
_REQUEST, _ANSWER = b"hpcrl-store|request", b"hpcrl-store|answer"
#: How much longer than the store timeout a client waits for an answer before it calls the server unreachable.
_GRACE_S = 10.0
_HWM = 10_000


def _mac(key: bytes, domain: bytes, header: bytes) -> bytes:
    return hmac.new(key, domain + header, hashlib.sha256).digest()


def _seal(key: bytes, domain: bytes, value: list) -> list[bytes]:
    header = msgpack.packb(value, use_bin_type=True)
    return [header, _mac(key, domain, header)]


def _open(key: bytes, domain: bytes, frames: list[bytes]) -> list | None:
    """The header's value, or None unless the frames are [header, mac] with a good MAC (checked first)."""
    if len(frames) != 2 or len(frames[1]) != _MAC:
        return None
    header, mac = frames
    if not hmac.compare_digest(_mac(key, domain, header), mac):
        return None
    try:
        value = msgpack.unpackb(header, raw=False, strict_map_key=True, max_bin_len=MAX_BYTES)
    except Exception:  # noqa: BLE001 - signed but malformed: a bug on the other side, dropped and counted
        return None
    return value if isinstance(value, list) and len(value) == 4 else None


@dataclass(order=True)
class _Parked:
    """A get/wait/multi_get of keys not all set yet: answered when they are, or at `deadline`."""

    deadline: float
    number: int
    route: bytes = field(compare=False)
    client: bytes = field(compare=False)
    seq: int = field(compare=False)
    op: str = field(compare=False)
    keys: list[str] = field(compare=False)
    done: bool = field(default=False, compare=False)


class StoreServer:
    """The key/value table of a run's rendezvous, served on `bind` to clients that hold `secret`."""

    def __init__(self, secret: Secret, *, bind: str = "tcp://127.0.0.1:0") -> None:
        self._key = secret.key
        self._sock: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_BYTES + 1024)
        self._sock.setsockopt(zmq.RCVHWM, _HWM)
        self._sock.setsockopt(zmq.SNDHWM, _HWM)
        self._gate = zap.guard(self._sock, secret)  # before bind: a client without the run's token delivers nothing
        self._sock.bind(bind)
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        """Where clients connect (the bound address, its port filled in)."""
        self._wake_address = f"inproc://hpcrl-store-{secrets.token_hex(8)}"
        self._wake_rx: zmq.Socket = zmq.Context.instance().socket(zmq.PAIR)
        self._wake_rx.bind(self._wake_address)
        self._table: dict[str, bytes] = {}
        self._last_seq: dict[bytes, int] = {}
        self._parked: dict[str, list[_Parked]] = {}
        self._deadlines: list[_Parked] = []
        self._numbers = itertools.count()
        self._refused: dict[str, int] = {"bad_mac": 0, "replay": 0, "malformed": 0}
        """Requests dropped unanswered, by reason (a peer with the PLAIN token but not the secret: bad_mac)."""
        self._thread = threading.Thread(target=self._serve, name="hpcrl-store", daemon=True)
        self._thread.start()

    def refused(self) -> dict[str, int]:
        """Requests dropped unanswered, by reason (bad_mac, replay, malformed), and connections refused
        at the ZeroMQ handshake (`handshake`: no or a wrong token; they delivered nothing)."""
        return {**self._refused, "handshake": self._gate.refused()}

    @property
    def port(self) -> int:
        """The TCP port it listens on (a tcp:// address only)."""
        return int(self.address.rpartition(":")[2])

    def __repr__(self) -> str:
        return f"StoreServer({self.address!r}, {len(self._table)} keys)"

    def close(self) -> None:
        """Stop serving and close the socket (parked requests go unanswered: their clients time out)."""
        if not self._thread.is_alive():
            return
        wake: zmq.Socket = zmq.Context.instance().socket(zmq.PAIR)
        wake.setsockopt(zmq.LINGER, 1000)
        wake.connect(self._wake_address)
        wake.send(b"stop")
        self._thread.join(timeout=10)
        wake.close()

    # -- the serving thread ------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        try:
            while True:
                wait_ms = None
                if self._deadlines:
                    wait_ms = max(0, int((self._deadlines[0].deadline - time.monotonic()) * 1000) + 1)
                events = dict(poller.poll(wait_ms))
                if self._wake_rx in events:
                    return
                if self._sock in events:
                    while True:
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_request(frames)
                self._expire()
        except Exception:  # noqa: BLE001 - a bug here would hang every formation: say so
            log.exception("the rendezvous store's thread failed")
        finally:
            self._sock.close(linger=0)
            self._gate.release()
            self._wake_rx.close(linger=0)

    def _on_request(self, frames: list[bytes]) -> None:
        route, rest = frames[0], frames[1:]
        value = _open(self._key, _REQUEST, rest)
        if value is None:
            self._refused["bad_mac" if len(rest) != 2 or len(rest[1]) != _MAC or not hmac.compare_digest(
                _mac(self._key, _REQUEST, rest[0]), rest[1]) else "malformed"] += 1
            return
        client, seq, op, args = value
        if not (isinstance(client, bytes) and len(client) == _CLIENT and type(seq) is int and isinstance(op, str)
                and isinstance(args, list)):
            self._refused["malformed"] += 1
            return
        if seq <= self._last_seq.get(client, 0):
            self._refused["replay"] += 1
            return
        self._last_seq[client] = seq
        try:
            self._handle(route, client, seq, op, args)
        except (TypeError, ValueError, KeyError) as err:
            self._answer(route, client, seq, False, f"bad {op} request: {err}")

    def _handle(self, route: bytes, client: bytes, seq: int, op: str, args: list) -> None:
        table = self._table
        if op == "set":
            self._put(str(args[0]), bytes(args[1]))
            return self._answer(route, client, seq, True, None)
        if op in ("get", "wait", "multi_get"):
            keys, timeout_s = [str(k) for k in args[0]], float(args[1])
            if all(k in table for k in keys):
                return self._answer(route, client, seq, True, self._result(op, keys))
            parked = _Parked(time.monotonic() + timeout_s, next(self._numbers), route, client, seq, op, keys)
            for k in keys:
                self._parked.setdefault(k, []).append(parked)
            heapq.heappush(self._deadlines, parked)
            return None
        if op == "add":
            key, amount = str(args[0]), int(args[1])
            total = int(table.get(key, b"0")) + amount
            self._put(key, str(total).encode())
            return self._answer(route, client, seq, True, total)
        if op == "compare_set":
            key, expected, desired = str(args[0]), bytes(args[1]), bytes(args[2])
            current = table.get(key)
            if (current is None and expected == b"") or current == expected:
                self._put(key, desired)
                return self._answer(route, client, seq, True, desired)
            return self._answer(route, client, seq, True, expected if current is None else current)
        if op == "append":
            key = str(args[0])
            self._put(key, table.get(key, b"") + bytes(args[1]))
            return self._answer(route, client, seq, True, None)
        if op == "multi_set":
            for key, val in zip(args[0], args[1], strict=True):
                self._put(str(key), bytes(val))
            return self._answer(route, client, seq, True, None)
        if op == "check":
            return self._answer(route, client, seq, True, all(str(k) in table for k in args[0]))
        if op == "delete_key":
            return self._answer(route, client, seq, True, table.pop(str(args[0]), None) is not None)
        if op == "num_keys":
            return self._answer(route, client, seq, True, len(table))
        return self._answer(route, client, seq, False, f"unknown store operation {op!r}")

    def _result(self, op: str, keys: list[str]) -> Any:
        if op == "get":
            return self._table[keys[0]]
        return [self._table[k] for k in keys] if op == "multi_get" else None

    def _put(self, key: str, value: bytes) -> None:
        self._table[key] = value
        for parked in self._parked.pop(key, []):
            if parked.done:
                continue
            if all(k in self._table for k in parked.keys):
                parked.done = True
                self._answer(parked.route, parked.client, parked.seq, True, self._result(parked.op, parked.keys))
            else:
                missing = next(k for k in parked.keys if k not in self._table)
                self._parked.setdefault(missing, []).append(parked)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0].deadline <= now:
            parked = heapq.heappop(self._deadlines)
            if parked.done:
                continue
            parked.done = True
            missing = [k for k in parked.keys if k not in self._table]
            self._answer(parked.route, parked.client, parked.seq, False,
                         f"timed out waiting for key(s) {', '.join(missing[:4])}")
        for key in [k for k, waiting in self._parked.items() if all(p.done for p in waiting)]:
            del self._parked[key]

    def _answer(self, route: bytes, client: bytes, seq: int, ok: bool, result: Any) -> None:
        try:
            self._sock.send_multipart([route, *_seal(self._key, _ANSWER, [client, seq, ok, result])], zmq.NOBLOCK)
        except zmq.ZMQError as err:  # the client is gone or not reading: it times out on its side
            log.debug("rendezvous store: an answer to a client was dropped (%s)", err)


class BusStore(dist.Store):
    """A torch.distributed.Store whose every operation is an authenticated request to a StoreServer."""

    def __init__(self, address: str, secret: Secret, *, timeout_s: float) -> None:
        super().__init__()
        self.address = address
        self._key = secret.key
        self._secret = secret
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._lock = threading.Lock()
        self.set_timeout(timedelta(seconds=timeout_s))

    def __repr__(self) -> str:
        return f"BusStore({self.address!r})"

    def _socket(self) -> tuple[zmq.Socket, bytes, itertools.count]:
        mine = getattr(self._local, "socket", None)
        if mine is None:
            sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_BYTES + 1024)
            zap.as_client(sock, self._secret)
            sock.connect(self.address)
            mine = self._local.socket = (sock, secrets.token_bytes(_CLIENT), itertools.count(1))
            with self._lock:
                self._sockets.append(sock)
        return mine

    def _request(self, op: str, args: list, *, wait_s: float = 0.0) -> Any:
        sock, client, seqs = self._socket()
        seq = next(seqs)
        deadline = time.monotonic() + wait_s + _GRACE_S
        # A DEALER with no live connection (the head not up yet or gone, or this process's token refused
        # at the handshake) blocks a send until one comes: bound it by the request's own deadline.
        sock.setsockopt(zmq.SNDTIMEO, max(1, int((wait_s + _GRACE_S) * 1000)))
        try:
            sock.send_multipart(_seal(self._key, _REQUEST, [client, seq, op, args]))
        except zmq.Again:
            deadline = 0.0  # never sent: no answer to wait for
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000) + 1):
                break
            value = _open(self._key, _ANSWER, sock.recv_multipart())
            if value is None or value[0] != client or value[1] != seq:
                continue  # forged, or the late answer of a request that timed out here: not ours
            if not value[2]:
                raise dist.DistStoreError(f"rendezvous store at {self.address}: {op} failed: {value[3]}")
            return value[3]
        raise dist.DistStoreError(f"the rendezvous store at {self.address} did not answer {op} within "
                                  f"{wait_s + _GRACE_S:g} s: is the run's head (or `hpcrl run`) still up, and is "
                                  "this process using the run's secret?")

    def _timeout_s(self, timeout: Any = None) -> float:
        given = timeout if isinstance(timeout, timedelta) else self.timeout  # type: ignore[attr-defined]  # torch's stubs lack it
        return given.total_seconds()

    # -- torch.distributed.Store -------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        self._request("set", [key, _bytes(value)])

    def get(self, key: str) -> bytes:
        wait_s = self._timeout_s()
        return self._request("get", [[key], wait_s], wait_s=wait_s)

    def add(self, key: str, amount: int) -> int:
        return self._request("add", [key, int(amount)])

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._request("compare_set", [key, _bytes(expected), _bytes(desired)])

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        wait_s = self._timeout_s(timeout)
        self._request("wait", [list(keys), wait_s], wait_s=wait_s)

    def check(self, keys: list[str]) -> bool:
        return self._request("check", [list(keys)])

    def delete_key(self, key: str) -> bool:
        return self._request("delete_key", [key])

    def num_keys(self) -> int:
        return self._request("num_keys", [])

    def append(self, key: str, value: Any) -> None:
        self._request("append", [key, _bytes(value)])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        wait_s = self._timeout_s()
        return self._request("multi_get", [list(keys), wait_s], wait_s=wait_s)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._request("multi_set", [list(keys), [_bytes(v) for v in values]])

    def clone(self) -> BusStore:
        return BusStore(self.address, self._secret, timeout_s=self._timeout_s())

    def close(self) -> None:
        """Close this store's sockets (call once no thread uses it)."""
        with self._lock:
            for sock in self._sockets:
                sock.close(linger=0)
            self._sockets.clear()


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
