"""A Service: the head's calls to one group, spread over that group's replicas.

    svc = Service(head, "inference")
    out = await svc.route("generate", args, timeout=30)        # one healthy replica, least busy
    outs = await svc.fanout("load_weights", {"version": 7})    # every healthy replica, in order
    per_rank = await svc.call_all(0, "report")                 # every rank of replica 0

Each takes `decode(peer, reply)`, applied to every reply with the name of the peer that sent it (the
typed contract of hpcrl.contract checks replies so, naming the peer). route() and fanout() talk to
rank 0 of each replica. An idempotent endpoint (as the worker
declared it) whose replica dies during the call is retried on another healthy replica within
the call's original deadline; a non-idempotent one raises PeerDeadError.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterable
from typing import Any

from hpcrl.bus.errors import DeadlineExceeded, NoHealthyReplicaError, PeerDeadError
from hpcrl.bus.router import Router

Decode = Callable[[str, Any], Any]
"""(peer name, reply) -> what the caller gets of the reply."""


class Service:
    """The replicas of one group, as the head sees them."""

    def __init__(self, head: Router, group: str) -> None:
        self.head = head
        self.group = group
        self._turn = itertools.count()
        self._leaders_at = -1
        self._leaders_cache: list[str] = []

    def __repr__(self) -> str:
        return f"Service({self.group!r}, healthy replicas={self.replicas()})"

    def replicas(self) -> list[int]:
        """Indices of the replicas whose rank 0 is healthy."""
        return sorted(p.replica for p in self.head.peers(self.group) if p.rank == 0)

    # ---------------------------------------------------------------- adverbs

    async def route(self, endpoint: str, args: Any = None, *, buffers: Iterable[Any] = (),
                    timeout: float | None = None, decode: Decode | None = None) -> Any:
        """Call `endpoint` on one healthy replica, the one with the fewest outstanding calls."""
        return await self._call_retrying(endpoint, args, tuple(buffers), timeout, decode)

    async def fanout(self, endpoint: str, args: Any = None, *, buffers: Iterable[Any] = (),
                     timeout: float | None = None, decode: Decode | None = None) -> list[Any]:
        """Call `endpoint` on every healthy replica; results in replica order, or the first error."""
        leaders = self._leaders()
        if not leaders:
            raise NoHealthyReplicaError(self.group, "fanout found none registered and healthy")
        return await self._gather(leaders, endpoint, args, tuple(buffers), timeout, decode)

    async def call_all(self, replica: int, endpoint: str, args: Any = None, *, buffers: Iterable[Any] = (),
                       timeout: float | None = None, decode: Decode | None = None) -> list[Any]:
        """Call `endpoint` on every rank of one replica; results in rank order, or the first error."""
        ranks = sorted((p for p in self.head.peers(self.group, healthy_only=False) if p.replica == replica),
                       key=lambda p: p.rank)
        if not ranks:
            raise NoHealthyReplicaError(self.group, f"replica {replica} has not registered")
        missing = sorted(set(range(ranks[0].replica_ranks)) - {p.rank for p in ranks})
        if missing:
            raise NoHealthyReplicaError(self.group, f"replica {replica} lacks ranks {missing}")
        for p in ranks:  # a dead rank fails the whole call, naming it
            if not self.head.is_healthy(p.name):
                raise PeerDeadError(p.name, "is unhealthy; call_all needs every rank of the replica")
        return await self._gather([p.name for p in ranks], endpoint, args, tuple(buffers), timeout, decode)

    # ---------------------------------------------------------------- inside

    def _leaders(self) -> list[str]:
        """Names of the healthy rank-0 peers, by replica; recomputed only when the peer table changed."""
        if self._leaders_at != self.head.generation:
            self._leaders_cache = [p.name for p in sorted(self.head.peers(self.group), key=lambda p: p.replica)
                                   if p.rank == 0]
            self._leaders_at = self.head.generation
        return self._leaders_cache

    def _pick(self, exclude: set[str]) -> str:
        leaders = [n for n in self._leaders() if n not in exclude] if exclude else self._leaders()
        if not leaders:
            detail = f"tried {sorted(exclude)}" if exclude else "none registered and healthy"
            raise NoHealthyReplicaError(self.group, detail)
        if len(leaders) == 1:
            return leaders[0]
        turn = next(self._turn) % len(leaders)  # rotate ties so equal loads spread out
        rotated = leaders[turn:] + leaders[:turn]
        return min(rotated, key=self.head.outstanding)

    async def _call_retrying(self, endpoint: str, args: Any, buffers: tuple, timeout: float | None,
                             decode: Decode | None) -> Any:
        loop = asyncio.get_running_loop()
        timeout = self.head.config.default_deadline if timeout is None else timeout
        deadline = loop.time() + timeout
        tried: set[str] = set()
        last_death: PeerDeadError | None = None
        while True:
            try:
                name = self._pick(tried)
            except NoHealthyReplicaError as none_left:
                raise none_left from last_death
            try:
                reply = await self.head.request(name, endpoint, args, buffers=buffers,
                                                timeout=deadline - loop.time())
                return reply if decode is None else decode(name, reply)
            except PeerDeadError as dead:
                if not self.head.is_idempotent(name, endpoint):
                    raise
                last_death = dead
                tried.add(name)
                if loop.time() >= deadline:
                    raise DeadlineExceeded(name, endpoint, timeout) from dead

    async def _gather(self, peers: list[str], endpoint: str, args: Any, buffers: tuple,
                      timeout: float | None, decode: Decode | None) -> list[Any]:
        replies = await self.head.start_fanout(peers, endpoint, args, buffers=buffers, timeout=timeout)
        return replies if decode is None else [decode(peer, reply) for peer, reply in zip(peers, replies, strict=True)]
