"""What every role shares: one engine thread, on the role's device, and its handlers of the bus's endpoints.

A role serves the endpoints hpcrl.contract.endpoints declares for its group: `handlers()` maps each
Endpoint to an async function of its typed request that returns its typed reply; the task's worker
decodes requests and encodes replies around it (hpcrl.contract.calls.serve_endpoints).

CUDA's current device belongs to a thread, not to the process: `torch.cuda.set_device` in the
thread that builds a role says nothing about the thread that later runs the engine's calls (whose
device is 0), and FSDP2 creates its streams lazily on the current device of the calling thread.
So the engine thread sets its device itself, as the first thing it runs, and checks it took.
Every GPU task sees exactly its own GPUs (CUDA_VISIBLE_DEVICES), so a trainer rank's device is 0.

The device calls go through a `DeviceTable` (torch.cuda by default), which a test replaces with a
fake one to drive this without CUDA.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from hpcrl.errors import HpcrlError

if TYPE_CHECKING:  # the contract imports the bus (zmq): `hpcrl run`'s engine thread needs neither
    from hpcrl.contract.calls import Handler
    from hpcrl.contract.endpoints import Endpoint

T = TypeVar("T")

log = logging.getLogger(__name__)


class DeviceTable(Protocol):
    """The CUDA device calls an engine thread makes (`torch.cuda`'s, per calling thread)."""

    def device_count(self) -> int: ...

    def set_device(self, index: int) -> None: ...

    def current_device(self) -> int: ...


class TorchCuda:
    """`DeviceTable` of torch.cuda (imported when first called)."""

    def device_count(self) -> int:
        import torch
        return torch.cuda.device_count()

    def set_device(self, index: int) -> None:
        import torch
        torch.cuda.set_device(index)

    def current_device(self) -> int:
        import torch
        return torch.cuda.current_device()


def _take_device(index: int, devices: DeviceTable, name: str) -> int:
    """Make `index` this thread's current device and say which it now is (run on the engine thread)."""
    count = devices.device_count()
    if not 0 <= index < count:
        raise HpcrlError(f"{name}: asked to run on CUDA device {index}, but this task sees {count} device(s) "
                         "(CUDA_VISIBLE_DEVICES); the task's GPUs are set by the head's launch")
    devices.set_device(index)
    current = devices.current_device()
    if current != index:
        raise HpcrlError(f"{name}: set CUDA device {index} in the engine thread, but its current device is "
                         f"{current}")
    return current


class EngineThread:
    """One worker thread that runs an engine's calls one at a time, in arrival order (collectives
    line up across ranks), on `device` when one is given; the event loop stays free for heartbeats."""

    def __init__(self, name: str, *, device: int | None = None, devices: DeviceTable | None = None) -> None:
        self.name = name
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.device: int | None = None
        """The CUDA device the engine thread reported as current after taking it; None = no device."""
        if device is not None:
            try:
                self.device = self.call(_take_device, device, devices or TorchCuda(), name)
            except BaseException:
                self.close()
                raise
            log.info(f"{name}: engine thread on CUDA device {self.device}")

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the engine thread and wait for it (from any thread but the engine's)."""
        return self._pool.submit(fn, *args).result()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the engine thread without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class Role:
    group = ""

    def __init__(self, *, device: int | None = None, devices: DeviceTable | None = None) -> None:
        self.engine_thread = EngineThread(f"hpcrl-{self.group}", device=device, devices=devices)

    async def on_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self.engine_thread.run(fn, *args)

    def handlers(self) -> dict[Endpoint, Handler]:
        """Endpoint of this role's group -> async fn(typed request) -> typed reply."""
        raise NotImplementedError

    def close(self) -> None:
        self.engine_thread.close()
