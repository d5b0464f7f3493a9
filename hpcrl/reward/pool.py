"""Score completions with a reward function in a pool of worker processes, each sample bounded in time.

    pool = RewardPool("hpcrl.reward.builtin:exact_match", workers=4, timeout_s=5.0)
    results = pool.score([Sample(id="p3/0", prompt_id="p3", prompt="1+2=", completion="3", answer="3")])
    pool.close()

    RewardPool([WeightedFunction(name="math_verify", function="hpcrl.reward.builtin:math_verify", weight=1.0),
                WeightedFunction(name="format_ok", function="hpcrl.reward.builtin:format_ok", weight=0.2)], ...)

With several weighted functions each sample's reward is the weighted sum of their scores, and its
`parts` hold each score; if any of them fails, or their weighted sum is not finite, the sample has no
reward (an error naming that function, or the sum). A function may return a number (a float, an int
within a float's range, a numpy scalar) or (number, reason); the reason travels with the result. A
function with a parameter named `extra` (or **kwargs) is also given `extra=` the row's data.columns.extra
values, a dict by column name (Sample.extra): `def solved(prompt, completion, answer, extra)`. A function
with a `check_at_start` attribute has it called once in each worker as it starts: if it raises, the
pool does not start (code_tests checks that a sandbox can be built on this node).

A verifier that raises, hangs past `timeout_s`, returns something that is not a finite number, or
kills its process yields a `RewardResult` with `error` set and `reward` None — never a silent zero —
and the pool replaces the worker and goes on. Samples travel to workers as JSON over pipes (no
pickle); workers are spawned (hpcrl.workers.process), so nothing of the parent (threads, sockets, CUDA) leaks into them.
A module that raises as it is imported stops the pool at start with its exception (hpcrl.workers.process.import_module).
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, wait
from typing import cast

from hpcrl.reward.types import RewardError, RewardResult, Sample, WeightedFunction
from hpcrl.workers.process import (
    MAX_WAIT_S,
    Worker,
    check_at_start,
    import_module,
    raised,
    sendable,
    serve,
    start_workers,
)


def resolve(function: str) -> Callable[..., float]:
    """Import "module:function"; a RewardError names what is missing, or why its module does not import."""
    module_name, _, name = function.partition(":")
    module = import_module(module_name, f"reward function {function!r}", RewardError)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"reward function {function!r}: {module_name} has no function {name!r}")
    return fn


def takes_extra(fn: Callable) -> bool:
    """Whether `fn` takes the row's data.columns.extra: a parameter named `extra`, or **kwargs."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): it takes the three strings
        return False
    return any(p.name == "extra" and p.kind != p.VAR_POSITIONAL or p.kind == p.VAR_KEYWORD for p in parameters)


def _worker_main(spec: str, conn: Connection) -> None:
    """Worker process: scores samples (hpcrl.workers.process.serve), one {"reward"} or {"error"} per
    sample. `spec`: JSON {"functions": [[name, function, weight]...], "combined": bool} (the pool's
    functions; combined = several weighted, with parts)."""
    serve(conn, lambda: _scorer(json.loads(spec)), RewardError)


def _scorer(config: dict) -> Callable[[dict], dict]:
    """The pool's functions, imported and checked at start; a sample's reply from all of them."""
    functions = []
    for name, function, weight in config["functions"]:
        fn = resolve(function)
        check_at_start(f"reward function {function!r}", fn, RewardError)
        functions.append(_Function(name=name, fn=fn, weight=weight, extra=takes_extra(fn)))
    return lambda request: _score_all(functions, request, combined=config["combined"])


@dataclass(frozen=True)
class _Function:
    """One of the pool's functions in a worker: its metric name, the function, its weight, whether it takes extra."""

    name: str
    fn: Callable[..., float]
    weight: float
    extra: bool


def _score_all(functions: list[_Function], request: dict, *, combined: bool) -> dict:
    """One sample through every function: the weighted sum and the parts, or the first error, named after
    its function. A sum that is not finite (parts of 1e308) is an error like a part that is not: the sample
    has no score."""
    parts: dict[str, float] = {}
    reasons: list[str] = []
    for f in functions:
        scored = _score_one(f, request)
        if "error" in scored:
            return {"error": f"{f.name}: {scored['error']}"}
        parts[f.name] = cast(float, scored["reward"])
        if "reason" in scored:
            reasons.append(f"{f.name}: {scored['reason']}" if combined else cast(str, scored["reason"]))
    total = sum(f.weight * parts[f.name] for f in functions)
    if not math.isfinite(total):
        terms = " + ".join(f"{f.weight:g} x {f.name}" for f in functions)
        return {"error": f"the weighted sum {terms} is {total}, not a finite number (parts {parts})"}
    reply: dict = {"reward": total}
    if reasons:
        reply["reason"] = "; ".join(reasons)
    if combined:
        reply["parts"] = parts
    return reply


