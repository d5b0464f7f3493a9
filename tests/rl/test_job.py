"""The RL loop as a job: every group its own processes, serving the head over the control bus.

Real vLLM (CPU), real trainer ranks (FSDP2 over gloo), the real reward pool, real weight transfer.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from listening import JOB, SLURM_JOB, as_on_a_node, check_listening, job_processes, listening, speaks_zeromq
from run_helpers import cluster_tool, head_log, wait_for

from hpcrl.launch import follow as jobs
from hpcrl.rl.metrics import read_metrics
from hpcrl.roles.reaper import descendants, live

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow]


def submit(run_dir: Path, model: Path, *args: str, env: dict[str, str] | None = None,
           timeout: float = 600, wait: bool = True) -> subprocess.CompletedProcess:
    """`hpcrl submit` of the embedded default; with wait=False it returns once the job is queued. The
    mismatch is probed at every step: these tests check the inference weights after every recovery."""
    env = {**(env or os.environ), "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "hpcrl", "submit", "configs/tiny_grpo.toml", "--set", f"run.run_dir={run_dir}",
         "--set", f"model.path={model}", "--set", "algorithm.mismatch_every=1", *args,
         *(["--wait"] if wait else [])],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def local(*args: str) -> tuple[str, ...]:
    return ("--set", 'cluster.executor="local"', *args)


@pytest.mark.timeout(600)
def test_hpcrl_resume_continues_a_checkpoint_of_two_trainer_ranks_on_one(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    base = ("--set", "trainer.steps=6", "--set", "trainer.checkpoint_interval=0")
    # gloo's default on this machine's network address, as on a cluster node (tests/rl/listening.py)
    first = submit(run_dir, tiny_model, *local(*base, "--set", "trainer.nodes=2"), "--steps", "3", wait=False,
                   env={**os.environ, **as_on_a_node()})
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    try:
        # Issue 28: once both groups formed, every TCP listener of the job is listed (tests/rl/listening.py):
        # the head's two are signed with the run's secret, the rest gloo's and vLLM's, all of them on the
        # loopback address (every rank of every group is on this machine).
        wait_for(lambda: "weight-transfer group formed" in head_log(run_dir), "the transfer group", 300, poll_s=0.05)
        sockets = listening(job_processes(run_dir))
        print("listening:\n" + "\n".join(f"  {role} (pid {p}): {ip}:{port}" for role, p, ip, port in sockets))
        head = [port for role, _, _, port in sockets if role == "head"]
        assert len(head) == 2 and all(speaks_zeromq(port) for port in head), sockets  # signed; no TCPStore
        check_listening(sockets, JOB)
        assert jobs.wait(run_dir, timeout_s=600).state == "COMPLETED"
    finally:
        cancel_unless_done(run_dir, dict(os.environ))
    second = subprocess.run([sys.executable, "-m", "hpcrl", "resume", str(run_dir), "--set", "trainer.nodes=1",
                             "--wait"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                            text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert f"resuming tiny-grpo from {run_dir / 'checkpoints' / 'step_3'} (step 3)" in second.stdout
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["weight_version"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["logprob_mismatch"] < 1e-3 for r in rows)  # the one rank pushed the resumed weights


def reported_pid(run_dir: Path, group: str, *, rank: int) -> int:
    """The pid that `group` rank `rank` reported to the head most recently."""
    return int(re.findall(rf"registered: {group} rank {rank} replica \d+ on node \S+ \(pid (\d+)[,)]", head_log(run_dir))[-1])


def cancel_unless_done(run_dir: Path, env: dict[str, str]) -> None:
    """Leave no job of a failed test running on the local cluster."""
    if not jobs.status(run_dir).done:
        subprocess.run([sys.executable, "-m", "hpcrl", "cancel", str(run_dir)], cwd=REPO, timeout=60,
                       env={**env, "PYTHONPATH": str(REPO)}, capture_output=True)


def formed(run_dir: Path) -> int:
    """How many times the head formed the weight-transfer group."""
    return head_log(run_dir).count("weight-transfer group formed (generation")


@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_a_replica_cut_off_killed_and_lost_in_a_push_costs_no_rollout_no_requeue_and_no_stale_weight(local_slurm,
                                                                                                   tiny_model, tmp_path):
    """The faults a run takes without a requeue, in turn on one hetjob (in the chat format, issue 29: the
    head's rendered token ids travel to the replica over the bus, and the config's evaluation, every 20
    steps, generates greedily on it). The mismatch is probed at every step: the replica serves the
    trainer's weights after each.

    1. Its node is cut off the network for 10 s, then mended: the run rides it out.
    2. It is killed mid-generation: its supervisor tells the head, which starts it again (srun --overlap
       in its component) and forms the weight-transfer group again; the lost call is sent again.
    3. It dies inside a weight push. To put its death there: the trainer is stopped (SIGSTOP) while the
       next batch is generated, then the replica is stopped and the trainer let go, so the head's push
       waits on the replica; then it is killed. The push is reported lost, not fatal; the head starts the
       replica again, forms the group again and pushes the trainer's weights before the next call."""
    if "# hpcrl-local-slurm netns" not in Path(local_slurm["SLURM_CONF"]).read_text():
        pytest.skip("the local cluster's nodes share localhost (no network namespaces): nothing to cut")
    run_dir = tmp_path / "run"
    queued = submit(run_dir, tiny_model, "--cluster", "local", "--set", "trainer.steps=40",
                    "--set", "trainer.checkpoint_interval=0", "--set", "data.format=chat",
                    env=local_slurm, timeout=120, wait=False)
    assert queued.returncode == 0, queued.stderr
    cut, stopped = "", []
    try:
        wait_for(lambda: "step    5/" in head_log(run_dir), "step 5", 300, poll_s=0.05)
        # Issue 28: every TCP listener of a hetjob on the local cluster is listed (tests/rl/listening.py).
        sockets = listening(job_processes(run_dir))
        print("listening:\n" + "\n".join(f"  {role} (pid {p}): {ip}:{port}" for role, p, ip, port in sockets))
        head = [port for role, _, _, port in sockets if role == "head"]
        assert len(head) == 2, sockets  # the bus and the signed rendezvous store; no TCPStore
        check_listening(sockets, SLURM_JOB)

        # 1. the inference node off the network for 10 s
        wait_for(lambda: "step    8/" in head_log(run_dir), "step 8", 120, poll_s=0.05)
        cut = re.findall(r"registered: inference rank 0 replica 0 on node (\S+)", head_log(run_dir))[-1]
        cluster_tool(local_slurm, "cut", cut, timeout_s=60)
        time.sleep(10)  # the fault itself
        cluster_tool(local_slurm, "mend", cut, timeout_s=60)
        cut = ""

        # 2. the replica killed mid-generation: right after a step's line the next batch is being generated
        wait_for(lambda: "step   15/" in head_log(run_dir), "step 15", 120, poll_s=0.01)
        before, pid = formed(run_dir), reported_pid(run_dir, "inference", rank=0)
        engine = descendants(pid)  # what the replica started (vLLM's workers at TP > 1): none may outlive it
        os.kill(pid, signal.SIGKILL)
        back = wait_for(lambda: formed(run_dir) > before, "the replica's return after its kill", 60)
        left = live(engine)
        in_flight = "generate on inference/0/0 lost" in head_log(run_dir)
        print(f"the killed replica was back in the weight-transfer group {back:.0f} s later "
              f"({'mid-generation: the call was sent again' if in_flight else 'between generations'})")

        # 3. the replica lost inside a weight push
        wait_for(lambda: "step   27/" in head_log(run_dir), "step 27", 120, poll_s=0.05)
        before = formed(run_dir)
        trainer, replica = reported_pid(run_dir, "trainer", rank=0), reported_pid(run_dir, "inference", rank=0)
        stopped += [trainer, replica]
        os.kill(trainer, signal.SIGSTOP)  # the next train step waits; the next batch is generated meanwhile
        time.sleep(2)
        os.kill(replica, signal.SIGSTOP)
        os.kill(trainer, signal.SIGCONT)  # the step ends and the head pushes its weights to the stopped replica
        time.sleep(1)
        os.kill(replica, signal.SIGKILL)
        stopped.remove(replica)
        back = wait_for(lambda: formed(run_dir) > before, "the replica's return after its loss in a push", 60)
        print(f"the replica lost in a push was back in the weight-transfer group {back:.0f} s later")
        final = jobs.wait(run_dir, timeout_s=400)
    finally:
        if cut:
            cluster_tool(local_slurm, "mend", cut, timeout_s=60)
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        cancel_unless_done(run_dir, local_slurm)
    assert final.state == "COMPLETED", final.render()
    log = head_log(run_dir)
    # its supervisor told the head at once, on the bus, how the task ended (twice: 2 and 3)
    assert log.count("group inference rank 0 lost (it exited with code 137: the task killed by SIGKILL); "
                     "starting it again") == 2, log[-3000:]
    assert left == [], f"processes of the killed replica still running: {[engine[p] for p in left]}"
    assert re.search(r"weight version \d+ did not reach the inference replicas \(peer inference/0/0", log), log[-3000:]
    assert "requeueing" not in log
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 41))  # every step once
    assert all(r["groups"] == 8 and r["reward_errors"] == 0 for r in rows)  # nothing lost, nothing scored zero
    assert rows[-1]["groups_held_out_total"] == 0
    assert all(r["logprob_mismatch"] < 1e-3 for r in rows)  # each new replica serves the trainer's weights
    evals = [r for r in rows if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [20, 40] and all(r["eval/prompts"] == 64 for r in evals), evals
