"""Score completions with a reward function in a pool of worker processes, each sample bounded in time.

    pool = RewardPool("hpcrl.reward.builtin:exact_match", workers=4, timeout_s=5.0)
    results = pool.score([Sample(id="p3/0", prompt_id="p3", prompt="1+2=", completion="3", answer="3")])
    pool.close()

A verifier that raises, hangs past `timeout_s`, returns something that is not a finite number, or
kills its process yields a `RewardResult` with `error` set and `reward` None — never a silent zero —
and the pool replaces the worker and goes on. Samples travel to workers as JSON over pipes (no
pickle); workers are spawned, so nothing of the parent (threads, sockets, CUDA) leaks into them.
"""

from __future__ import annotations

import importlib
import json
import math
import multiprocessing as mp
import os
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from multiprocessing.connection import Connection, wait
from typing import cast

from hpcrl.reward.types import RewardError, RewardResult, Sample


def resolve(function: str) -> Callable[[str, str, str], float]:
    """Import "module:function"; a RewardError names what is missing."""
    module_name, _, name = function.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise RewardError(f"reward function {function!r}: cannot import {module_name!r}: {err}") from err
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"reward function {function!r}: {module_name} has no function {name!r}")
    return fn


def _worker_main(function: str, conn: Connection) -> None:
    """Worker loop: JSON sample in, JSON {"reward"} or {"error"} out, until the pipe closes."""
    try:
        fn = resolve(function)
    except RewardError as err:
        conn.send_bytes(json.dumps({"fatal": str(err)}).encode())
        return
    conn.send_bytes(b'{"ready": true}')
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except EOFError:
            return
        reply: dict[str, str | float]
        try:
            value = fn(request["prompt"], request["completion"], request["answer"])
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                reply = {"error": f"returned {value!r}, not a finite number"}
            else:
                reply = {"reward": float(value)}
        except Exception as err:  # noqa: BLE001 - the verifier's own failure is the result, reported with the sample
            frame = traceback.extract_tb(err.__traceback__)[-1]
            reply = {"error": f"{type(err).__name__}: {err} ({os.path.basename(frame.filename)}:{frame.lineno})"}
        conn.send_bytes(json.dumps(reply).encode())


class _Worker:
    def __init__(self, ctx: mp.context.SpawnContext, function: str) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(function, child), daemon=True,
                                   name="hpcrl-reward-worker")
        self.process.start()
        child.close()
        self.sample: Sample | None = None
        self.started = 0.0

    def wait_ready(self, timeout: float) -> None:
        if not self.conn.poll(timeout):
            self.kill()
            raise RewardError(f"reward worker did not start within {timeout:.0f} s")
        try:
            hello = json.loads(self.conn.recv_bytes())
        except EOFError:
            raise RewardError(f"reward worker exited at start (exit code {self.process.exitcode})") from None
        if "fatal" in hello:
            self.kill()
            raise RewardError(hello["fatal"])

    def send(self, sample: Sample) -> None:
        self.sample, self.started = sample, time.monotonic()
        self.conn.send_bytes(json.dumps(asdict(sample)).encode())

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


class RewardPool:
    """`workers` processes running `function`; see the module docstring."""

    def __init__(self, function: str, *, workers: int, timeout_s: float, start_timeout_s: float = 60.0) -> None:
        self.function = function
        self.timeout_s = timeout_s
        self._ctx = mp.get_context("spawn")
        self._start_timeout_s = start_timeout_s
        self._workers = [_Worker(self._ctx, function) for _ in range(workers)]
        for worker in self._workers:
            worker.wait_ready(start_timeout_s)

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker(self._ctx, self.function)
        fresh.wait_ready(self._start_timeout_s)
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    def score(self, samples: list[Sample]) -> list[RewardResult]:
        """Score every sample; results in the order of `samples` (whose ids must be distinct)."""
        if len({s.id for s in samples}) != len(samples):
            raise RewardError("samples to score have repeated ids; give every completion its own id")
        pending = deque(samples)
        results: dict[str, RewardResult] = {}
        idle = list(self._workers)
        busy: dict[Connection, _Worker] = {}
        while pending or busy:
            while pending and idle:
                worker = idle.pop()
                worker.send(pending.popleft())
                busy[worker.conn] = worker
            now = time.monotonic()
            next_deadline = min(w.started + self.timeout_s for w in busy.values())
            for ready in wait(list(busy), timeout=max(0.0, next_deadline - now)):
                conn = cast(Connection, ready)  # wait() returns some of the connections it was given
                worker = busy.pop(conn)
                sample, spent = worker.sample, time.monotonic() - worker.started
                assert sample is not None
                try:
                    reply = json.loads(conn.recv_bytes())
                except EOFError:  # the verifier took its process down with it
                    worker.process.join(5)
                    reply = {"error": f"worker process died (exit code {worker.process.exitcode})"}
                    worker = self._replace(worker)
                results[sample.id] = RewardResult(id=sample.id, prompt_id=sample.prompt_id,
                                                  reward=reply.get("reward"), error=reply.get("error"),
                                                  seconds=spent)
                idle.append(worker)
            now = time.monotonic()
            for conn, worker in list(busy.items()):
                if now - worker.started >= self.timeout_s:
                    sample = worker.sample
                    assert sample is not None
                    del busy[conn]
                    results[sample.id] = RewardResult(
                        id=sample.id, prompt_id=sample.prompt_id, reward=None,
                        error=f"timed out after {self.timeout_s:g} s", seconds=now - worker.started)
                    idle.append(self._replace(worker))
        return [results[s.id] for s in samples]

    def close(self) -> None:
        for worker in self._workers:
            worker.kill()
        self._workers = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
