"""tools/plot_metrics.py draws a PNG from metrics.jsonl."""

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
    png = tmp_path / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000
