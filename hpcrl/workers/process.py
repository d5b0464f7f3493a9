"""A spawned worker process that answers JSON calls over a pipe: what the reward and environment pools share.

    worker = Worker(_worker_main, spec, what="reward", error=RewardError)   # spawned: nothing of ours leaks in
    worker.wait_ready(60)              # its "ready", or the `error` it failed to start with (killed)
    worker.send([{...}, {...}])        # one message of calls; the first call's deadline counts from now
    reply = worker.receive()           # one JSON reply per call, in order; None once its process died
    worker.kill()

    def _worker_main(spec: str, conn: Connection) -> None:      # the process's entry, at module level
        serve(conn, lambda: make_handler(spec), RewardError)      # start up, say ready, answer until EOF

Calls and replies are JSON (no pickle on the pipe). A worker that fails its start (the pool's
functions or environment cannot be imported, or their `check_at_start` fails: `check_at_start`
here) sends {"fatal": reason} and exits, and `wait_ready` raises that reason as the pool's error.
What a pool does with its workers (sharing calls out, deadlines per call, replacing one that hung
or died) stays with the pool; `start_workers` starts a pool's first ones, all ready or none.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any

from hpcrl.errors import HpcrlError

#: The worker processes' multiprocessing context: spawned, so no thread, socket or CUDA state of the parent.
SPAWN = mp.get_context("spawn")
#: The longest single wait on a pipe: poll(2) takes its timeout in milliseconds as a C int (~24.8 days), so a
#: longer one (reward.timeout_s = 1e9) raises OverflowError. Pools wait in slices and keep their own deadlines.
MAX_WAIT_S = 3600.0


def raised(err: BaseException) -> str:
    """An exception as one line for an error reply: its type, message and where it was raised (file:line),
    as text the bus can carry (`sendable`)."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return sendable(f"{type(err).__name__}: {err}{where}")


def sendable(text: str) -> str:
    """`text` with any lone surrogate ("\\udc80", from bytes decoded with errors="surrogateescape") written as
    its escape: msgpack sends UTF-8 only, so a user's reason or error must not hold one."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def import_module(module_name: str, what: str, error: type[HpcrlError]) -> ModuleType:
    """Import the module of a user's `module:name` (`what` names it in errors): a module that is missing, or
    that raises as it is imported, is `error` with the cause, never a worker that dies at start."""
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        raise error(f"{what}: cannot import {module_name!r}: {err}. Fix: check the module name, or put its "
                    "directory on PYTHONPATH") from err
    except (Exception, SystemExit) as err:  # noqa: BLE001 - the module's own failure, reported as the reason
        raise error(f"{what}: importing {module_name!r} raised {raised(err)}. Fix: the module must import "
                    f"without error (try python -c 'import {module_name}')") from err


def check_at_start(what: str, subject: Any, error: type[HpcrlError]) -> None:
    """Call `subject.check_at_start()` where it has one (code_tests, python_tool: can a sandbox be built
    here?), so that what cannot work here fails the pool's start, not every call; `what` names it."""
    check = getattr(subject, "check_at_start", None)
    if check is None:
        return
    try:
        check()
    except Exception as err:  # noqa: BLE001 - reported as the reason the pool cannot start
        raise error(f"{what} cannot run here: {type(err).__name__}: {err}") from None


def serve(conn: Connection, start: Callable[[], Callable[[Any], dict]], error: type[HpcrlError]) -> None:
    """A worker's loop: `start()` gives the handler of one call (or raises `error`, sent as the reason
    the worker cannot start); then each message, a JSON list of calls, is answered call by call, one
    JSON reply each as it is served, until the pipe closes."""
    try:
        handle = start()
    except error as err:
        conn.send_bytes(json.dumps({"fatal": str(err)}).encode())
        return
    conn.send_bytes(b'{"ready": true}')
    while True:
        try:
            calls = json.loads(conn.recv_bytes())
        except EOFError:
            return
        for call in calls:
            conn.send_bytes(json.dumps(handle(call)).encode())


class Worker:
    """One spawned process running `target(spec, conn)` (a function that calls `serve`); see the module
    docstring. `what` names it in errors ("reward", "environment"), `error` is the pool's error type."""

    def __init__(self, target: Callable[[str, Connection], None], spec: str, *, what: str,
                 error: type[HpcrlError]) -> None:
        self.what, self.error = what, error
        self.conn, child = SPAWN.Pipe()
        self.process = SPAWN.Process(target=target, args=(spec, child), daemon=True, name=f"hpcrl-{what}-worker")
        self.process.start()
        child.close()
        self.started = 0.0
        """When the worker began its current call (that call's deadline counts from here)."""

    def wait_ready(self, timeout: float) -> None:
        """Wait for the worker's "ready"; raise `error` (the worker killed) when it fails or takes longer."""
        if not self.conn.poll(timeout):
            self.kill()
            raise self.error(f"{self.what} worker did not start within {timeout:.0f} s")
        try:
            hello = json.loads(self.conn.recv_bytes())
        except EOFError:
            self.process.join(5)
            raise self.error(f"{self.what} worker exited at start (exit code {self.process.exitcode})") from None
        if "fatal" in hello:
            self.kill()
            raise self.error(hello["fatal"])

    def send(self, calls: list) -> None:
        """Send `calls` in one message to the idle worker; its first call starts now."""
        self.started = time.monotonic()
        self.conn.send_bytes(json.dumps(calls).encode())

    def receive(self) -> dict | None:
        """The next reply, or None when the worker's process is gone (joined: `process.exitcode` says how)."""
        try:
            return json.loads(self.conn.recv_bytes())
        except EOFError:
            self.process.join(5)
            return None

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


def start_workers(count: int, make: Callable[[], Worker], timeout: float) -> list[Any]:
    """`count` workers from `make`, all ready: started together, then waited for; if one cannot start,
    every one is killed and its error raised."""
    workers: list[Worker] = []
    try:
        for _ in range(count):
            workers.append(make())
        for worker in workers:
            worker.wait_ready(timeout)
    except BaseException:
        for worker in workers:
            worker.kill()
        raise
    return workers
