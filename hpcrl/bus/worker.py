"""A group process's end of the control bus: register, serve endpoints, heartbeat, leave.

    worker = Worker(info=PeerInfo(run_id="r1", group="inference", replica=2, host=..., pid=...),
                    secret=load_secret(run_dir), address=head_address)

    @worker.endpoint(idempotent=True)       # safe to re-run on another replica after a failure
    async def generate(call):               # call.args: msgpack value, call.buffers: memoryviews
        return {"tokens": ...}              # or Payload(value=..., buffers=[array, ...])

    reason = await worker.serve()           # returns when the head says BYE, goes silent, or stop()
    worker.exit_code                        # the code the head's BYE told this process to exit with

A process that registers before it can serve (a group task loading its model) makes the Worker
with ready=False, adds its endpoints when it can, and calls `mark_ready()`: the head counts it
as started at once, and as serving from then on.

`serve()` registers (retrying every heartbeat_interval for register_timeout), then answers
requests: an async endpoint runs in its own task, cancelled at the caller's deadline; a plain
function runs inline on the loop (cheapest, for quick work) and is answered at once. serve()
returns a `WorkerExit` and closes its socket; when the head has been silent for
heartbeat_timeout it returns HEAD_LOST, within 2 x heartbeat_timeout of the head's death, so
the process can exit and free its GPU. A Worker lives on one event loop and is not thread-safe.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpcrl.bus import channel as _channel
from hpcrl.bus.config import BusConfig
from hpcrl.bus.errors import BusError
from hpcrl.bus.peer import PeerInfo
from hpcrl.bus.router import routing_id
from hpcrl.bus.secret import Secret
from hpcrl.bus.wire import INCARNATION_BYTES, Counters, Envelope, Kind, Opener, Payload, Sealer

log = logging.getLogger(__name__)


#: Result types that are never awaitable (inspect.isawaitable costs an ABC check per call).
_PLAIN_RESULTS = frozenset((dict, list, tuple, str, bytes, int, float, bool, type(None), Payload))


class WorkerExit(enum.Enum):
    SHUTDOWN = "the head told this worker to leave"
    HEAD_LOST = "the head was silent for heartbeat_timeout"
    UNREACHABLE = "no head answered the registration within register_timeout"
    STOPPED = "stop() was called"


@dataclass(kw_only=True, slots=True)  # not frozen: a frozen __init__ costs microseconds per call
class Call:
    """One request as an endpoint sees it (treat it as read-only)."""

    endpoint: str
    args: Any
    buffers: tuple[memoryview, ...]
    deadline: float
    """Loop time (`asyncio.get_running_loop().time()`) after which the caller has given up."""


class Worker:
    """Serves the named endpoints (async or plain functions) of one group process to the head."""

    def __init__(self, *, info: PeerInfo, secret: Secret, address: str, config: BusConfig | None = None,
                 ready: bool = True, incarnation: bytes | None = None) -> None:
        """`ready=False`: register as starting, serve after `mark_ready()`. `incarnation`: this
        process's id on the bus (random by default; a task's supervisor chooses it, to speak
        for the task after it ended: hpcrl.bus.farewell)."""
        self.info = info
        self.address = address
        self.config = config or BusConfig()
        self.incarnation = incarnation or secrets.token_bytes(INCARNATION_BYTES)
        self._counters = Counters()
        self._secret = secret
        self._sealer = Sealer(secret, self.incarnation)
        self._opener = Opener(secret, me=self.incarnation, counters=self._counters,
                              max_bytes=self.config.max_message_bytes, max_frames=self.config.max_frames)
        self._endpoints: dict[str, tuple[Callable[[Call], Any], bool, bool]] = {}  # fn, idempotent, async
        self._head: bytes | None = None
        self._heartbeat = (self.config.heartbeat_interval, self.config.heartbeat_timeout)
        self._last_heard = 0.0
        self._loop: asyncio.AbstractEventLoop  # set by serve(); read only by what serve() set going
        self._channel: _channel.Channel | None = None
        self._welcomed: asyncio.Event | None = None
        self._done: asyncio.Future | None = None
        self._tasks: set[asyncio.Task] = set()
        self._ready = ready
        self.exit_detail = ""
        self.exit_code: int | None = None
        """The code the head's BYE said to exit with (None: it gave none, or no BYE came)."""

    def __repr__(self) -> str:
        return f"Worker({self.info.name}, address={self.address!r}, endpoints={sorted(self._endpoints)})"

    @property
    def name(self) -> str:
        return self.info.name

    def counters(self) -> dict[str, int]:
        """Accepted messages, and dropped ones by reason (forged, replayed, too large, ...)."""
        return self._counters.snapshot()

    # ---------------------------------------------------------------- endpoints

    @property
    def head_incarnation(self) -> bytes | None:
        """The incarnation id of the head that welcomed this worker; None before."""
        return self._head

    async def welcomed(self) -> None:
        """Return once the head has admitted this worker (serve() must be running)."""
        while self._welcomed is None:
            await asyncio.sleep(0.01)
        await self._welcomed.wait()

    def add_endpoint(self, name: str, fn: Callable[[Call], Any], *, idempotent: bool = False) -> None:
        """Expose `fn(call)` (plain or async) as `name`; idempotent ones may be retried elsewhere."""
        if self._ready and self._channel is not None:
            raise BusError(f"peer {self.name}: endpoints must be added before serve() or mark_ready()")
        if name in self._endpoints:
            raise BusError(f"peer {self.name}: endpoint {name!r} is defined twice")
        self._endpoints[name] = (fn, idempotent, inspect.iscoroutinefunction(fn))

    def endpoint(self, name: str | None = None, *, idempotent: bool = False) -> Callable:
        """Decorator form of add_endpoint; the name defaults to the function's."""
        def register(fn: Callable[[Call], Any]) -> Callable[[Call], Any]:
            self.add_endpoint(name or fn.__name__, fn, idempotent=idempotent)
            return fn
        return register

    # ---------------------------------------------------------------- life cycle

    def mark_ready(self) -> None:
        """Serve the endpoints added so far: tell the head (READY). Once; serve() must be running."""
        if self._ready:
            raise BusError(f"peer {self.name} is ready already")
        self._ready = True
        if self._head is not None:  # not yet welcomed: the next REGISTER says ready
            self._send(Kind.READY, {"endpoints": self._endpoint_flags()})

    def _endpoint_flags(self) -> dict[str, bool]:
        return {n: idem for n, (_, idem, _) in self._endpoints.items()} if self._ready else {}

    async def serve(self) -> WorkerExit:
        """Register, then serve until the head says BYE, falls silent, or stop() is called."""
        self._loop = loop = asyncio.get_running_loop()
        self._welcomed = asyncio.Event()
        self._done = loop.create_future()
        sock = _channel.connect_dealer(self.address, secret=self._secret, routing_id=routing_id(self.incarnation),
                                       hard_max_bytes=4 * self.config.max_message_bytes)
        self._channel = _channel.Channel(sock, self._on_message)
        self._channel.start()
        beat = asyncio.create_task(self._beat(self._welcomed), name=f"hpcrl-bus-{self.name}-heartbeat")
        try:
            return await self._done
        finally:
            beat.cancel()
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=1.0)
            how = self._done.result() if self._done.done() and not self._done.cancelled() else None
            self._channel.close(linger=1.0 if how is WorkerExit.STOPPED else 0.0)  # let the BYE out
            log.debug("bus: %s left the bus: %s%s", self.name, how.value if how else "serve() was cancelled",
                      f" ({self.exit_detail})" if self.exit_detail else "")

    def stop(self, reason: str = "stopped by its process", code: int | None = None) -> None:
        """Say goodbye to the head (with the exit code this process is about to exit with, if
        given) and make serve() return STOPPED."""
        if self._head is not None:
            self._send(Kind.BYE, {"reason": reason} if code is None else {"reason": reason, "code": code})
        self._finish(WorkerExit.STOPPED, reason)

    def _finish(self, how: WorkerExit, detail: str = "") -> None:
        if self._done is not None and not self._done.done():
            self.exit_detail = detail
            self._done.set_result(how)

    async def _beat(self, welcomed: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        while self._head is None:  # register until welcomed
            if loop.time() - start > self.config.register_timeout:
                return self._finish(WorkerExit.UNREACHABLE, f"no WELCOME from {self.address}")
            self._send(Kind.REGISTER, {"peer": self.info.to_wire(), "t": time.time(), "ready": self._ready,
                                       "endpoints": self._endpoint_flags()})
            try:
                await asyncio.wait_for(welcomed.wait(), self.config.heartbeat_interval)
            except TimeoutError:
                pass
        while True:
            interval, timeout = self._heartbeat
            await asyncio.sleep(interval)
            silent = loop.time() - self._last_heard
            if silent > timeout:
                return self._finish(WorkerExit.HEAD_LOST, f"no word from the head for {silent:.2f} s")
            self._send(Kind.HEARTBEAT)

    def _send(self, kind: Kind, body: Any = None, buffers: Any = ()) -> bool:
        frames = self._sealer.seal(kind, body, to=self._head or b"", buffers=buffers)
        ok = self._channel is not None and self._channel.send(frames)
        if not ok:
            self._counters.count("send_failed")
        return ok

    # ---------------------------------------------------------------- incoming

    def _on_message(self, frames: list[memoryview]) -> None:
        env = self._opener.open(frames)
        if env is None:
            return
        if self._head is None:
            if env.kind != Kind.WELCOME:
                return self._counters.drop("drop_unknown_peer", f"{env.kind.name} before WELCOME")
            body = env.body
            if not (isinstance(body, dict) and all(isinstance(body.get(k), (int, float)) and body[k] > 0
                                                   for k in ("hb", "hbt"))):
                return self._counters.drop("malformed", "WELCOME without heartbeat settings")
            self._head = env.sender
            self._heartbeat = (float(body["hb"]), float(body["hbt"]))
            self._last_heard = self._loop.time()
            self._counters.accept()
            assert self._welcomed is not None  # made by serve() before the channel that delivers this
            self._welcomed.set()
            log.debug("bus: %s registered with the head at %s", self.name, self.address)
            return
        if env.sender != self._head:
            return self._counters.drop("drop_unknown_peer", "a message from another head")
        self._last_heard = self._loop.time()
        if env.kind in (Kind.HEARTBEAT, Kind.WELCOME):
            self._counters.accept()
        elif env.kind == Kind.REQUEST:
            self._on_request(env)
        elif env.kind == Kind.BYE:
            self._counters.accept()
            reason, code = (env.body.get("reason"), env.body.get("code")) if isinstance(env.body, dict) else (None, None)
            self.exit_code = code if type(code) is int else None
            self._finish(WorkerExit.SHUTDOWN, reason if isinstance(reason, str) else "")
        else:
            self._counters.drop("malformed", f"{env.kind.name} is not sent to a worker")

    def _on_request(self, env: Envelope) -> None:
        body = env.body
        if not (isinstance(body, dict) and isinstance(body.get("id"), int) and isinstance(body.get("ep"), str)
                and isinstance(body.get("ttl"), (int, float))):
            return self._counters.drop("malformed", "request without id/ep/ttl")
        self._counters.accept()
        rid, name = body["id"], body["ep"]
        if name not in self._endpoints:
            self._reply_error(rid, "UnknownEndpoint", f"{self.name} has no endpoint {name!r}")
            return
        fn, _, is_async = self._endpoints[name]
        loop = self._loop
        call = Call(endpoint=name, args=body.get("a"), buffers=env.buffers, deadline=loop.time() + body["ttl"])
        if is_async:
            task = asyncio.create_task(self._run(rid, fn, call, body["ttl"]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        # A plain function runs right here, on the loop (keep such endpoints quick): no task.
        try:
            result = fn(call)
        except Exception as exc:  # noqa: BLE001 - the endpoint's own failure goes back to the caller, typed
            return self._reply_error(rid, type(exc).__name__, str(exc))
        if type(result) not in _PLAIN_RESULTS and inspect.isawaitable(result):  # it handed back a coroutine
            task = asyncio.create_task(self._run(rid, lambda _call: result, call, body["ttl"]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        if loop.time() > call.deadline:
            self._counters.count("expired")
            return
        self._reply(rid, call, result)

    async def _run(self, rid: int, fn: Callable[[Call], Any], call: Call, ttl: float) -> None:
        try:
            async with asyncio.timeout(ttl) as scope:
                result = fn(call)
                if inspect.isawaitable(result):
                    result = await result
        except TimeoutError:
            if scope.expired():  # the caller has given up already: nobody to answer
                self._counters.count("expired")
                log.debug("bus: %s: %s passed its deadline", self.name, call.endpoint)
                return
            return self._reply_error(rid, "TimeoutError", "the endpoint raised TimeoutError")
        except Exception as exc:  # noqa: BLE001 - the endpoint's own failure goes back to the caller, typed
            log.debug("bus: %s: %s raised %r", self.name, call.endpoint, exc)
            return self._reply_error(rid, type(exc).__name__, str(exc))
        self._reply(rid, call, result)

    def _reply(self, rid: int, call: Call, result: Any) -> None:
        if isinstance(result, Payload):
            body, buffers = {"id": rid, "ok": True, "r": result.value, "pl": True}, result.buffers
        else:
            body, buffers = {"id": rid, "ok": True, "r": result}, ()
        try:
            self._send(Kind.REPLY, body, buffers)
        except (TypeError, ValueError, OverflowError) as exc:  # result not msgpack-able
            self._reply_error(rid, type(exc).__name__, f"the result of {call.endpoint!r} cannot be sent: {exc}")

    def _reply_error(self, rid: int, etype: str, message: str) -> None:
        self._send(Kind.REPLY, {"id": rid, "ok": False, "e": [etype, message]})
