"""Helpers of the bus tests: a fast bus config, running a test coroutine with a deadline,
in-process echo workers served on the test's loop, and real worker processes (worker_proc.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKER_PROC = Path(__file__).with_name("worker_proc.py")
RUN_ID = "test-run"


def seal_raw(key: bytes, header: bytes, *, version: int | None = None) -> list[bytes]:
    """A one-frame message around an already packed `header`, MAC'd with `key` as Sealer.seal does
    (to forge authentic-but-malformed headers, or other protocol versions)."""
    from hpcrl.bus.wire import PROTOCOL_VERSION, _Mac
    v = bytes([PROTOCOL_VERSION if version is None else version])
    return [header + v + _Mac(key, v).digest((header,), 1)]


def fast_config(**overrides):
    from hpcrl.bus import BusConfig
    return BusConfig(**{"heartbeat_interval": 0.1, "heartbeat_timeout": 1.0, "register_timeout": 10,
                        **overrides})


async def until(check, what: str, timeout: float = 10.0) -> None:
    """Wait on this loop until `check()` holds, failing with `what` after `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"{what} (not within {timeout} s)"
        await asyncio.sleep(0.005)


def run(coro, timeout: float = 20.0):
    """Run one test coroutine on a fresh loop, with a hard deadline."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@contextlib.asynccontextmanager
async def serving(*workers):
    """Serve in-process workers on this loop; stop them (and wait) on the way out."""
    tasks = [asyncio.create_task(w.serve()) for w in workers]
    try:
        yield tasks
    finally:
        for w, t in zip(workers, tasks):
            if not t.done():
                w.stop("test over")
        await asyncio.wait(tasks, timeout=5)


def echo_worker(secret, address: str, *, group: str = "inf", replica: int = 0, rank: int = 0,
                ranks: int = 1, config=None, delay: float = 0.0):
    """An in-process worker with echo (idempotent), slow (idempotent) and fail endpoints."""
    from hpcrl.bus import PeerInfo, Worker
    info = PeerInfo(run_id=RUN_ID, group=group, replica=replica, rank=rank, replica_ranks=ranks,
                    host="localhost", pid=os.getpid())
    worker = Worker(info=info, secret=secret, address=address, config=config or fast_config())

    @worker.endpoint(idempotent=True)
    async def echo(call):
        return {"peer": info.name, "args": call.args}

    @worker.endpoint(idempotent=True)
    async def slow(call):
        await asyncio.sleep(call.args["s"])
        return {"peer": info.name, "args": call.args}

    @worker.endpoint()
    async def fail(call):
        raise ValueError(f"boom from {info.name}")

    return worker


def spawn_worker(address: str, run_dir: Path, *, replica: int, group: str = "inf",
                 heartbeat: float = 0.1, timeout: float = 0.5) -> subprocess.Popen:
    """A real worker process (tests/bus/worker_proc.py) for this checkout's hpcrl."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, str(WORKER_PROC), address, str(run_dir), "--run-id", RUN_ID,
                             "--group", group, "--replica", str(replica), "--heartbeat", str(heartbeat),
                             "--timeout", str(timeout)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class LoopThread:
    """An event loop on its own thread, for a live head or worker beside synchronous test code."""

    def __init__(self) -> None:
        import threading
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="bus-test-loop", daemon=True)
        self._thread.start()

    def call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.loop.is_running()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()
