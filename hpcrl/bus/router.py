"""The head's end of the control bus: one ROUTER, the peer table, calls, health, peer events.

    router = Router(run_id="r1", secret=load_secret(run_dir), address="tcp://0.0.0.0:0",
                    on_unhealthy=relaunch)             # hook: called with the dead PeerInfo
    address = await router.start()                     # the real address, to hand to workers
    router.watch(events.append)                        # PeerEvent: registered/ready/exited/dead
    await router.wait_for_peers("inference", replicas=4, timeout=600)
    reply = await router.request("inference/2/0", "generate", {"prompt": ...}, timeout=30)
    router.dismiss("inference/2/0", code=0, reason="the run is over")

A peer's life at the router:

    REGISTER ------> registered --READY--> ready --dismiss()--> dismissed --BYE(code)--> exited
                          |                  |                      |
                          +-- silent for heartbeat_timeout, mark_dead(), BYE --> dead (or exited)

Workers register (PeerInfo, and the endpoints they expose, each marked idempotent or not);
the router welcomes them with the run's heartbeat settings. A worker that registers before
it can serve (a group task still loading its model) says READY, with its endpoints, once it
can: only ready peers count for `wait_for_peers` and take calls. Heartbeats go both ways
every heartbeat_interval; a peer silent for heartbeat_timeout is declared unhealthy: its
pending calls fail with PeerDeadError (services retry the idempotent ones elsewhere), it is
told to leave, and the unhealthy hooks run. A new registration under the same name
re-admits it. A process once declared dead stays dead: its later messages are dropped and
answered by BYE - except one BYE carrying its exit code, which is how a task's exit code
reaches the head, from the task's supervisor process after the task ended (any connection:
the MAC proves who sent it; see hpcrl.bus.farewell).

Per-peer state is a small mutable record (`_PeerState`); what callers see is `PeerInfo` and
`PeerEvent`. The module is ~600 lines on purpose: the peer table, the pending calls and the
health watch are one state machine on one loop (a death fails the peer's pending calls and wakes
waiters; a registration replaces a peer and bumps the generation Service caches on), and split
across modules each part would reach into the others' private state. Spread calls over replicas with `hpcrl.bus.service.Service`, not by hand.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hpcrl.bus import channel as _channel
from hpcrl.bus import zap as _zap
from hpcrl.bus.config import BusConfig
from hpcrl.bus.errors import (
    BusError,
    DeadlineExceeded,
    HeadClosedError,
    PeerDeadError,
    RemoteError,
    UnknownEndpointError,
    UnknownPeerError,
)
from hpcrl.bus.peer import PeerInfo
from hpcrl.bus.secret import Secret
from hpcrl.bus.wire import INCARNATION_BYTES, Counters, Envelope, Kind, Opener, Payload, Sealer

log = logging.getLogger(__name__)


def routing_id(incarnation: bytes) -> bytes:
    """The ZeroMQ routing id a worker uses: fixed per process, so it survives reconnects."""
    return b"w" + incarnation


@dataclass(kw_only=True, eq=False, slots=True)
class _PeerState:
    info: PeerInfo
    incarnation: bytes
    endpoints: dict[str, bool]
    last_seen: float
    route: bytes = b""
    """The ZeroMQ routing id of its connection (`routing_id(incarnation)`), kept to send."""
    ready: bool = True
    """It serves its endpoints (REGISTER said so, or READY came); only ready peers take calls."""
    exit_code: int | None = None
    """The code its process exited with, once a BYE carried it."""
    healthy: bool = True
    dead_reason: str = ""
    outstanding: int = 0

    def __post_init__(self) -> None:
        self.route = routing_id(self.incarnation)

    @property
    def name(self) -> str:
        return self.info.name


@dataclass(kw_only=True, eq=False, slots=True)
class _Fanout:
    """One call to many peers: one future for all, one timer, results in order."""

    future: asyncio.Future
    results: list
    left: int
    open: set[int]
    timer: asyncio.TimerHandle | None = None


@dataclass(kw_only=True, eq=False, slots=True)
class _Pending:
    future: asyncio.Future
    """The caller's future (for a fanout: the fanout's, shared by all its peers)."""
    peer: _PeerState
    endpoint: str
    fan: _Fanout | None = None
    index: int = 0


@dataclass(frozen=True, slots=True)
class PeerEvent:
    """A change in a peer's life, as `Router.watch` callbacks see it.

    kind: "registered" (admitted; not yet serving unless it said ready), "ready" (serves its
    endpoints), "exited" (a BYE carried its process's exit `code`), "dead" (silent, marked
    dead, or left without an exit code; `reason` says which)."""

    kind: str
    info: PeerInfo
    code: int | None = None
    reason: str = ""


class Router:
    """Binds the bus, admits workers, calls their endpoints, watches their health, tells of their lives."""

    def __init__(self, *, run_id: str, secret: Secret, address: str = "tcp://127.0.0.1:0",
                 config: BusConfig | None = None,
                 on_unhealthy: Callable[[PeerInfo], Any] | None = None) -> None:
        self.run_id = run_id
        self.config = config or BusConfig()
        self._bind = address
        self.address = ""
        self.incarnation = secrets.token_bytes(INCARNATION_BYTES)
        self._counters = Counters()
        self._secret = secret
        self._gate: _zap.Guard | None = None
        self._sealer = Sealer(secret, self.incarnation)
        self._opener = Opener(secret, me=self.incarnation, counters=self._counters,
                              max_bytes=self.config.max_message_bytes, max_frames=self.config.max_frames)
        self._hello_bytes = min(self.config.max_hello_bytes, self.config.max_message_bytes)
        self._peers: dict[str, _PeerState] = {}
        self._by_incarnation: dict[bytes, _PeerState] = {}
        self._pending: dict[int, _Pending] = {}
        self._next_id = 0
        self._listeners: list[Callable[[PeerInfo], Any]] = [on_unhealthy] if on_unhealthy else []
        self._watchers: list[Callable[[PeerEvent], None]] = []
        self._changed = asyncio.Event()
        self.generation = 0
        """Bumped whenever a peer registers or is declared unhealthy (Service caches on it)."""
        self._channel: _channel.Channel | None = None
        self._monitor: asyncio.Task | None = None
        self._hook_tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop  # set by start(); read only by what start() set going
        self._closed_because: str | None = None
        """Why close() was called; None while the head is open."""

    def __repr__(self) -> str:
        return f"Router(run_id={self.run_id!r}, address={self.address!r}, peers={len(self._peers)})"

    # ---------------------------------------------------------------- life cycle

    async def start(self) -> str:
        """Bind and start serving; returns the real address (the port chosen by the OS)."""
        self._loop = asyncio.get_running_loop()
        sock, self.address, self._gate = _channel.bind_router(
            self._bind, secret=self._secret, max_frame_bytes=self.config.max_message_bytes,
            receive_queue=self.config.receive_queue)
        self._channel = _channel.Channel(sock, self._on_message, small_frames=2,  # routing id, header
                                         awaiting=self._pending.__len__)
        self._channel.start()
        self._monitor = asyncio.create_task(self._watch(), name="hpcrl-bus-router-monitor")
        log.debug("bus: head of run %s listening on %s", self.run_id, self.address)
        return self.address

    async def close(self, reason: str = "the head is shutting down") -> None:
        """Tell every healthy worker to leave, fail pending calls, close the socket."""
        if self._channel is None or self._channel.closed:
            return
        for st in self._peers.values():
            if st.healthy:
                self._send(st, Kind.BYE, {"reason": reason})
        if self._monitor is not None:
            self._monitor.cancel()
        for pending in list(self._pending.values()):
            if not pending.future.done():
                pending.future.set_exception(HeadClosedError(
                    f"the call of {pending.endpoint!r} on {pending.peer.name} was abandoned: {reason}"))
        self._channel.close(linger=1.0)  # the goodbyes still go out
        if self._gate is not None:
            self._gate.release()
        self._closed_because = reason

    async def __aenter__(self) -> Router:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---------------------------------------------------------------- what the head knows

    def counters(self) -> dict[str, int]:
        """Accepted messages, and dropped ones by reason (forged, replayed, too large, ...), and
        `handshake`: connections refused before they could deliver anything (no or a wrong token)."""
        snap = self._counters.snapshot()
        snap["handshake"] = self._gate.refused() if self._gate is not None else 0
        return snap

    def refused(self) -> dict[str, int]:
        """Messages refused so far, by reason (bad_mac, too_large, truncated, ...), and connections
        refused at the handshake (`handshake`); only reasons seen."""
        refused = self._counters.refused()
        if self._gate is not None and (handshakes := self._gate.refused()):
            refused["handshake"] = handshakes
        return refused

    def peers(self, group: str | None = None, *, healthy_only: bool = True) -> list[PeerInfo]:
        """Peers (of `group`); by default only those that serve: healthy and ready."""
        return [st.info for st in self._peers.values()
                if (group is None or st.info.group == group) and (st.healthy and st.ready or not healthy_only)]

    def peer(self, name: str) -> PeerInfo:
        return self._state(name).info

    def is_healthy(self, name: str) -> bool:
        st = self._peers.get(name)
        return st is not None and st.healthy

    def outstanding(self, name: str) -> int:
        st = self._peers.get(name)
        return st.outstanding if st else 0

    def is_idempotent(self, name: str, endpoint: str) -> bool:
        st = self._peers.get(name)
        return bool(st and st.endpoints.get(endpoint, False))

    def complete_replicas(self, group: str) -> list[int]:
        """Replicas of `group` whose every rank is registered, ready and healthy."""
        ranks: dict[int, list[_PeerState]] = {}
        for st in self._peers.values():
            if st.info.group == group and st.healthy and st.ready:
                ranks.setdefault(st.info.replica, []).append(st)
        return sorted(r for r, sts in ranks.items() if len(sts) == sts[0].info.replica_ranks)

    def mark_dead(self, name: str, reason: str) -> bool:
        """Declare a peer unhealthy now (e.g. its process was seen to end) instead of after
        heartbeat_timeout; its pending calls fail with PeerDeadError. False if unknown or already so."""
        st = self._peers.get(name)
        if st is None or not st.healthy:
            return False
        self._declare_dead(st, reason)
        return True

    def watch(self, on_event: Callable[[PeerEvent], None]) -> None:
        """Call `on_event(PeerEvent)` for every registration, READY, exit code and death, in order,
        from the loop (keep it quick: e.g. append to a list another task reads)."""
        self._watchers.append(on_event)

    def dismiss(self, name: str, code: int = 0, reason: str = "dismissed by the head") -> bool:
        """Tell a peer to leave and exit with `code` (a BYE carrying it). The peer stops taking
        calls at once, without hooks; its exit code comes later as an "exited" event. False if
        it is unknown or no longer healthy."""
        st = self._peers.get(name)
        if st is None or not st.healthy:
            return False
        self._send(st, Kind.BYE, {"reason": reason, "code": code})
        self._declare_dead(st, f"dismissed: {reason}", notify=False, farewell=False)
        return True

    async def wait_for_peers(self, group: str, replicas: int = 1, *, timeout: float) -> list[int]:
        """Wait until `replicas` replicas of `group` are complete; returns their indices."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(done := self.complete_replicas(group)) < replicas:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise BusError(f"group {group}: {len(done)} of {replicas} replicas registered within "
                               f"{timeout} s (complete: {done})")
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                pass
        return done

    # ---------------------------------------------------------------- calls

    async def request(self, peer: str, endpoint: str, args: Any = None, *, buffers: Iterable[Any] = (),
                      timeout: float | None = None) -> Any:
        """Call `endpoint` on `peer`; its return value (a Payload if it returned buffers).

        Raises UnknownPeerError, UnknownEndpointError, PeerDeadError (also when it dies during
        the call), DeadlineExceeded, RemoteError (the endpoint raised) — each naming the peer —
        and HeadClosedError once close() was called (also for calls still waiting then).
        Cancelling the caller abandons the call (a late reply is counted and dropped).
        """
        channel = self._check_open()
        st = self._state(peer)
        if not st.healthy:
            raise PeerDeadError(peer, st.dead_reason)
        if endpoint not in st.endpoints:
            raise UnknownEndpointError(peer, endpoint, list(st.endpoints), ready=st.ready)
        timeout = self.config.default_deadline if timeout is None else timeout
        if timeout <= 0:
            raise DeadlineExceeded(peer, endpoint, timeout)
        loop = self._loop
        self._next_id += 1
        rid = self._next_id
        future = loop.create_future()
        if not self._send(st, Kind.REQUEST, {"id": rid, "ep": endpoint, "a": args, "ttl": timeout}, buffers):
            raise PeerDeadError(peer, "unreachable (not connected, or its send queue is full)")
        self._pending[rid] = _Pending(future=future, peer=st, endpoint=endpoint)
        st.outstanding += 1
        channel.spin(self.config.reply_spin)
        timer = loop.call_later(timeout, self._expire, rid, timeout)
        try:
            return await future
        finally:  # answered, failed, expired or abandoned: forget it here (no done-callback)
            timer.cancel()
            if self._pending.pop(rid, None) is not None:
                st.outstanding -= 1

    def start_fanout(self, peers: list[str], endpoint: str, args: Any = None, *, buffers: Iterable[Any] = (),
                     timeout: float | None = None) -> asyncio.Future:
        """Send one call to every peer now; a future of the results in `peers` order, or the first
        error (then the other calls are abandoned). One future and one timer for all: cheap enough
        for thousands of peers. Errors known before sending are raised here, naming the peer."""
        channel = self._check_open()
        states = [self._state(name) for name in peers]
        for st in states:
            if not st.healthy:
                raise PeerDeadError(st.name, st.dead_reason)
            if endpoint not in st.endpoints:
                raise UnknownEndpointError(st.name, endpoint, list(st.endpoints), ready=st.ready)
        timeout = self.config.default_deadline if timeout is None else timeout
        if timeout <= 0 and states:
            raise DeadlineExceeded(states[0].name, endpoint, timeout)
        loop = self._loop
        fan = _Fanout(future=loop.create_future(), results=[None] * len(states), left=len(states), open=set())
        if not states:
            fan.future.set_result([])
            return fan.future
        buffers = tuple(buffers)
        first_rid = self._next_id + 1
        self._next_id += len(states)
        seal = self._sealer.seal
        messages = [[st.route, *seal(Kind.REQUEST, {"id": first_rid + index, "ep": endpoint, "a": args, "ttl": timeout},
                                     to=st.incarnation, buffers=buffers)]
                    for index, st in enumerate(states)]
        sent = channel.send_many(messages)
        pending = self._pending
        for index, (st, ok) in enumerate(zip(states, sent)):
            if not ok:
                self._counters.count("send_failed")
                if not fan.future.done():
                    fan.future.set_exception(PeerDeadError(st.name, "unreachable (not connected, or its send queue is full)"))
                continue
            rid = first_rid + index
            pending[rid] = _Pending(future=fan.future, peer=st, endpoint=endpoint, fan=fan, index=index)
            st.outstanding += 1
            fan.open.add(rid)
        fan.timer = loop.call_later(timeout, self._expire_fanout, fan, timeout)
        channel.spin(self.config.reply_spin)
        fan.future.add_done_callback(lambda _f: self._forget_fanout(fan))
        return fan.future

    def _forget_fanout(self, fan: _Fanout) -> None:
        if fan.timer is not None:  # always set before this done-callback is added
            fan.timer.cancel()
        for rid in fan.open:
            self._pending.pop(rid).peer.outstanding -= 1
        fan.open.clear()

    def _expire_fanout(self, fan: _Fanout, timeout: float) -> None:
        if not fan.future.done():
            first = self._pending[min(fan.open)]
            fan.future.set_exception(DeadlineExceeded(first.peer.name, first.endpoint, timeout))

    def _expire(self, rid: int, timeout: float) -> None:
        pending = self._pending.get(rid)
        if pending is not None and not pending.future.done():
            pending.future.set_exception(DeadlineExceeded(pending.peer.name, pending.endpoint, timeout))

    def _check_open(self) -> _channel.Channel:
        """The head's channel, to call through; HeadClosedError once closed, BusError before start()."""
        if self._closed_because is not None:
            raise HeadClosedError(f"the head's bus is closed ({self._closed_because}): no more calls")
        if self._channel is None:
            raise BusError("the head's bus is not started: call start() (or use `async with`) first")
        return self._channel

    def _state(self, name: str) -> _PeerState:
        st = self._peers.get(name)
        if st is None:
            raise UnknownPeerError(name, "has not registered with the head")
        return st

    def _send(self, st: _PeerState, kind: Kind, body: Any = None, buffers: Iterable[Any] = ()) -> bool:
        frames = self._sealer.seal(kind, body, to=st.incarnation, buffers=buffers)
        ok = self._channel is not None and self._channel.send([st.route, *frames])
        if not ok:
            self._counters.count("send_failed")
        return ok

    # ---------------------------------------------------------------- incoming

    def _on_message(self, frames: list) -> None:
        identity = frames[0]  # bytes (see Channel)
        # Only a registered peer's own connection may send large messages; anyone else (a REGISTER,
        # a supervisor's BYE, or junk from whoever reaches the port) is refused above a few KiB
        # before the MAC is computed: a flood of large junk costs no hashing.
        known = identity[:1] == b"w" and identity[1:] in self._by_incarnation
        env = self._opener.open(frames[1:], None if known else self._hello_bytes)
        if env is None:
            return
        if env.kind == Kind.REGISTER:
            return self._on_register(identity, env)
        st = self._by_incarnation.get(env.sender)
        if st is None:
            return self._counters.drop("drop_unknown_peer", f"{env.kind.name} before REGISTER")
        if env.kind == Kind.BYE:  # from the peer, or from its supervisor on a connection of its own
            return self._on_bye(st, env)
        if identity != st.route:
            return self._counters.drop("drop_identity", f"{st.name} on a foreign connection")
        if not st.healthy:
            self._counters.drop("drop_stale_peer", f"{st.name} was declared dead")
            self._send(st, Kind.BYE, {"reason": f"declared dead: {st.dead_reason}"})
            return
        st.last_seen = self._loop.time()
        if env.kind == Kind.HEARTBEAT:
            self._counters.accept()
        elif env.kind == Kind.REPLY:
            self._on_reply(st, env)
        elif env.kind == Kind.READY:
            self._on_ready(st, env)
        else:
            self._counters.drop("malformed", f"{env.kind.name} is not sent to the head")

    def _on_register(self, identity: bytes, env: Envelope) -> None:
        body = env.body
        try:
            if not isinstance(body, dict) or set(body) != {"peer", "endpoints", "t", "ready"}:
                raise ValueError("registration body has the wrong fields")
            info = PeerInfo.from_wire(body["peer"])
            endpoints = _endpoint_table(body["endpoints"])
            if not isinstance(body["t"], (int, float)):
                raise ValueError("registration time is not a number")
            if not isinstance(body["ready"], bool):
                raise ValueError("registration ready flag is not a boolean")
        except ValueError as exc:
            return self._counters.drop("malformed", str(exc))
        if identity != routing_id(env.sender):
            return self._counters.drop("drop_identity", f"{info.name} registered on a foreign connection")
        if info.run_id != self.run_id:
            return self._counters.drop("drop_wrong_run", f"{info.name} belongs to run {info.run_id!r}")
        if abs(time.time() - body["t"]) > self.config.register_window:
            return self._counters.drop("drop_stale_register", f"{info.name}: stamped {body['t']}")
        known = self._by_incarnation.get(env.sender)
        if known is not None:
            if not known.healthy:
                self._counters.drop("drop_stale_peer", f"{known.name} was declared dead")
                self._send(known, Kind.BYE, {"reason": f"declared dead: {known.dead_reason}"})
                return
            self._counters.accept()  # a repeated registration: its WELCOME was slow or lost
            known.last_seen = self._loop.time()
            self._welcome(known)
            return
        previous = self._peers.get(info.name)
        if previous is not None and previous.healthy:
            # No hooks: the replacement is already here, the launcher must not start another.
            self._declare_dead(previous, "replaced by a new registration of the same peer", notify=False)
        st = _PeerState(info=info, incarnation=env.sender, endpoints=endpoints, ready=body["ready"],
                        last_seen=self._loop.time())
        self._peers[info.name] = st
        self._by_incarnation[env.sender] = st
        self._counters.accept()
        self._welcome(st)
        log.debug("bus: %s registered (host %s, pid %d, gpu %r)%s", info.name, info.host, info.pid,
                  info.gpu, " again" if previous is not None else "")
        self._tell(PeerEvent("registered", info))
        if st.ready:
            self._tell(PeerEvent("ready", info))
        self._bump()

    def _on_ready(self, st: _PeerState, env: Envelope) -> None:
        body = env.body
        try:
            if not (isinstance(body, dict) and set(body) == {"endpoints"}):
                raise ValueError("READY body has the wrong fields")
            endpoints = _endpoint_table(body["endpoints"])
        except ValueError as exc:
            return self._counters.drop("malformed", f"{st.name}: {exc}")
        self._counters.accept()
        if st.ready:  # said twice (harmless): keep the first table
            return
        st.endpoints, st.ready = endpoints, True
        log.info("bus: %s is ready (%d endpoints)", st.name, len(endpoints))
        self._tell(PeerEvent("ready", st.info))
        self._bump()

    def _on_bye(self, st: _PeerState, env: Envelope) -> None:
        """A peer leaves: BYE {"reason": str, "code": int (optional), "by": "task" | "supervisor"}."""
        body = env.body
        reason, code = (body.get("reason"), body.get("code")) if isinstance(body, dict) else (None, None)
        if not isinstance(reason, str) or not (code is None or type(code) is int):
            return self._counters.drop("malformed", f"BYE from {st.name} without a reason or with a bad code")
        if code is None and not st.healthy or code is not None and st.exit_code is not None:
            return self._counters.drop("drop_stale_peer", f"{st.name} said BYE again ({reason})")
        self._counters.accept()
        if st.healthy:
            self._declare_dead(st, f"left: {reason}" if code is None else f"exited with code {code}: {reason}",
                               farewell=False, event=code is None)
        if code is not None:
            st.exit_code = code
            self._tell(PeerEvent("exited", st.info, code=code, reason=reason))

    def _tell(self, event: PeerEvent) -> None:
        for watcher in self._watchers:
            watcher(event)

    def _bump(self) -> None:
        """The peer table changed: wake wait_for_peers, and invalidate callers' caches."""
        self.generation += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def _welcome(self, st: _PeerState) -> None:
        self._send(st, Kind.WELCOME, {"hb": self.config.heartbeat_interval,
                                      "hbt": self.config.heartbeat_timeout})

    def _on_reply(self, st: _PeerState, env: Envelope) -> None:
        body = env.body
        if not (isinstance(body, dict) and isinstance(body.get("id"), int) and isinstance(body.get("ok"), bool)):
            return self._counters.drop("malformed", f"reply from {st.name} without id/ok")
        self._counters.accept()
        pending = self._pending.get(body["id"])
        if pending is None or pending.peer is not st or pending.future.done():
            self._counters.count("late_reply")
            return
        if not body["ok"]:
            err = body.get("e")
            etype, emsg = (err if isinstance(err, list) and len(err) == 2 else ("?", repr(err)))
            pending.future.set_exception(RemoteError(st.name, pending.endpoint, str(etype), str(emsg)))
            return
        value = body.get("r")
        if body.get("pl"):
            value = Payload(value=value, buffers=env.buffers)
        fan = pending.fan
        if fan is None:
            pending.future.set_result(value)
            return
        fan.results[pending.index] = value
        del self._pending[body["id"]]
        fan.open.discard(body["id"])
        st.outstanding -= 1
        fan.left -= 1
        if fan.left == 0:
            fan.future.set_result(fan.results)

    # ---------------------------------------------------------------- health

    async def _watch(self) -> None:
        interval, timeout = self.config.heartbeat_interval, self.config.heartbeat_timeout
        while True:
            await asyncio.sleep(interval)
            now = self._loop.time()
            for st in list(self._peers.values()):
                if not st.healthy:
                    continue
                if now - st.last_seen > timeout:
                    self._declare_dead(st, f"silent for {now - st.last_seen:.2f} s (heartbeat_timeout {timeout} s)")
                else:
                    self._send(st, Kind.HEARTBEAT)

    def _declare_dead(self, st: _PeerState, reason: str, *, notify: bool = True, farewell: bool = True,
                      event: bool = True) -> None:
        st.healthy = False
        st.dead_reason = reason
        if notify:
            log.warning("bus: peer %s (host %s, pid %d) is unhealthy: %s", st.name, st.info.host, st.info.pid, reason)
        for pending in self._pending.values():
            if not pending.future.done() and pending.peer is st:
                pending.future.set_exception(PeerDeadError(st.name, reason))
        if farewell:
            self._send(st, Kind.BYE, {"reason": f"declared dead: {reason}"})
        if event and notify:
            self._tell(PeerEvent("dead", st.info, reason=reason))
        for listener in self._listeners if notify else ():
            # call_soon: a failing hook is reported by the loop and cannot stop the monitor.
            self._loop.call_soon(self._run_hook, listener, st.info)
        self._bump()

    def _run_hook(self, hook: Callable[[PeerInfo], Any], info: PeerInfo) -> None:
        result = hook(info)
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(result)
            self._hook_tasks.add(task)
            task.add_done_callback(self._hook_done)

    def _hook_done(self, task: asyncio.Task) -> None:
        self._hook_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._loop.call_exception_handler({"message": "bus: an on_unhealthy hook failed",
                                               "exception": task.exception(), "task": task})


def _endpoint_table(endpoints: Any) -> dict[str, bool]:
    """A peer's endpoint names -> idempotent flags, as sent; ValueError when malformed."""
    if not (isinstance(endpoints, dict) and all(isinstance(k, str) and isinstance(v, bool)
                                               for k, v in endpoints.items())):
        raise ValueError("endpoints must map names to idempotent flags")
    return dict(endpoints)
