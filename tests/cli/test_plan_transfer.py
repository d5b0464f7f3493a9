"""`hpcrl plan --transfer`: the run's own plan (its digest is the one the run logs), bytes per rank, 1.00x the
minimum for every shipped config, sync time per transport."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.config import load_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.toml"))


def hpcrl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


# Kimi-K2's plan is 8.45M blocks: 10 s alone on 2 cores, and CI's second worker has made it 60 s.
@pytest.mark.timeout(240)
@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_shipped_config_moves_exactly_the_minimum_bytes(config):
    done = hpcrl("plan", "--transfer", str(config), timeout=230)
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
def test_the_70b_plan_shows_bytes_and_nccl_sync_per_trainer_rank_and_per_inference_gpu():
    done = hpcrl("plan", "--transfer", "configs/llama70b_grpo.toml")
    assert done.returncode == 0, done.stderr
    rows = {line.split(")")[0].strip() + ")": line.split(")", 1)[1].split() for line in done.stdout.splitlines()
            if line.strip().startswith(("per trainer rank (", "per inference GPU ("))}
    # 8.82e9 bytes per trainer rank, 17.64e9 per inference GPU, at 50 GB/s: 0.1764 s and 0.3528 s
    assert rows["per trainer rank (x64)"][:4] == ["8.215", "GiB", "0.1764", "s"]
    assert rows["per inference GPU (x32)"][:4] == ["16.429", "GiB", "0.3528", "s"]
    out = done.stdout
    assert "nccl         NCCL over InfiniBand NDR, 50 GB/s per GPU (400 Gbit/s, a port per GPU)" in out
    assert "450 GB/s per H100 and direction (within a node only)" in out
    assert "nodes of their own in the hetjob: NCCL goes over InfiniBand" in out
    assert "TCP 25 Gbit/s per node shared by its ranks" in out
    assert 'this run: nccl (inference.weight_transport = "auto"), predicted 0.3528 s' in out
    assert "warning" not in out


@pytest.mark.timeout(60)
def test_the_transfer_view_predicts_every_transport_and_warns_of_gloo_written_on_gpus():
    done = hpcrl("plan", "--transfer", "--json", "configs/llama70b_grpo.toml", "--set",
                 'inference.weight_transport="gloo"')
    assert done.returncode == 0, done.stderr
    s = json.loads(done.stdout)
    assert s["weight_transport"] == {"configured": "gloo", "resolved": "gloo"}
    assert "GPU -> host -> TCP -> host -> GPU" in s["warning"]
    t = s["transports"]
    assert list(t) == ["nccl", "nccl-nvlink", "gloo", "ucx"]
    assert t["nccl"]["sync_s"] == pytest.approx(s["predicted_sync_s"])
    assert len(t["gloo"]["trainer_rank_s"]) == 64 and len(t["gloo"]["inference_rank_s"]) == 32
    # gloo: 17.64 GB per inference GPU copied out at 50 GB/s (pinned), 8 GPUs a node through 25 Gbit/s of Ethernet, copied in
    assert t["gloo"]["sync_s"] == pytest.approx(8.82e9 / 50e9 + 8 * 17.64e9 / 3.125e9 + 17.64e9 / 50e9, rel=1e-3)
    text = hpcrl("plan", "--transfer", "configs/llama70b_grpo.toml", "--set", 'inference.weight_transport="gloo"')
    assert 'this run: gloo (inference.weight_transport = "gloo"), predicted 45.69 s' in text.stdout
    assert '  warning: inference.weight_transport = "gloo"' in text.stdout


@pytest.mark.timeout(60)
def test_the_tcp_speed_scales_gloos_network_time_and_no_other():
    slow, fast = (json.loads(hpcrl("plan", "--transfer", "--json", "configs/llama8b_grpo.toml", "--tcp-gbps",
                                   gbps).stdout)["transports"] for gbps in ("25", "100"))
    assert fast["nccl"] == slow["nccl"] and fast["ucx"] == slow["ucx"]
    copies = 2 * 8.03e9 / 50e9  # one trainer node -> one inference node, 8 ranks each: copy out, copy in
    assert slow["gloo"]["sync_s"] - copies == pytest.approx(4 * (fast["gloo"]["sync_s"] - copies), rel=1e-3)


@pytest.mark.timeout(60)
def test_cpu_groups_are_predicted_over_gloo_and_ucx_without_copies():
    done = hpcrl("plan", "--transfer", "configs/tiny_grpo.toml")
    assert done.returncode == 0, done.stderr
    assert "per trainer rank (x1, CPU)" in done.stdout and "per inference rank (x1, CPU)" in done.stdout
    assert "nccl" not in done.stdout.split("predicted sync per transport")[1]
    assert "gloo  TCP 25 Gbit/s per node shared by its ranks" in done.stdout
    assert 'this run: gloo (inference.weight_transport = "auto")' in done.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["0", "nan", "inf", "-inf"])
@pytest.mark.parametrize("flag", ["--link-gbps", "--tcp-gbps"])
def test_a_link_speed_that_is_not_a_finite_positive_number_is_a_one_line_error(flag, value):
    done = hpcrl("plan", "--transfer", "configs/tiny_grpo.toml", f"{flag}={value}")
    assert done.returncode == 2 and done.stdout == ""
    assert flag in done.stderr and "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


class _Head:
    """The head's router as BusPorts sees it while it is made (its services subscribe to health news)."""

    def subscribe(self, callback) -> None:
        pass


#: Every shipped config, and one whose run's wire dtype is not its model's (vLLM serves float32 on CPU).
DIGEST_CASES = [(c, ()) for c in CONFIGS] + [(REPO / "configs" / "tiny_grpo.toml", ("model.dtype=bfloat16",))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config,overrides", DIGEST_CASES,
                         ids=[c.stem + "".join(f"[{o}]" for o in sets) for c, sets in DIGEST_CASES])
def test_the_cli_prints_the_plan_line_and_digest_that_the_runs_head_logs(config, overrides, caplog):
    """The head (rl/ports.py BusPorts, made as rl/program.py run_program makes it) logs the plan it forms
    the transfer group with; `hpcrl plan --transfer` must print that very line. `hpcrl run`'s log:
    tests/cli/test_run_cmd.py."""
    from hpcrl.rl.ports import BusPorts

    sets = [arg for o in overrides for arg in ("--set", o)]
    done = hpcrl("plan", "--transfer", str(config), *sets)
    assert done.returncode == 0, done.stderr
    printed = done.stdout.splitlines()[0]
    with caplog.at_level(logging.INFO, logger="hpcrl.rl.ports"):
        BusPorts(load_config(config, overrides=overrides), _Head(), store="tcp://127.0.0.1:29500")
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weight transfer plan ")]
    assert logged == [printed]
    if overrides:  # the CPU run transfers what vLLM serves there, not the model's dtype
        assert printed.endswith("wire float32")
