"""The whole loop in one process on the embedded default: it learns, and every sync is exact.

Real vLLM (CPU), the real trainer engine, the real reward pool and the real weight transfer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from listening import HPCRL_RUN, as_on_a_node, check_listening, listening

from hpcrl.launch import inprocess
from hpcrl.rl.metrics import read_metrics
from hpcrl.roles.reaper import descendants, live

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow]
STEPS = 130


@pytest.mark.timeout(900)
def test_embedded_default_learns_and_inference_matches_the_trainer_after_every_sync(tiny_model, tmp_path: Path):
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "hpcrl", "run", "configs/tiny_grpo.toml", "--set", f"run.run_dir={run_dir}",
         "--set", f"model.path={tiny_model}", "--set", "trainer.checkpoint_interval=0",
         # 130 of the file's 200 steps: its 10-step mean first reaches 0.8 at step 103 (BENCHMARKS.md, seed 0)
         "--set", f"trainer.steps={STEPS}",
         "--set", "algorithm.mismatch_every=1",  # the weights checked after every sync
         # greedy pass@1 on 16 held-out prompts at steps 0, 65 and 130 (0.2 s each)
         "--set", "data.eval_source=builtin:echo", "--set", "data.eval_size=16", "--set", f"eval.interval={STEPS // 2}",
         "--set", "eval.at_start=true"],
        cwd=REPO, capture_output=True, text=True, timeout=880)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(run_dir)
    evals = [(r["step"], r["eval/pass@1"]) for r in rows if "eval/pass@1" in r]
    assert [step for step, _ in evals] == [0, STEPS // 2, STEPS]
    assert evals[0][1] < 0.2 and max(p for _, p in evals[1:]) >= 0.8, evals  # the rise, on prompts never trained on
    assert "eval pass@1 (16 prompts): " in done.stdout
    rows = [r for r in rows if r["step"]]  # row 0: the initial weights' evaluation
    rewards = [r["reward_mean"] for r in rows]
    assert len(rows) == len(rewards) == STEPS
    # near chance at the start (one character in ~100), learnt at the end
    assert sum(rewards[:10]) / 10 < 0.1, rewards[:10]
    assert max(sum(rewards[i:i + 10]) / 10 for i in range(len(rewards) - 9)) >= 0.8, rewards
    mismatches = [r["logprob_mismatch"] for r in rows]
    assert all(m is not None and m < 1e-3 for m in mismatches), max(m for m in mismatches if m is not None)
    assert all(r["weight_version"] == r["step"] for r in rows)
    assert (run_dir / "checkpoints").is_dir()  # the last step is always checkpointed


@pytest.mark.timeout(300)
def test_hpcrl_run_leaves_vllms_cpus_to_vllm_listens_on_loopback_only_and_leaves_no_engine_process_when_killed(
        tiny_model, tmp_path: Path):
    run = subprocess.Popen(
        [sys.executable, "-m", "hpcrl", "run", "configs/tiny_grpo.toml", "--set", f"run.run_dir={tmp_path / 'run'}",
         "--set", f"model.path={tiny_model}", "--set", "trainer.checkpoint_interval=0"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **as_on_a_node()})  # gloo's default on this machine's network address, as on a node
    try:
        for line in run.stdout:  # the first step: vLLM's engine and the reward pool are up
            if line.startswith("step "):
                break
        below = descendants(run.pid)
        children = [int(p) for p in Path(f"/proc/{run.pid}/task/{run.pid}/children").read_text().split()]
        assert len(children) == 1, f"hpcrl run is not one supervised task: its children are {children}"
        task = children[0]  # the run's own work, below its supervisor
        engines = [pid for pid, name in below.items() if name.startswith("VLLM::")]
        assert engines, below
        # vLLM's engine core, its worker inside, runs on vLLM's share of the CPUs (inprocess.split_cpus)
        share, trainer = inprocess.split_cpus(sorted(os.sched_getaffinity(0)), 1)
        assert [os.sched_getaffinity(pid) for pid in engines] == [{int(c) for c in share.split(",")}], below
        # and every thread of hpcrl run itself (trainer, controller, vLLM's client) on the trainer's share
        elsewhere = {}
        for t in os.listdir(f"/proc/{task}/task"):
            try:
                name, cpus = Path(f"/proc/{task}/task/{t}/comm").read_text().strip(), os.sched_getaffinity(int(t))
            except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
                continue
            if cpus != set(trainer):
                elsewhere[f"{name} ({t})"] = cpus
        assert elsewhere == {}, f"threads of hpcrl run off the trainer's CPUs {trainer}"
        # Issue 28: the rendezvous store has no TCP port (an ipc socket in a private directory), and every
        # TCP listener left (gloo's, vLLM's: tests/rl/listening.py) is on the loopback address, though
        # gloo's default is the network address here (as_on_a_node).
        roles: dict[int, str | None] = {pid: None for pid in below} | {run.pid: "hpcrl run supervisor",
                                                                      task: "hpcrl run task"}
        sockets = listening(roles)
        print("listening:\n" + "\n".join(f"  {role} (pid {p}): {ip}:{port}" for role, p, ip, port in sockets))
        check_listening(sockets, HPCRL_RUN)
        stores = [c.laddr for c in psutil.Process(task).net_connections(kind="unix")
                  if c.laddr and Path(c.laddr).name == "store" and Path(c.laddr).parent.name.startswith("hpcrl-store-")]
        assert stores and all(Path(s).parent.stat().st_mode & 0o777 == 0o700 for s in stores), stores
        os.kill(task, signal.SIGKILL)
        assert run.wait(timeout=60) == -signal.SIGKILL
        left = live(below)
        assert left == [], f"still running after hpcrl run was killed: {[below[p] for p in left]}"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
