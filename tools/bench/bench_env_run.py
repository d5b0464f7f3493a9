"""A multi-turn run's figures with 1, 2 and 4 environment workers: BENCHMARKS.md "Multi-turn episodes".

    PYTHONPATH=. .venv/bin/python tools/bench/bench_env_run.py [--steps 40] [--delay-ms 0 20]

Runs `hpcrl run configs/tiny_env_grpo.toml` (the toy "feedback" task: a guess, feedback, a second guess)
for `--steps` steps with env.workers = 1, 2, 4, once per delay: 0 is the built-in environment as it is
(microseconds a step), and a delay > 0 runs the same environment with that much sleep in every reset and
step (`SlowFeedback` below, named as "bench_env_run:SlowFeedback"), standing in for a tool that takes time.
Prints, per run, the means over its steps of: a turn's generate call (time_turn_s), the wall time with an
environment call outstanding (time_env_s), the share of the batch's rollout time spent waiting on
environments with no turn generating (env_wait_share), the rollout time (time_generate_s) and the step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from hpcrl.env.builtin import Feedback  # noqa: E402


class SlowFeedback(Feedback):
    """The toy task with HPCRL_BENCH_ENV_DELAY_MS of sleep in every reset and step (a slow tool)."""

    def _pause(self) -> None:
        time.sleep(float(os.environ.get("HPCRL_BENCH_ENV_DELAY_MS", "0")) / 1000)

    def reset(self, row):
        self._pause()
        return super().reset(row)

    def step(self, messages):
        self._pause()
        return super().step(messages)


def run(steps: int, workers: int, delay_ms: float, scratch: Path) -> dict[str, float]:
    run_dir = scratch / f"w{workers}-d{delay_ms:g}"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tools' / 'bench'}", "HPCRL_BENCH_ENV_DELAY_MS": str(delay_ms)}
    args = [sys.executable, "-m", "hpcrl", "run", "configs/tiny_env_grpo.toml", "--set", f"run.run_dir={run_dir}",
            "--set", f"trainer.steps={steps}", "--set", f"env.workers={workers}", "--set", "eval.interval=0"]
    if delay_ms:
        args += ["--set", "env.environment=bench_env_run:SlowFeedback"]
    started = time.monotonic()
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"hpcrl run failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = rows[1:]  # the first step carries the start-up's figures

    def mean(key: str) -> float:
        values = [r[key] for r in rows if r.get(key) is not None]
        return sum(values) / len(values)

    return {"workers": workers, "delay_ms": delay_ms, "turn_s": mean("time_turn_s"), "env_s": mean("time_env_s"),
            "wait_share": mean("env_wait_share"), "rollout_s": mean("time_generate_s"), "step_s": mean("time_step_s"),
            "turns": mean("turns_mean"), "wall_s": time.monotonic() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--delay-ms", type=float, nargs="+", default=[0.0, 20.0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    print("| env delay | workers | turn (generate) | env time / step | env wait share | rollout / step | step | turns |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as scratch:
        for delay in args.delay_ms:
            for workers in args.workers:
                r = run(args.steps, workers, delay, Path(scratch))
                print(f"| {delay:g} ms | {workers} | {r['turn_s'] * 1000:.0f} ms | {r['env_s'] * 1000:.0f} ms | "
                      f"{r['wait_share']:.1%} | {r['rollout_s'] * 1000:.0f} ms | {r['step_s'] * 1000:.0f} ms | "
                      f"{r['turns']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