def _score_one(f: _Function, request: dict) -> dict[str, str | float]:
    """One function on one sample: {"reward"} (and its "reason"), or {"error"} saying why there is none. A
    number of any type that converts to a finite float is a score (numpy's float32 and int64 too)."""
    prompt, completion, answer = request["prompt"], request["completion"], request["answer"]
    try:
        value = f.fn(prompt, completion, answer, extra=request["extra"]) if f.extra else f.fn(prompt, completion, answer)
    except Exception as err:  # noqa: BLE001 - the verifier's own failure is the result, reported with the sample
        return {"error": raised(err)}
    reason = None
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], str):
        value, reason = value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy registers its numbers as Real
        return {"error": f"returned {_short(value)}, not a finite number (or a (number, reason) pair)"}
    try:
        score = float(value)
    except OverflowError:  # an int past a float's range: 10**400
        return {"error": f"returned an integer of {_digits(value)} digits, too large for a float"}
    if not math.isfinite(score):
        return {"error": f"returned {score}, not a finite number (or a (number, reason) pair)"}
    return {"reward": score, "reason": sendable(reason)} if reason else {"reward": score}


def _digits(value: object) -> str:
    try:
        return str(len(str(abs(cast(int, value)))))
    except ValueError:  # past int_max_str_digits (4300)
        return "more than 4300"


def _short(value: object, limit: int = 80) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a value whose repr fails (a huge int past int_max_str_digits) is named by type
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else text[:limit] + "..."


class _Worker(Worker):
    """A reward worker (hpcrl.workers.process.Worker) with the samples it was sent."""

    def __init__(self, spec: str) -> None:
        super().__init__(_worker_main, spec, what="reward", error=RewardError)
        self.queue: deque[Sample] = deque()
        """Samples sent and not answered yet, in the order the worker scores them."""

    def send_samples(self, samples: list[Sample]) -> None:
        """Queue `samples` on the worker (an idle one: its first one starts now), in one message."""
        self.queue.extend(samples)
        self.send([asdict(s) for s in samples])


class RewardPool:
    """`workers` processes running `functions` (one "module:function", or several weighted); see the
    module docstring."""

    def __init__(self, functions: str | list[WeightedFunction], *, workers: int, timeout_s: float,
                 start_timeout_s: float = 60.0) -> None:
        combined = not isinstance(functions, str)
        listed = functions if not isinstance(functions, str) else [
            WeightedFunction(name=functions.partition(":")[2], function=functions)]
        if len({f.name for f in listed}) != len(listed):
            raise RewardError(f"reward functions {[f.name for f in listed]} repeat a name; give each its own")
        self._spec = json.dumps({"functions": [[f.name, f.function, f.weight] for f in listed],
                                 "combined": combined})
        self.timeout_s = timeout_s
        self._start_timeout_s = start_timeout_s
        self._workers: list[_Worker] = start_workers(workers, lambda: _Worker(self._spec), start_timeout_s)

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker(self._spec)
        fresh.wait_ready(self._start_timeout_s)
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    def score(self, samples: list[Sample]) -> list[RewardResult]:
        """Score every sample; results in the order of `samples` (whose ids must be distinct).

        Each idle worker gets an even share of what is left in one message and answers sample by
        sample, so a batch costs a round trip per worker, not per sample; each sample's deadline
        counts from the previous answer. A sample that times out or takes its worker down is
        recorded as an error; the worker is replaced and the rest of its share is handed out again."""
        if len({s.id for s in samples}) != len(samples):
            raise RewardError("samples to score have repeated ids; give every completion its own id")
        pending = deque(samples)
        results: dict[str, RewardResult] = {}
        idle = list(self._workers)
        busy: dict[Connection, _Worker] = {}

        def finish(worker: _Worker, reply: dict, now: float) -> None:
            sample = worker.queue.popleft()
            results[sample.id] = RewardResult(id=sample.id, prompt_id=sample.prompt_id, reward=reply.get("reward"),
                                              error=reply.get("error"), reason=reply.get("reason"),
                                              parts=reply.get("parts"), seconds=now - worker.started)
            worker.started = now

        def lost(worker: _Worker, error: str, now: float) -> None:
            """The worker's current sample failed with its process: the rest of its share goes back."""
            del busy[worker.conn]
            finish(worker, {"error": error}, now)
            pending.extendleft(reversed(worker.queue))
            idle.append(self._replace(worker))

        while pending or busy:
            while pending and idle:
                share = -(-len(pending) // len(idle))  # ceil: every idle worker gets some
                worker = idle.pop()
                worker.send_samples([pending.popleft() for _ in range(share)])
                busy[worker.conn] = worker
            next_deadline = min(w.started + self.timeout_s for w in busy.values())
            for ready in wait(list(busy), timeout=min(MAX_WAIT_S, max(0.0, next_deadline - time.monotonic()))):
                worker = busy[cast(Connection, ready)]  # wait() returns some of the connections it was given
                reply = worker.receive()
                if reply is None:  # the verifier took its process down with it
                    lost(worker, f"worker process died (exit code {worker.process.exitcode})", time.monotonic())
                    continue
                finish(worker, reply, time.monotonic())
                if not worker.queue:
                    del busy[worker.conn]
                    idle.append(worker)
            now = time.monotonic()
            for worker in list(busy.values()):
                if now - worker.started >= self.timeout_s:
                    lost(worker, f"timed out after {self.timeout_s:g} s", now)
        return [results[s.id] for s in samples]

    def close(self) -> None:
        for worker in self._workers:
            worker.kill()
        self._workers = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
