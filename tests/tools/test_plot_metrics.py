"""tools/plot_metrics.py draws a PNG from metrics.jsonl."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.rl.metrics import MetricsLog

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_plot_metrics_writes_a_png_of_the_reward_and_time_split(tmp_path: Path):
    log = MetricsLog(tmp_path, tensorboard=False)
    for step in range(1, 21):
        log.write({"step": step, "reward_mean": step / 20, "time_generate_s": 0.2, "time_train_s": 0.3,
                   "time_reward_s": 0.05, "time_weight_sync_s": 0.01, "time_idle_s": 0.0})
    done = subprocess.run([sys.executable, str(REPO / "tools" / "plot_metrics.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == (f"{tmp_path / 'metrics.png'}\n", "")  # the quickstart's last line, alone
    png = tmp_path / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000


def _plot_module():
    spec = importlib.util.spec_from_file_location("plot_metrics", REPO / "tools" / "plot_metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_steps(run_dir: Path, generate_s: list[float]) -> None:
    log = MetricsLog(run_dir, tensorboard=False)
    for step, seconds in enumerate(generate_s, start=1):
        log.write({"step": step, "reward_mean": 0.5, "time_generate_s": seconds, "time_train_s": 0.05,
                   "time_reward_s": 0.0, "time_weight_sync_s": 0.0, "time_idle_s": 0.0})


@pytest.mark.timeout(120)
def test_the_first_steps_warm_up_does_not_set_the_time_axis(tmp_path: Path):
    """One 17 s warm-up step and 50 steps of 0.1 s: the axis is scaled to the 0.1 s steps (the
    17 s step would flatten them to a line at the bottom) and the clipped step is named with its time."""
    plot_metrics = _plot_module()
    _write_steps(tmp_path, [16.95] + [0.05] * 50)
    fig = plot_metrics.draw(tmp_path)
    try:
        time_axes = fig.axes[1]
        low, high = time_axes.get_ylim()
        assert low == 0.0
        assert 0.1 <= high < 0.2, f"time axis goes to {high} s: the warm-up step sets it"
        assert "step 1 (warm-up) 17 s" in time_axes.get_title(loc="left")
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)


@pytest.mark.timeout(120)
def test_steady_steps_are_not_clipped(tmp_path: Path):
    plot_metrics = _plot_module()
    _write_steps(tmp_path, [0.05, 0.2] + [0.05] * 20)
    fig = plot_metrics.draw(tmp_path)
    try:
        time_axes = fig.axes[1]
        assert time_axes.get_ylim()[1] >= 0.25
        assert time_axes.get_title(loc="left") == ""
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)
