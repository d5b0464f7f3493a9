"""tools/bench/bench_trainer.py runs end to end on CPU with the tiny preset and reports its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def bench_tiny(repo, out, *args: str) -> subprocess.CompletedProcess:
    """tools/bench/bench_trainer.py on the tiny preset on CPU, one thread, writing its JSON to `out`."""
    return subprocess.run(
        [sys.executable, str(repo / "tools" / "bench" / "bench_trainer.py"), "--preset", "tiny-llama", "--device", "cpu",
         "--batch", "2", "--seq-len", "32", "--warmup", "1", *args, "--json", str(out)],
        capture_output=True, text=True, timeout=140, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_trainer_benchmark_runs_on_cpu_with_the_tiny_preset(repo, tmp_path):
    out = tmp_path / "bench.json"
    done = bench_tiny(repo, out, "--steps", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tokens/s/rank" in done.stdout and "MFU n/a" in done.stdout
    result = json.loads(out.read_text())
    assert result["step_ms"] > 0 and result["tokens_per_s_per_rank"] > 0 and result["mfu"] is None
    assert result["parameters"] == 328320


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_trainer_benchmark_compares_the_engine_step_with_a_plain_loop_of_the_same_model(repo, tmp_path):
    out = tmp_path / "bench.json"
    done = bench_tiny(repo, out, "--steps", "2", "--compare", "--logprob-chunk-tokens", "5")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "plain loop:" in done.stdout and "engine / plain = " in done.stdout
    result = json.loads(out.read_text())
    assert result["side"] == "engine" and result["interleaved"] is True
    assert len(result["step_ms_all"]) == len(result["plain"]["step_ms_all"]) == 2
    assert result["engine_over_plain"] == pytest.approx(result["step_ms"] / result["plain"]["step_ms"], rel=1e-3)
