"""Time the environment pool's calls (hpcrl.env.pool) with 1, 2 and 4 workers: BENCHMARKS.md "Environment pool".

    PYTHONPATH=. .venv/bin/python tools/bench/bench_env_pool.py

feedback: a reset and a step of 128 episodes (a wrong first guess: the reply is the feedback), the
median of 7 calls; python_tool: 8 episodes whose one turn calls the python tool once (a sandbox each),
the median of 3 calls. Each call is one pool.reset / pool.step, as one env_reset / env_step of the head.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hpcrl.config.schema import EnvConfig  # noqa: E402
from hpcrl.data.builtin import guess  # noqa: E402
from hpcrl.env.pool import EnvPool  # noqa: E402
from hpcrl.env.types import EnvRequest  # noqa: E402


def bench(environment: str, rows: list[dict], turn: str, workers: int, repeats: int) -> tuple[float, float]:
    """Median milliseconds of a reset and of a step of every row's episode."""
    with EnvPool(EnvConfig(environment=environment, workers=workers, step_timeout_s=30)) as pool:
        resets, steps = [], []
        for r in range(repeats):
            requests = [EnvRequest(episode=f"{row['id']}/{r}", row=row) for row in rows]
            started = time.perf_counter()
            first = pool.reset(requests)
            resets.append(time.perf_counter() - started)
            steps_in = [EnvRequest(episode=q.episode, row=q.row,
                                   messages=[*f.messages, {"role": "assistant", "content": turn}])
                        for q, f in zip(requests, first)]
            started = time.perf_counter()
            out = pool.step(steps_in)
            steps.append(time.perf_counter() - started)
            if any(o.error for o in out):
                raise SystemExit(f"an environment call failed: {next(o.error for o in out if o.error)}")
    return statistics.median(resets) * 1e3, statistics.median(steps) * 1e3


def main() -> None:
    rows = [guess("train", i) for i in range(128)]
    for workers in (1, 2, 4):
        reset_ms, step_ms = bench("feedback", rows, "x", workers, 7)
        print(f"feedback, 128 episodes, {workers} workers: reset {reset_ms:.1f} ms, step {step_ms:.1f} ms")
    problems = [{"id": f"m{i}", "prompt": "What is 2**20?", "answer": "1048576"} for i in range(8)]
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(sum(range(10**6)))"}}\n</tool_call>'
    for workers in (1, 2, 4):
        _, step_ms = bench("python_tool", problems, call, workers, 3)
        print(f"python_tool, 8 episodes, one tool call each, {workers} workers: step {step_ms:.0f} ms")


if __name__ == "__main__":
    main()
