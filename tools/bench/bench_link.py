"""Weight-sync time of the embedded default as a hetjob on the local cluster, with the trainer's link
as it is and slowed by a token-bucket filter, beside the time `hpcrl plan --transfer` predicts.

    SLURM_CONF=.local_slurm/slurm.conf .venv/bin/python tools/bench/bench_link.py [--rate 100mbit] [--steps 40]

Runs configs/tiny_grpo.toml twice with `--cluster local` (one trainer rank, one replica): first as the
cluster is, then with `tools/local_slurm.sh slow <trainer node> RATE` applied as soon as the trainer
registers (and removed at the end). Prints the median `time_weight_sync_s` of each run over the steps
after the first 5 (warm-up; in the slowed run, the steps after the slow-down took effect) and the
sync time the plan predicts at RATE. With nodes in network namespaces (tools/local_slurm.sh's default
where root) the weights cross a veth pair and a bridge between two hosts; where the nodes share
localhost the rate cannot be set and the second run is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
UNITS = {"kbit": 1e-6, "mbit": 1e-3, "gbit": 1.0}


def gbit(rate: str) -> float:
    found = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", rate)
    if not found:
        raise SystemExit(f"--rate {rate!r}: write it as tc does, e.g. 100mbit or 1gbit")
    return float(found[1]) * UNITS[found[2]]


def cluster_tool(*args: str) -> None:
    env = {**os.environ, "HPCRL_LOCAL_SLURM_DIR": str(Path(os.environ["SLURM_CONF"]).parent)}
    subprocess.run(["bash", str(REPO / "tools" / "local_slurm.sh"), *args], env=env, check=True,
                   capture_output=True, text=True, timeout=60)


def run(run_dir: Path, model: Path, steps: int, rate: str | None) -> tuple[list[float], str]:
    """Submit, wait; with `rate`, slow the trainer's node once it registered. Sync times of the steps
    counted (see the module docstring), and the trainer's node."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", "hpcrl", "submit", "configs/tiny_grpo.toml", "--cluster", "local",
                    "--set", f"run.run_dir={run_dir}", "--set", f"model.path={model}",
                    "--set", f"cluster.slurm_conf={os.environ['SLURM_CONF']}",
                    "--set", f"trainer.steps={steps}", "--set", "trainer.checkpoint_interval=0"],
                   cwd=REPO, env=env, check=True, capture_output=True, text=True, timeout=120)
    log = run_dir / "logs" / "head" / "rank0.log"
    node, slowed_after = "", 0
    deadline = time.monotonic() + 900
    try:
        while not (run_dir / "exit.json").exists():
            text = log.read_text() if log.exists() else ""
            if not node and (found := re.search(r"registered: trainer rank 0 replica 0 on node (\S+)", text)):
                node = found[1]
                if rate:
                    cluster_tool("slow", node, rate)
                    slowed_after = len(re.findall(r"step +\d+/", text))
            if time.monotonic() > deadline:
                raise SystemExit(f"{run_dir}: the run did not end within 15 minutes")
            time.sleep(0.05)
    finally:
        if rate and node:
            cluster_tool("slow", node, "off")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first = max(5, slowed_after + 1)
    return [r["time_weight_sync_s"] for r in rows if r["step"] > first], node


def predicted(rate_gbit: float) -> float:
    out = subprocess.run([sys.executable, "-m", "hpcrl", "plan", "configs/tiny_grpo.toml", "--transfer",
                          "--link-gbps", str(rate_gbit)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         check=True, capture_output=True, text=True, timeout=120).stdout
    return float(re.search(r"predicted sync at [\d.]+ Gbit/s per GPU: ([\d.]+) s", out)[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit", help="tbf rate of the trainer's link (tc syntax)")
    parser.add_argument("--steps", type=int, default=40)
    opts = parser.parse_args()
    if "SLURM_CONF" not in os.environ:
        raise SystemExit("SLURM_CONF is not set: start the local cluster (tools/local_slurm.sh up) and export it")
    namespaced = "# hpcrl-local-slurm netns" in Path(os.environ["SLURM_CONF"]).read_text()
    subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny_model.py")], check=True, capture_output=True)
    model = REPO / "models" / "tiny-llama"
    with tempfile.TemporaryDirectory(prefix="bench-link-") as tmp:
        plain, node = run(Path(tmp) / "plain", model, opts.steps, None)
        print(f"link as it is ({'namespaced nodes' if namespaced else 'shared localhost'}, trainer on {node}): "
              f"weight sync median {statistics.median(plain):.4f} s over {len(plain)} steps")
        if not namespaced:
            print("the nodes share localhost: no link to slow (tools/local_slurm.sh falls back when not root)")
            return 0
        slow, node = run(Path(tmp) / "slow", model, opts.steps, opts.rate)
        print(f"trainer link ({node}) at {opts.rate}: weight sync median {statistics.median(slow):.4f} s over "
              f"{len(slow)} steps; predicted by hpcrl plan --transfer --link-gbps {gbit(opts.rate)}: "
              f"{predicted(gbit(opts.rate)):.4f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
