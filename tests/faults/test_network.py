"""Network faults on the namespaced local cluster: the inference node cut off the network under a
running hetjob, then reconnected. The run must end as after any inference-replica fault: every step
once, every group trained, nothing lost or scored zero, the trainer and vLLM still in agreement.

Runs only where tools/local_slurm.sh put each node in its own network namespace (`cut` takes the
node's link down); skipped, saying so, where the nodes share localhost.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_helpers import head_log, wait_for

from hpcrl.launch import follow
from hpcrl.rl.metrics import read_metrics
from hpcrl.rundir import EXIT_FILE, read_json

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "local_slurm.sh"

pytestmark = [pytest.mark.slurm]


def cluster_tool(env: dict[str, str], *args: str) -> None:
    """tools/local_slurm.sh ARGS on the suite's cluster (the directory of its slurm.conf)."""
    done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={**env, "HPCRL_LOCAL_SLURM_DIR": str(Path(env["SLURM_CONF"]).parent)})
    assert done.returncode == 0, done.stderr


@pytest.fixture
def namespaced(local_slurm: dict[str, str]) -> dict[str, str]:
    if "# hpcrl-local-slurm netns" not in Path(local_slurm["SLURM_CONF"]).read_text():
        pytest.skip("the local cluster's nodes share localhost (no network namespaces): nothing to cut")
    return local_slurm


def stamp(line: str) -> float:
    return time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000


@pytest.mark.timeout(600)
def test_cutting_the_inference_node_off_for_10_s_loses_no_rollout_and_the_run_completes(namespaced, tiny_model,
                                                                                         tmp_path):
    run_dir = tmp_path / "run"
    queued = subprocess.run(
        [sys.executable, "-m", "hpcrl", "submit", "configs/tiny_grpo.toml", "--cluster", "local",
         "--set", f"run.run_dir={run_dir}", "--set", f"model.path={tiny_model}", "--set", "trainer.steps=60",
         "--set", "trainer.checkpoint_interval=0", "--set", "algorithm.mismatch_every=1"],
        cwd=REPO, env={**namespaced, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert queued.returncode == 0, queued.stderr
    node = ""
    try:
        wait_for(lambda: "step   20/" in head_log(run_dir), "step 20", 300, poll_s=0.05)
        node = re.findall(r"registered: inference rank 0 replica 0 on node (\S+)", head_log(run_dir))[-1]
        cut_at = time.time()
        cluster_tool(namespaced, "cut", node)
        time.sleep(10)  # the fault itself: 10 s off the network
        cluster_tool(namespaced, "mend", node)
        mended_at = time.time()
        node = ""
        final = follow.wait(run_dir, timeout_s=400)
    finally:
        if node:
            cluster_tool(namespaced, "mend", node)
        if not follow.status(run_dir).done:
            subprocess.run([sys.executable, "-m", "hpcrl", "cancel", str(run_dir)], cwd=REPO, timeout=60,
                           env={**namespaced, "PYTHONPATH": str(REPO)}, capture_output=True)
    log = head_log(run_dir)
    steps = [(stamp(line), int(m.group(1))) for line in log.splitlines()
             if (m := re.search(r"step +(\d+)/", line)) and line[:4].isdigit()]
    stalled = [t for t, _ in steps if cut_at <= t]
    first_after = min(stalled) - cut_at if stalled else float("nan")
    print(f"inference node cut for {mended_at - cut_at:.1f} s: next step line {first_after:.1f} s after the cut; "
          f"head saw: {[line[24:] for line in log.splitlines() if 'lost' in line or 'unhealthy' in line] or 'nothing'}")
    assert final.state == "COMPLETED", final.render()
    assert read_json(run_dir / EXIT_FILE)["state"] == "COMPLETED"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 61))  # every step once
    assert all(r["groups"] == 8 and r["reward_errors"] == 0 for r in rows)  # nothing lost, nothing scored zero
    assert rows[-1]["groups_held_out_total"] == 0
    assert all(r["logprob_mismatch"] < 1e-3 for r in rows)
    assert "requeueing" not in log
