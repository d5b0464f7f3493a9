"""Benchmark the code sandbox (hpcrl.workers.sandbox): BENCHMARKS.md "Code sandbox".

    PYTHONPATH=. .venv/bin/python tools/bench/bench_sandbox.py [--calls 10] [--steps 10] [--rounds 2] [--beside 1]

1. cost: the median milliseconds of one run_tests call (a right `add` against two asserts) and of one
   run_code call (`print(sum(range(10**6)))`, python_tool's benchmark call), `--calls` of each in turn.
2. health: the embedded default's train step (TrainerEngine as tools/bench/bench_train_step.py builds it,
   one torch thread) alone, then beside `--beside` threads (reward workers) that each start hostile
   sandboxes back to back under code_tests' limits (in turn: a fork bomb, four children of 300 MiB each,
   busy loops in as many processes as allowed), in alternating phases of `--steps` steps, `--rounds`
   times; the median step of each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools" / "bench"))

from hpcrl.reward.builtin import CODE_TESTS_LIMITS  # noqa: E402
from hpcrl.workers.sandbox import Limits, run_code, run_tests  # noqa: E402

HOSTILE = {
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "memory": "import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        block = b'1' * (300 << 20)\n"
              "        time.sleep(30)\ntime.sleep(30)",
    "busy": "import os\nfor _ in range(5):\n    try:\n        os.fork()\n    except OSError:\n        pass\nwhile True:\n"
            "    pass",
}


def cost(calls: int) -> None:
    tests, code, failed = [], [], []
    for _ in range(calls):
        started = time.perf_counter()
        outcome = run_tests("def add(a, b):\n    return a + b", "assert add(1, 2) == 3\nassert add(-1, 1) == 0")
        tests.append(time.perf_counter() - started)
        started = time.perf_counter()
        outcome_alone, _ = run_code("print(sum(range(10**6)))", Limits(cpu_s=3, wall_s=4, processes=16))
        code.append(time.perf_counter() - started)
        failed += [o.reason for o in (outcome, outcome_alone) if not o.passed]
    print(f"one run_tests call: {statistics.median(tests) * 1000:.0f} ms; one run_code call: "
          f"{statistics.median(code) * 1000:.0f} ms (medians of {calls}; slowest {max(tests + code) * 1000:.0f} ms); "
          f"not passed: {failed or 'none'}")


def hostile_loop(first: int, stop: threading.Event, counts: dict[str, int]) -> None:
    """Hostile sandboxes back to back, each kind in turn from the `first`, until `stop`."""
    names = list(HOSTILE)
    turn = first
    while not stop.is_set():
        name = names[turn % len(names)]
        outcome = run_tests(HOSTILE[name], "pass", CODE_TESTS_LIMITS)
        counts[name] = counts.get(name, 0) + 1
        assert not outcome.passed, (name, outcome)
        turn += 1


def health(steps: int, rounds: int, beside: int) -> None:
    from bench_train_step import make_batch

    from hpcrl.config import load_config
    from hpcrl.trainer import TrainerEngine

    torch.set_num_threads(1)
    engine = TrainerEngine.from_config(load_config(REPO / "configs" / "tiny_grpo.toml"))
    batch = make_batch(128)
    for _ in range(3):  # warm-up
        engine.train_step(batch)
    times: dict[str, list[float]] = {"alone": [], f"beside {beside} hostile sandboxes at a time": []}
    counts: dict[str, int] = {}
    for _ in range(rounds):
        for kind in times:
            stop = threading.Event()
            threads = [threading.Thread(target=hostile_loop, args=(i, stop, counts)) for i in range(beside)]
            if kind != "alone":
                for thread in threads:
                    thread.start()
                time.sleep(1)
            for _ in range(steps):
                started = time.perf_counter()
                engine.train_step(batch)
                times[kind].append(time.perf_counter() - started)
            stop.set()
            for thread in threads:
                if thread.is_alive():
                    thread.join()
    alone = statistics.median(times["alone"])
    for kind, values in times.items():
        print(f"train step {kind}: median {statistics.median(values) * 1000:.0f} ms "
              f"({statistics.median(values) / alone:.2f}x), {len(values)} steps")
    print(f"hostile sandboxes run: {counts}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--beside", type=int, default=1, help="hostile sandboxes at a time (reward workers)")
    args = parser.parse_args()
    cost(args.calls)
    health(args.steps, args.rounds, args.beside)
    return 0


if __name__ == "__main__":
    sys.exit(main())
