"""Who may connect to the head's sockets at all: ZeroMQ's PLAIN mechanism, checked by our ZAP handler.

    gate = guard(sock, secret)   # a head socket, before bind(): only PLAIN clients with the run's token
    as_client(sock, secret)      # a worker's DEALER, a supervisor's farewell, a store client: before connect()
    gate.refused()               # connections the handler turned away (for the head's counters)
    gate.release()               # when the guarded socket is closed

Why: libzmq assembles a whole multipart message before the application sees any of it, and
ZMQ_MAXMSGSIZE bounds each frame, not the message, so before this anyone who reached the port
could make the head hold one message of thousands of frames before its MAC was checked. With
PLAIN, a connection carries no message at all until its handshake passed: libzmq asks the ZAP
handler of the socket's context (RFC 27, a REP socket bound to inproc://zeromq.zap.01) and drops
the connection on any answer but 200. PLAIN costs a handshake step per connection and nothing per
message (CURVE encrypts every byte: 5-9x slower for 1 MiB messages).

The password is a token derived from the run's secret (HMAC-SHA256(secret, "hpcrl-zmq-plain-v1"),
hex), not the secret itself: PLAIN sends it in clear, so anyone who can sniff the network learns
it and can connect. The per-message HMAC under the secret (hpcrl.bus.wire) stays the real
authentication; the token only keeps strangers from delivering anything (docs/FACTS.md, ZeroMQ).

One handler serves every guarded socket of a context (libzmq allows one ZAP endpoint per
context): each guarded socket gets its own ZAP domain and its own token, so two runs' heads in
one process (tests) do not let each other's clients in. The handler is a thread with a REP
socket bound in the caller's thread before `guard` returns, so it exists before the guarded
socket binds. Without a handler, libzmq 4.3 refuses every PLAIN connection (verified): the
guard fails closed, e.g. after the context was terminated.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import os
import threading

import zmq

from hpcrl.bus.errors import BusError
from hpcrl.bus.secret import Secret

log = logging.getLogger(__name__)

PLAIN_USER = b"hpcrl"
_TOKEN_LABEL = b"hpcrl-zmq-plain-v1"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_domains = itertools.count(1)


def plain_password(secret: Secret) -> bytes:
    """The PLAIN password of the run whose secret this is (64 hex digits; the secret stays hidden)."""
    return hmac.new(secret.key, _TOKEN_LABEL, hashlib.sha256).hexdigest().encode()


def as_client(sock: zmq.Socket, secret: Secret) -> None:
    """Make `sock` (before connect) present the run's PLAIN credentials to a guarded socket."""
    sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USER)
    sock.setsockopt(zmq.PLAIN_PASSWORD, plain_password(secret))


def guard(sock: zmq.Socket, secret: Secret) -> Guard:
    """Make `sock` (before bind) accept only connections that present the run's PLAIN token."""
    handler = _handler(sock.context)
    domain = f"hpcrl-{os.getpid()}-{next(_domains)}".encode()
    handler.admit(domain, plain_password(secret))
    sock.setsockopt(zmq.PLAIN_SERVER, 1)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain)
    return Guard(handler, domain)


class Guard:
    """One guarded socket's entry in its context's handler."""

    def __init__(self, handler: _Handler, domain: bytes) -> None:
        self._handler = handler
        self.domain = domain

    def refused(self) -> int:
        """How many connections the handler turned away from this socket so far."""
        return self._handler.refused(self.domain)

    def release(self) -> None:
        """Forget this socket's token (when it closes): later handshakes to it are refused."""
        self._handler.forget(self.domain)


class _Handler:
    """The ZAP handler of one context: a thread answering libzmq's requests, domain -> token."""

    def __init__(self, context: zmq.Context) -> None:
        self.context = context
        self.pid = os.getpid()
        self._tokens: dict[bytes, bytes] = {}
        self._refused: dict[bytes, int] = {}
        self._lock = threading.Lock()
        sock = context.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(_ZAP_ENDPOINT)  # here, not in the thread: bound before guard() returns
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise BusError(f"cannot install the bus's ZAP handler ({_ZAP_ENDPOINT}): {exc}; another "
                           "authenticator (e.g. zmq.auth) owns this ZeroMQ context's handler") from None
        self._sock = sock
        self.alive = True
        threading.Thread(target=self._serve, name="hpcrl-zap", daemon=True).start()

    def admit(self, domain: bytes, token: bytes) -> None:
        with self._lock:
            self._tokens[domain] = token
            self._refused.setdefault(domain, 0)

    def forget(self, domain: bytes) -> None:
        with self._lock:
            self._tokens.pop(domain, None)

    def refused(self, domain: bytes) -> int:
        with self._lock:
            return self._refused.get(domain, 0)

    def _serve(self) -> None:
        sock = self._sock
        try:
            while True:
                request = sock.recv_multipart()
                sock.send_multipart(self._answer(request))
        except zmq.ContextTerminated:
            pass
        except Exception:  # noqa: BLE001 - without the handler every guarded socket refuses all: say why
            log.exception("bus: the ZAP handler failed; the head's sockets now refuse every connection")
        finally:
            self.alive = False
            sock.close(linger=0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        """RFC 27: [version, id, domain, address, identity, mechanism, *credentials] ->
        [version, id, status, text, user id, metadata]."""
        if len(request) < 6:  # not from libzmq: answer something so the REP socket stays usable
            return [b"1.0", request[1] if len(request) > 1 else b"", b"400", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _identity, mechanism, *credentials = request
        with self._lock:
            expected = self._tokens.get(domain)
            ok = (version == b"1.0" and mechanism == b"PLAIN" and expected is not None and len(credentials) == 2
                  and hmac.compare_digest(credentials[0], PLAIN_USER)
                  and hmac.compare_digest(credentials[1], expected))
            if not ok and domain in self._refused:
                self._refused[domain] += 1
        if ok:
            return [b"1.0", request_id, b"200", b"OK", PLAIN_USER, b""]
        log.debug("bus: refused a %s handshake from %s (domain %s)", mechanism.decode(errors="replace"),
                  address.decode(errors="replace"), domain.decode(errors="replace"))
        return [b"1.0", request_id, b"400", b"hpcrl: wrong or missing credentials", b"", b""]


_live: dict[int, _Handler] = {}
_start_lock = threading.Lock()


def _handler(context: zmq.Context) -> _Handler:
    """This context's handler, started on first use (again in a forked child, or after it died)."""
    with _start_lock:
        handler = _live.get(id(context))
        if handler is None or handler.context is not context or handler.pid != os.getpid() or not handler.alive:
            handler = _live[id(context)] = _Handler(context)
        return handler
