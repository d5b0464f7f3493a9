"""The one adapter for ZeroMQ: sockets of the bus, driven by the asyncio event loop.

`bind_router` (head) and `connect_dealer` (workers) make the sockets; `Channel` reads whole
multipart messages and hands them to a callback (the small leading frames as bytes, buffers as
memoryviews without a copy), and sends large frames without copying. Sockets are plain (not
zmq.asyncio, no task or future per message): the loop watches the socket's FD, and a readable FD
starts a drain, which is followed by another through the loop until no message waits.

ZeroMQ's FD is edge-triggered: it signals only when the socket's state changes, and a send
may consume that change. So after every send that leaves a message waiting (ZMQ_EVENTS), and
after every message handled, the channel schedules one more drain (coalesced) instead of
waiting for an FD event that may never come.

A drain handles one message and schedules the next drain behind whatever that message woke
(call_soon is first in, first out): a caller waiting for a reply resumes before the socket is
asked again (a ZMQ_EVENTS check is two system calls), and while that drain is pending a send
need not ask at all.

`spin(seconds)` keeps the loop polling instead of sleeping for a while (the head calls it after
sending a request): a reply that comes back within that time is read without waking a sleeping
thread, which on a small VM is a quarter of a quick call's round trip. Each turn of the spin is a
callback that gives the CPU to any other runnable thread (sched_yield) and lets the loop poll its
file descriptors without blocking, so timers, other sockets and other threads are served as usual.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import cast

import zmq

from hpcrl.bus import zap
from hpcrl.bus.secret import Secret

log = logging.getLogger(__name__)

#: Frames shorter than this are sent by copying (cheaper than a zero-copy zmq.Frame); pyzmq
#: copies them anyway (its copy_threshold), but only after building the Frame object.
_COPY_BELOW = int(zmq.COPY_THRESHOLD)
_HWM = 100_000
# Plain ints: pyzmq's flag enums cost microseconds per frame on the hot path.
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
# pyzmq's Socket.send is a Python wrapper (routing_id/group handling) around the compiled one.
_raw_send = zmq.backend.Socket.send
# The compiled getter, typed for the one option read with it on the hot path (ZMQ_EVENTS, an int).
_get_int = cast("Callable[[zmq.Socket, int], int]", zmq.Socket.get)


def _context() -> zmq.Context:
    return zmq.Context.instance()


def bind_router(address: str, *, secret: Secret, max_frame_bytes: int,
                receive_queue: int) -> tuple[zmq.Socket, str, zap.Guard]:
    """Bind a ROUTER to `address` (port 0 or '*' for a free port); return it, the real address and
    its guard (hpcrl.bus.zap: only connections that present the run's PLAIN token deliver anything).

    A sniffer of the network learns that token, so libzmq's own limits still bound what an
    admitted connection makes the head hold before the bus's checks see anything: a frame above
    `max_frame_bytes` closes its connection (ZMQ_MAXMSGSIZE is per frame, not per multipart
    message), and at most `receive_queue` whole messages wait per connection (ZMQ_RCVHWM; then
    libzmq stops reading it and the sender waits: nothing is dropped). See docs/FACTS.md (ZeroMQ)."""
    sock = _context().socket(zmq.ROUTER)
    gate = zap.guard(sock, secret)  # before bind: no connection is ever served unchecked
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone peer fails instead of vanishing
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.SNDHWM, _HWM)
    sock.setsockopt(zmq.RCVHWM, receive_queue)
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        gate.release()
        from hpcrl.bus.errors import BusError
        raise BusError(f"cannot bind the head's bus socket to {address}: {exc}") from None
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT), gate


def connect_dealer(address: str, *, secret: Secret, routing_id: bytes, hard_max_bytes: int) -> zmq.Socket:
    """Connect a DEALER to the head at `address`, with a routing id that survives reconnects."""
    sock = _context().socket(zmq.DEALER)
    zap.as_client(sock, secret)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.MAXMSGSIZE, hard_max_bytes)
    sock.setsockopt(zmq.SNDHWM, _HWM)
    sock.setsockopt(zmq.RCVHWM, _HWM)
    sock.connect(address)
    return sock


def send_once(address: str, frames: list, *, secret: Secret, timeout: float) -> bool:
    """Connect a throw-away DEALER to `address`, send one message, and wait up to `timeout` in all
    for it to leave this process (blocking; for a process that has no loop, e.g. a task's
    supervisor, which exits with os._exit right after). True once it is out of the process.

    A send only queues the message: libzmq's I/O thread writes it to the connection later, and
    that thread dies with the process. So the socket gets a context of its own, and terminating
    that context waits (the socket's LINGER, what is left of `timeout`) until the I/O thread has
    handed the message to the kernel, which delivers it after the process is gone. Without that
    wait a supervisor's farewell was lost in about 1 run of 10 on a loaded 2-core VM."""
    deadline = time.monotonic() + timeout
    ctx = zmq.Context()  # not the shared instance: its term() would wait for every socket of the process
    sock = ctx.socket(zmq.DEALER)
    linger_ms = 0  # nothing queued: nothing to wait for
    try:
        zap.as_client(sock, secret)  # the head's PLAIN handshake (hpcrl.bus.zap)
        sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only once connected (handshake passed): SNDTIMEO covers both
        sock.connect(address)
        sock.send_multipart(frames, copy=True)
        linger_ms = max(1, int((deadline - time.monotonic()) * 1000))
    except zmq.ZMQError:
        return False
    finally:
        sock.close(linger=linger_ms)
        ctx.term()  # returns once the queued message is written to the connection, or the linger ran out
    return time.monotonic() < deadline


class Channel:
    """One socket on the running loop: `on_message(frames)` for every message, `send(frames)`."""

    def __init__(self, sock: zmq.Socket, on_message: Callable[[list], None], *, small_frames: int = 1,
                 awaiting: Callable[[], int] = lambda: 0) -> None:
        """`small_frames`: how many leading frames of every message are small (routing id,
        header) and are received as bytes; the rest arrive as memoryviews, without a copy.
        `awaiting()`: how many replies are awaited (a spin ends as soon as it says 0)."""
        self._sock = sock
        self._small = small_frames
        self._on_message = on_message
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = sock.fileno()  # ZMQ_FD
        self._kicked = False
        self._draining = False
        self._awaiting = awaiting
        self._spin_until = 0.0
        self._spinning = False
        self.closed = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._drain)
        self._kick()

    def send(self, frames: list) -> bool:
        """Send one message now; False if the peer is not connected or its queue is full."""
        if self.closed:
            return False
        try:
            return self._put(frames)
        finally:
            # The send may have eaten the FD's edge. While a drain runs or is scheduled, that
            # drain reads the level itself, so only other sends ask.
            if not (self._draining or self._kicked) and _get_int(self._sock, _EVENTS) & _POLLIN:
                self._kick()

    def send_many(self, messages: list[list]) -> list[bool]:
        """Send several messages in a row (a fanout); one bool each, like send()."""
        if self.closed:
            return [False] * len(messages)
        try:
            return [self._put(frames) for frames in messages]
        finally:
            if not (self._draining or self._kicked) and _get_int(self._sock, _EVENTS) & _POLLIN:  # once for the lot
                self._kick()

    def _put(self, frames: list) -> bool:
        sock, last = self._sock, len(frames) - 1
        try:
            # Large buffers go out zero-copy; small frames are copied (cheaper than a Frame).
            # With NOBLOCK, once the first frame is queued the rest of the message is too.
            for i, frame in enumerate(frames):
                _raw_send(sock, frame, _NOBLOCK if i == last else _NOBLOCK_MORE, len(frame) < _COPY_BELOW, False)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise
        return True

    def close(self, *, linger: float = 0.0) -> None:
        """Close now; messages already queued (a goodbye) still go out for `linger` seconds."""
        if self.closed:
            return
        self.closed = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._sock.close(linger=int(linger * 1000))

    def spin(self, seconds: float) -> None:
        """Poll instead of sleeping for up to `seconds` from now, while `awaiting()` is true."""
        if seconds <= 0 or self.closed or self._loop is None:
            return
        self._spin_until = max(self._spin_until, self._loop.time() + seconds)
        if not self._spinning:
            self._spinning = True
            self._loop.call_soon(self._spin_turn, self._loop)

    def _spin_turn(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.closed or loop.time() > self._spin_until or not self._awaiting():
            self._spinning = False
            return
        os.sched_yield()  # another runnable thread of this CPU (libzmq's I/O thread, say) goes first
        loop.call_soon(self._spin_turn, loop)  # a ready callback: the loop polls without blocking

    def _kick(self) -> None:
        if not self._kicked and not self.closed and self._loop is not None:
            self._kicked = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._kicked = False
        if self.closed:
            return
        sock = self._sock
        # Ask before receiving (this also takes in libzmq's pending commands): a zmq.Again
        # exception costs more than the check.
        if not _get_int(sock, _EVENTS) & _POLLIN:
            return
        self._draining = True
        try:
            # Every frame comes as a zmq.Frame (its `more` saves asking the socket); the leading
            # small ones (routing id, header) are copied out as bytes, the rest (maybe large
            # buffers) are handed on as memoryviews without a copy.
            recv, small = sock.recv, self._small
            frames: list[bytes | memoryview] = []
            while True:  # the rest of a multipart message is already here
                frame = recv(_NOBLOCK, copy=False)
                frames.append(frame.bytes if len(frames) < small else frame.buffer)
                if not frame.more:
                    break
            self._on_message(frames)
        finally:
            self._draining = False
            self._kick()  # the next message, if any, after what this one woke
