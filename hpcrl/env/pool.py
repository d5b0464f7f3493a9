"""Run an environment's episodes in a pool of worker processes, each call bounded in time.

    with EnvPool(config.env) as pool:                      # env.workers processes of env.environment
        first = pool.reset([EnvRequest(episode="p3/0", row=row)])                     # [EnvReply]
        after = pool.step([EnvRequest(episode="p3/0", row=row, messages=conversation)])
        futures = pool.submit("step", requests)            # the same without waiting (the reward role's endpoints)

Each worker is a spawned process (nothing of the parent's threads, sockets or CUDA leaks into it)
that imports the environment class and keeps one instance per live episode. An episode's calls go
to the worker that a stable hash of its id picks, so its instance is usually there; a worker that
does not hold it (it was replaced, the episode was evicted, another reward task served the last
call) builds it again with `reset(row)` before stepping, which gives the same reply because an
environment's state follows from its row and the conversation (hpcrl/env/base.py). An episode's
instance is dropped when a reply says done or is an error, and a worker holds at most
`held_per_worker` instances (the least recently used goes first: episodes the head cut at max_turns
or its token budget never say done).

Calls travel as JSON over pipes (no pickle; the workers are hpcrl.workers.process's). A call that raises, hangs past env.step_timeout_s,
kills its worker (os._exit, a segfault) or returns something the interface does not allow gives an
EnvReply with `error` naming the environment, the episode and why; the head holds that episode's
group out (never scored zero). A worker that hung or died is replaced (`restarts` counts them) and
the rest of its share goes to the new one. The pool does not start (EnvError) when the class cannot
be imported, is not a class with reset and step, or its `check_at_start()` fails.

One thread of the pool does all pipe I/O and keeps the deadlines; callers, from any thread, queue
requests and wait on futures, so concurrent calls share the workers instead of queueing whole.
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Literal, cast

from hpcrl.config.schema import EnvConfig
from hpcrl.env.base import RESET_ROLES, Malformed, checked_messages, checked_step, resolve
from hpcrl.env.types import EnvError, EnvReply, EnvRequest
from hpcrl.workers.process import MAX_WAIT_S, SPAWN, Worker, check_at_start, raised, serve, start_workers

Op = Literal["reset", "step"]

#: The largest reply an environment may give one call, as JSON: a batch of replies is one bus message.
MAX_REPLY_BYTES = 1 << 20


def _worker_main(spec: str, conn: Connection) -> None:
    """Worker process: serves calls (hpcrl.workers.process.serve) on the environment `spec` names
    (JSON {"environment", "held"}), each reply timed."""
    serve(conn, lambda: _handler(json.loads(spec)), EnvError)


def _handler(config: dict) -> Callable[[dict], dict]:
    """The environment's class, checked at start; each call served on its episode's instance."""
    environment = config["environment"]
    cls = resolve(environment)
    check_at_start(f"environment {environment!r}", cls, EnvError)
    held: OrderedDict[str, Any] = OrderedDict()

    def handle(call: dict) -> dict:
        started = time.monotonic()
        reply = _serve(cls, held, call, config["held"])
        reply["seconds"] = time.monotonic() - started
        return reply
    return handle


def _serve(cls: type, held: OrderedDict[str, Any], call: dict, most: int) -> dict:
    """One call on the episode's instance (built by reset when this worker does not hold it): the
    reply's fields, or {"error"} naming the method that failed and why."""
    episode, row = call["episode"], call["row"]
    instance = held.pop(episode, None)
    phase = "reset"
    try:
        if call["op"] == "reset" or instance is None:
            instance = cls()
            first = checked_messages(instance.reset(row), what="reset", roles=RESET_ROLES)
            if not first:
                raise Malformed("reset returned no messages: the policy needs a conversation to answer")
            if first[-1]["role"] == "assistant":  # the head's chat template could not open the policy's turn
                raise Malformed("reset ended with an assistant message, but the policy answers the first messages: "
                                "end them with a user or tool message (an assistant message may come before)")
            reply: dict = {"messages": first}
        if call["op"] == "step":
            phase = "step"
            result = checked_step(instance.step(call["messages"]))
            reply = {"messages": result.messages, "reward": result.reward, "done": result.done}
    except Malformed as err:
        return {"error": str(err)}
    except Exception as err:  # noqa: BLE001 - the environment's own failure is the reply, with the episode
        return {"error": f"{phase} raised {raised(err)}"}
    try:
        size = len(json.dumps(reply, allow_nan=False))  # what cannot cross the pipe is the environment's error, here
    except (TypeError, ValueError) as err:
        return {"error": f"{phase} returned messages that are not plain JSON data: {err}"}
    if size > MAX_REPLY_BYTES:
        return {"error": f"{phase} returned {size} bytes of messages; a reply may hold {MAX_REPLY_BYTES >> 20} MiB "
                         "(hpcrl.env.pool.MAX_REPLY_BYTES: the head sends every message back with each step)"}
    if not reply.get("done"):
        held[episode] = instance
        while len(held) > most:
            held.popitem(last=False)
    return reply


