"""`hpcrl plan --transfer`: bytes per rank, 1.00x the minimum for every shipped config, sync time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.toml"))


def hpcrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_shipped_config_moves_exactly_the_minimum_bytes(config):
    done = hpcrl("plan", "--transfer", str(config))
    assert done.returncode == 0, done.stderr
    assert "bytes vs minimum: 1.00x" in done.stdout
    assert "per trainer rank" in done.stdout and "per inference rank" in done.stdout


@pytest.mark.timeout(60)
def test_the_70b_transfer_plan_prints_vllm_engine_ratios_and_a_sync_time():
    done = hpcrl("plan", "--transfer", "configs/llama70b_grpo.toml", "--link-gbps", "400")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "trainer 1 x 64 (FSDP2 Shard(0)) -> 4 replicas x TP 8, wire bfloat16" in out
    assert "vLLM NCCL engine 8.0x, M2N engine 5.6x" in out
    # 70.55e9 params x 2 bytes / 8 TP ranks = 16.43 GiB per inference rank, at 50 GB/s: 0.353 s
    assert "receives 16.429 GiB .. 16.429 GiB" in out
    assert "predicted sync at 400 Gbit/s per GPU: 0.3528 s" in out


@pytest.mark.timeout(60)
def test_transfer_json_scales_sync_time_with_the_link_and_shows_hsdp_share():
    fast = json.loads(hpcrl("plan", "--transfer", "--json", "configs/qwen2.5-7b_grpo.toml",
                            "--link-gbps", "800").stdout)
    slow = json.loads(hpcrl("plan", "--transfer", "--json", "configs/qwen2.5-7b_grpo.toml",
                            "--link-gbps", "200").stdout)
    assert slow["predicted_sync_s"] == pytest.approx(4 * fast["predicted_sync_s"])
    assert fast["trainer"]["dp_replicate"] == 2 and len(fast["trainer"]["sent_bytes"]) == 16
    assert max(fast["trainer"]["sent_bytes"]) <= 1.01 * fast["trainer"]["share_bytes"]
    assert fast["ratio_to_minimum"] == 1.0 and len(fast["digest"]) == 64


@pytest.mark.timeout(60)
def test_a_non_positive_link_speed_is_a_one_line_error():
    done = hpcrl("plan", "--transfer", "configs/tiny_grpo.toml", "--link-gbps", "0")
    assert done.returncode == 2
    assert "--link-gbps" in done.stderr and "Traceback" not in done.stderr
