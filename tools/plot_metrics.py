"""Draw a run's reward curve and time split from its metrics.jsonl to a PNG.

    python tools/plot_metrics.py runs/tiny-grpo                 # writes runs/tiny-grpo/metrics.png
    python tools/plot_metrics.py runs/tiny-grpo --out curve.png

Top: mean reward per step (and its moving average). Bottom: seconds per step spent generating,
scoring, training, syncing weights and idle, stacked. Steps far slower than the rest (the first
step's warm-up: ~17 s against ~0.1 s steps in the tiny run; the first step after a requeue) are
clipped: the axis is scaled to the other steps and each clipped step is marked with its total.
Needs matplotlib (the `plot` extra).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hpcrl.rl.metrics import read_metrics  # noqa: E402

TIME_KEYS = ("time_generate_s", "time_reward_s", "time_train_s", "time_weight_sync_s", "time_idle_s")
SLOW_FACTOR = 5.0
"""A step whose total time exceeds this many times the median step's is clipped from the time axis."""
MAX_LABELS = 3
"""Clipped steps labelled with their time; beyond that, one line says how many more were clipped."""


def moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def slow_steps(totals: list[float]) -> list[int]:
    """Indices of the steps to clip: over SLOW_FACTOR x the median total (none with < 3 steps)."""
    if len(totals) < 3:
        return []
    median = sorted(totals)[len(totals) // 2]
    return [i for i, t in enumerate(totals) if t > SLOW_FACTOR * median]


def draw(run_dir: Path):
    """The figure of run_dir's metrics (a matplotlib Figure: top Axes reward, bottom Axes time)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(run_dir) if r.get("reward_mean") is not None]
    if not rows:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no steps with reward_mean yet")
    steps = [r["step"] for r in rows]
    rewards = [r["reward_mean"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    top.plot(steps, rewards, color="0.7", lw=1, label="reward mean")
    top.plot(steps, moving_average(rewards, 10), color="C0", lw=2, label="moving average (10 steps)")
    top.set_ylabel("reward")
    top.set_ylim(-0.02, 1.02)
    top.legend(loc="lower right")
    top.set_title(f"{run_dir.name}: {len(rows)} steps")
    base = [0.0] * len(rows)
    for key in TIME_KEYS:
        values = [float(r.get(key) or 0.0) for r in rows]
        bottom.fill_between(steps, base, [b + v for b, v in zip(base, values)], step="mid",
                            label=key.removeprefix("time_").removesuffix("_s").replace("_", " "))
        base = [b + v for b, v in zip(base, values)]
    slow = slow_steps(base)
    if slow:
        # Scale the axis to the steady steps: a warm-up step of 100x their time would flatten them.
        top_s = max((t for i, t in enumerate(base) if i not in slow), default=0.0) * 1.3 or 1.0
        bottom.set_ylim(0.0, top_s)
        bottom.plot([steps[i] for i in slow], [top_s] * len(slow), "^", color="C3", ms=9, clip_on=False,
                    zorder=5)
        labels = [f"step {steps[i]} ({'warm-up' if i == n else 'slow'}) {base[i]:.3g} s"
                  for n, i in enumerate(slow[:MAX_LABELS])]
        if len(slow) > MAX_LABELS:
            labels.append(f"{len(slow) - MAX_LABELS} more")
        bottom.set_title("clipped (\u25b2): " + ", ".join(labels), loc="left", fontsize="small", color="C3")
    else:
        bottom.set_ylim(bottom=0.0)
    bottom.set_ylabel("seconds per step")
    bottom.set_xlabel("step")
    bottom.legend(loc="upper center", ncol=len(TIME_KEYS), fontsize="small")
    fig.tight_layout()
    return fig


def plot(run_dir: Path, out: Path) -> Path:
    fig = draw(run_dir)
    import matplotlib.pyplot as plt

    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, help="PNG to write (default RUN_DIR/metrics.png)")
    args = parser.parse_args()
    print(plot(args.run_dir, args.out or args.run_dir / "metrics.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