@dataclass
class _Job:
    op: Op
    request: EnvRequest
    future: Future = field(default_factory=Future)

    def wire(self) -> dict:
        return {"op": self.op, "episode": self.request.episode, "row": self.request.row,
                "messages": self.request.messages}


class _Worker(Worker):
    """An environment worker (hpcrl.workers.process.Worker) with the calls routed to it."""

    def __init__(self, spec: str) -> None:
        super().__init__(_worker_main, spec, what="environment", error=EnvError)
        self.backlog: deque[_Job] = deque()
        """Calls routed here and not sent yet: sent together once the worker has answered the last share."""
        self.sent: deque[_Job] = deque()
        """Calls sent and not answered yet, in the order the worker serves them."""

    def send_backlog(self) -> None:
        """Send what waits here, in one message, to the idle worker (its first call starts now)."""
        self.sent.extend(self.backlog)
        self.backlog.clear()
        self.send([job.wire() for job in self.sent])


class EnvPool:
    """`config.workers` processes serving `config.environment`'s episodes; see the module docstring."""

    def __init__(self, config: EnvConfig, *, start_timeout_s: float = 60.0, held_per_worker: int = 1024) -> None:
        if not config.environment:
            raise EnvError("env.environment is empty: there is no environment to run (set it to a built-in name "
                           "such as \"feedback\" or to \"module:Class\")")
        self.environment = config.environment
        self.timeout_s = config.step_timeout_s
        self.restarts = 0
        """Workers replaced after a call hung or took its process down."""
        self._spec = json.dumps({"environment": config.environment, "held": held_per_worker})
        self._start_timeout_s = start_timeout_s
        self._workers: list[_Worker | None] = start_workers(config.workers, lambda: _Worker(self._spec),
                                                            start_timeout_s)
        self._inbox: deque[_Job] = deque()
        self._lock = threading.Lock()
        self._closing = False
        self._broken: BaseException | None = None
        """What ended the pool's thread other than close() (a bug): every later call raises it."""
        self._start_error = ""
        """Why the last worker started in place of a lost one did not start."""
        self._woken = False
        """A wake-up is in the pipe and the inbox not yet taken: callers need not write another."""
        self._wake_r, self._wake_w = SPAWN.Pipe(duplex=False)
        self._thread = threading.Thread(target=self._run, name="hpcrl-env-pool", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- callers (any thread)

    def reset(self, requests: list[EnvRequest]) -> list[EnvReply]:
        """Each episode's first messages, in the order of `requests`."""
        return [future.result() for future in self.submit("reset", requests)]

    def step(self, requests: list[EnvRequest]) -> list[EnvReply]:
        """Each episode's answer to its conversation so far, in the order of `requests`."""
        return [future.result() for future in self.submit("step", requests)]

    def submit(self, op: Op, requests: list[EnvRequest]) -> list[Future]:
        """Queue the calls; one future per request, in order, each resolving to its EnvReply (an error is a
        reply, never an exception, unless the pool is closed)."""
        episodes = [r.episode for r in requests]
        if len(set(episodes)) != len(episodes):
            raise EnvError(f"env {op} was given an episode more than once ({episodes}); give each call its own episode")
        for request in requests:
            if (op == "reset") != (not request.messages):
                raise EnvError(f"env {op} of episode {request.episode}: a reset carries no messages and a step the "
                               f"conversation so far (got {len(request.messages)} messages)")
        jobs = [_Job(op, request) for request in requests]
        with self._lock:
            if self._closing or self._broken:
                raise EnvError("the environment pool is closed" if self._closing else
                               f"the environment pool's thread failed: {self._broken!r}")
            self._inbox.extend(jobs)
            wake, self._woken = not self._woken, True
        if wake:
            self._wake_w.send_bytes(b"")
        return [job.future for job in jobs]

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._wake_w.send_bytes(b"")
        self._thread.join()
        self._fail_all(EnvError("the environment pool was closed during the call"))
        for worker in self._workers:
            if worker is not None:
                worker.kill()
        self._workers = []
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- the pool's thread

    def _fail_all(self, error: BaseException) -> None:
        """Every call not answered yet raises `error` in its caller."""
        with self._lock:
            jobs, self._inbox = list(self._inbox), deque()
        for worker in self._workers:
            if worker is not None:
                jobs += [*worker.sent, *worker.backlog]
                worker.sent.clear()
                worker.backlog.clear()
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(error)

    def _run(self) -> None:
        try:
            self._serve_calls()
        except BaseException as err:  # noqa: BLE001 - a bug here must not leave callers waiting for ever
            with self._lock:
                self._broken = err
            self._fail_all(EnvError(f"the environment pool's thread failed: {err!r}"))
            raise

    def _serve_calls(self) -> None:
        """Route queued calls, send each idle worker its share, read replies, cut calls past their deadline."""
        while True:
            with self._lock:
                if self._closing:
                    return
                jobs, self._inbox = self._inbox, deque()
                self._woken = False
            for job in jobs:
                if not job.future.set_running_or_notify_cancel():  # its caller gave up on it (a cancelled bus call)
                    continue
                index = zlib.crc32(job.request.episode.encode()) % len(self._workers)
                if self._workers[index] is None:  # the last replacement failed: try again
                    self._workers[index] = self._start_replacement(None)
                worker = self._workers[index]
                if worker is None:
                    self._answer(job, {"error": f"no worker could be started in place of a lost one: "
                                                f"{self._start_error}"})
                else:
                    worker.backlog.append(job)
            for index, worker in enumerate(self._workers):
                if worker is not None and worker.backlog and not worker.sent:
                    try:
                        worker.send_backlog()
                    except OSError as err:  # its process is gone: the next read says how
                        self._lost(index, f"worker process could not be written to ({err})")
            busy = [w for w in self._workers if w is not None and w.sent]
            deadline = min((w.started + self.timeout_s for w in busy), default=None)
            timeout = None if deadline is None else min(MAX_WAIT_S, max(0.0, deadline - time.monotonic()))
            for ready in wait([self._wake_r, *(w.conn for w in busy)], timeout=timeout):
                if ready is self._wake_r:
                    while self._wake_r.poll():
                        self._wake_r.recv_bytes()
                    continue
                index = next(i for i, w in enumerate(self._workers) if w is not None and w.conn is ready)
                self._read(index)
            now = time.monotonic()
            for index, worker in enumerate(self._workers):
                # a reply that came while others were handled is read first, never cut
                if worker is not None and worker.sent and now - worker.started >= self.timeout_s \
                        and not worker.conn.poll(0):
                    self._lost(index, f"timed out after {self.timeout_s:g} s (env.step_timeout_s)")

    def _read(self, index: int) -> None:
        worker = cast(_Worker, self._workers[index])
        reply = worker.receive()
        if reply is None:  # the environment took its process down with it
            self._lost(index, f"its worker process died (exit code {worker.process.exitcode})")
            return
        job = worker.sent.popleft()
        self._answer(job, reply)
        worker.started = time.monotonic()

    def _answer(self, job: _Job, reply: dict) -> None:
        episode = job.request.episode
        error = reply.get("error")
        job.future.set_result(EnvReply(
            episode=episode, messages=None if error else reply["messages"], reward=None if error else reply.get("reward"),
            done=bool(reply.get("done")) and not error, seconds=float(reply.get("seconds", 0.0)),
            error=f"environment {self.environment!r}, episode {episode}: {error}" if error else None))

    def _lost(self, index: int, why: str) -> None:
        """The worker's current call failed with its process: answer it with `why`, replace the worker and
        hand the rest of its share to the new one."""
        worker = cast(_Worker, self._workers[index])
        job = worker.sent.popleft()
        self._answer(job, {"error": why, "seconds": time.monotonic() - worker.started})
        rest = [*worker.sent, *worker.backlog]
        fresh = self._start_replacement(worker)
        self._workers[index] = fresh
        for job in rest:
            if fresh is not None:
                fresh.backlog.append(job)
            else:
                self._answer(job, {"error": f"its worker was lost and none could be started in its place: "
                                            f"{self._start_error}"})

    def _start_replacement(self, lost: _Worker | None) -> _Worker | None:
        """A ready worker in place of `lost` (killed), or None (why: `_start_error`) when none starts."""
        self.restarts += 1
        if lost is not None:
            lost.kill()
        fresh = _Worker(self._spec)
        try:
            fresh.wait_ready(self._start_timeout_s)
        except EnvError as err:
            fresh.kill()
            self._start_error = str(err)
            return None
        return fresh
