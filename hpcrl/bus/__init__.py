"""The control bus: ZeroMQ ROUTER at the head, a DEALER in every group process.

    wire.py     message format, HMAC, replay/size/version checks (pure, no sockets)
    secret.py   the per-run secret file (0600)
    channel.py  the one ZeroMQ adapter: sockets on the asyncio loop
    router.py   Router (the head's end): registration, calls with deadlines, heartbeats, health,
                hooks, peer events (registered / ready / exited / dead), dismissal with an exit code
    worker.py   Worker (a task's end): endpoints, registration, READY, heartbeats, exit when the
                head is gone or says so
    farewell.py a task's exit code, sent by its supervisor process after the task ended
    service.py  Service: route / fanout / call_all over a group's replicas, with retries
    peer.py     PeerInfo (run, group, replica, rank, task, host, pid, GPU)
    config.py   BusConfig
    errors.py   typed errors naming the peer

In short (the head, then a worker process; see router.py, worker.py and service.py):

    router = Router(run_id="r1", secret=load_secret(run_dir), on_unhealthy=relaunch)
    address = await router.start()                                 # hand it to the workers
    worker = Worker(info=PeerInfo(run_id="r1", group="inference", replica=0), secret=..., address=address)
    worker.add_endpoint("generate", generate, idempotent=True); await worker.serve()
    await router.wait_for_peers("inference", 1, timeout=600)
    out = await Service(router, "inference").route("generate", {"prompt": [1, 2, 3]}, timeout=30)

Names are re-exported lazily so that importing hpcrl.bus does not import zmq.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Router": "hpcrl.bus.router", "PeerEvent": "hpcrl.bus.router", "Service": "hpcrl.bus.service", "Worker": "hpcrl.bus.worker", "WorkerExit": "hpcrl.bus.worker",
    "Call": "hpcrl.bus.worker", "PeerInfo": "hpcrl.bus.peer", "BusConfig": "hpcrl.bus.config",
    "Payload": "hpcrl.bus.wire", "Secret": "hpcrl.bus.secret", "create_secret": "hpcrl.bus.secret",
    "load_secret": "hpcrl.bus.secret",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hpcrl.bus' has no attribute {name!r}")
