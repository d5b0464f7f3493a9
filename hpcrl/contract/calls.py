"""Both ends of a typed call: the head's `GroupClient` and a role's `serve_endpoints`.

    trainer = GroupClient(router, TRAINER)
    metrics = await trainer.call_all(0, TRAINER_ENDPOINTS.train_step, TrainStepCall(batch=b, step=3), timeout=600)
    serve_endpoints(worker, TRAINER, {TRAINER_ENDPOINTS.train_step: role.train_step, ...})

The caller encodes a typed request and decodes each reply, raising BadReply with the peer that sent
it when a reply is malformed. The serving task decodes each request before its handler sees it: a
malformed one is answered with BadRequest naming the endpoint and the field (hpcrl.bus.worker
sends an endpoint's error back as the reply), and the task serves on. An endpoint a worker does not
serve is refused by the head before it is sent (UnknownEndpointError) and by the worker if it comes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from hpcrl.bus.router import Router
from hpcrl.bus.service import Service
from hpcrl.bus.worker import Call, Worker
from hpcrl.contract.endpoints import ENDPOINTS, Endpoint, UnknownEndpoint

Req = TypeVar("Req")
Rep = TypeVar("Rep")

Handler = Callable[[Any], Awaitable[Any]]
"""async fn(typed request) -> typed reply."""


class GroupClient:
    """The head's typed calls to one group, over its Service (route, fanout, call_all) or one named peer."""

    def __init__(self, head: Router, group: str) -> None:
        if group not in ENDPOINTS:
            raise UnknownEndpoint(f"group {group!r} serves no endpoints on the bus (groups that do: "
                                  f"{', '.join(ENDPOINTS)})")
        self.head = head
        self.group = group
        self.service = Service(head, group)

    def _args(self, endpoint: Endpoint[Req, Rep], request: Req) -> dict:
        if endpoint.group != self.group:
            raise UnknownEndpoint(f"{endpoint} is not an endpoint of group {self.group} (its endpoints: "
                                  f"{', '.join(ENDPOINTS[self.group])})")
        return endpoint.encode_request(request)

    async def route(self, endpoint: Endpoint[Req, Rep], request: Req, *, timeout: float) -> Rep:
        """One healthy replica, the least busy; retried on another if `endpoint` is idempotent."""
        return await self.service.route(endpoint.name, self._args(endpoint, request), timeout=timeout,
                                        decode=_decoder(endpoint))

    async def fanout(self, endpoint: Endpoint[Req, Rep], request: Req, *, timeout: float) -> list[Rep]:
        """Every healthy replica; replies in replica order."""
        return await self.service.fanout(endpoint.name, self._args(endpoint, request), timeout=timeout,
                                         decode=_decoder(endpoint))

    async def call_all(self, replica: int, endpoint: Endpoint[Req, Rep], request: Req, *,
                       timeout: float) -> list[Rep]:
        """Every rank of one replica; replies in rank order."""
        return await self.service.call_all(replica, endpoint.name, self._args(endpoint, request), timeout=timeout,
                                           decode=_decoder(endpoint))

    async def request(self, peer: str, endpoint: Endpoint[Req, Rep], request: Req, *, timeout: float) -> Rep:
        """The peer named `peer` (group/replica/rank) alone."""
        reply = await self.head.request(peer, endpoint.name, self._args(endpoint, request), timeout=timeout)
        return endpoint.decode_reply(reply, peer=peer)


def _decoder(endpoint: Endpoint[Req, Rep]) -> Callable[[str, Any], Rep]:
    """A Service decode hook: `endpoint`'s reply from `peer`, BadReply naming the peer if malformed."""
    return lambda peer, reply: endpoint.decode_reply(reply, peer=peer)


def serving(endpoint: Endpoint, handler: Handler) -> Callable[[Call], Awaitable[Any]]:
    """The worker's endpoint function of `handler`: the request decoded (BadRequest), the reply encoded."""
    async def serve(call: Call) -> Any:
        return endpoint.encode_reply(await handler(endpoint.decode_request(call.args)))
    return serve


def serve_endpoints(worker: Worker, group: str, handlers: Mapping[Endpoint, Handler]) -> None:
    """Add a role's handlers to its worker, each under its endpoint's name and idempotence."""
    for endpoint, handler in handlers.items():
        if endpoint.group != group:
            raise UnknownEndpoint(f"a task of group {group} cannot serve {endpoint}: its endpoints are "
                                  f"{', '.join(ENDPOINTS.get(group, {})) or 'none'}")
        worker.add_endpoint(endpoint.name, serving(endpoint, handler), idempotent=endpoint.idempotent)
