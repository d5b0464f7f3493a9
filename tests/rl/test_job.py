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
from run_helpers import head_log, wait_for

from hpcrl.launch import follow as jobs
from hpcrl.rl.metrics import read_metrics
from hpcrl.roles.reaper import descendants, live
from hpcrl.rundir import EXIT_FILE, read_json

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


def rows_of(run_dir: Path) -> list[tuple]:
    """What a run produced, step by step, to the bit: rewards, losses, grad norms, weight versions."""
    return [(r["step"], r["weight_version"], r["reward_mean"], r.get("loss"), r.get("grad_norm"), r.get("entropy"))
            for r in read_metrics(run_dir)]


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


def trainer_node(run_dir: Path, *, rank: int) -> str:
    """The node trainer `rank` reported from most recently."""
    return re.findall(rf"registered: trainer rank {rank} replica 0 on node (\S+)", head_log(run_dir))[-1]


def reported_pid(run_dir: Path, group: str, *, rank: int) -> int:
    """The pid that `group` rank `rank` reported to the head most recently."""
    return int(re.findall(rf"registered: {group} rank {rank} replica \d+ on node \S+ \(pid (\d+)[,)]", head_log(run_dir))[-1])


def cancel_unless_done(run_dir: Path, env: dict[str, str]) -> None:
    """Leave no job of a failed test running on the local cluster."""
    if not jobs.status(run_dir).done:
        subprocess.run([sys.executable, "-m", "hpcrl", "cancel", str(run_dir)], cwd=REPO, timeout=60,
                       env={**env, "PYTHONPATH": str(REPO)}, capture_output=True)


@pytest.mark.slurm
@pytest.mark.timeout(1200)
def test_the_embedded_default_as_a_hetjob_learns_and_losing_a_trainer_node_changes_nothing(local_slurm, tiny_model,
                                                                                           tmp_path):
    """One hetjob trains uninterrupted; a second loses a trainer node twice: marked down by an admin
    (Slurm requeues the job), then its slurmd and the rank's process killed (the head requeues it).
    Each time it starts on the spare node, resumes from its checkpoint, and it ends bitwise equal."""
    # 120 steps: the 10-step mean reward passes 0.8 near step 95 (BENCHMARKS.md)
    args = ("--cluster", "local", "--set", "trainer.nodes=2", "--set", "trainer.checkpoint_interval=20",
            "--set", "trainer.steps=120")
    straight = tmp_path / "straight"
    done = submit(straight, tiny_model, *args, env=local_slurm, timeout=880)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    ended = read_json(straight / EXIT_FILE)
    assert ended["state"] == "COMPLETED"
    where = {(r["group"], r["rank"]): r["node"] for r in ended["tasks"]}
    assert set(where) == {("head", 0), ("trainer", 0), ("trainer", 1), ("inference", 0), ("reward", 0)}
    assert len(set(where.values())) == 5  # every task on its own node: the components of one hetjob
    rewards = [r["reward_mean"] for r in read_metrics(straight)]
    assert sum(rewards[:10]) / 10 < 0.1, rewards[:10]
    assert max(sum(rewards[i:i + 10]) / 10 for i in range(len(rewards) - 9)) >= 0.8, rewards
    assert all(r["logprob_mismatch"] < 1e-3 for r in read_metrics(straight))

    hit = tmp_path / "hit"
    queued = submit(hit, tiny_model, *args, env=local_slurm, timeout=120, wait=False)
    assert queued.returncode == 0, queued.stderr
    downed: list[str] = []
    try:
        # Each failure comes two steps after a checkpoint (every 20 steps), so that however fast this
        # machine trains (8 steps/s on some VMs), it strikes before the next checkpoint is written.
        # 1: an admin marks trainer rank 1's node down at step 42; Slurm requeues the hetjob itself
        wait_for(lambda: "step   42/" in head_log(hit), "step 42", 300, poll_s=0.05)
        node = trainer_node(hit, rank=1)
        control = subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=hpcrl-test"],
                                 env=local_slurm, capture_output=True, text=True, timeout=30)
        assert control.returncode == 0, control.stderr
        downed.append(node)
        back = wait_for(lambda: "(step 40)" in head_log(hit), "resuming from step 40", 120)
        print(f"node {node} marked down at step 42: running again from step 40 after {back:.0f} s")
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], env=local_slurm,
                       capture_output=True, timeout=30)  # repaired: the cluster has its spare again
        downed.remove(node)
        # 2: at step 82 the slurmd of trainer rank 1's node dies, and the rank's process with it;
        # the head requeues the job (the hetjob would otherwise wait for ever)
        wait_for(lambda: "step   82/" in head_log(hit) and "(step 40)" in head_log(hit), "step 82", 300, poll_s=0.05)
        node = trainer_node(hit, rank=1)
        pid = reported_pid(hit, "trainer", rank=1)
        slurmd = int((Path(local_slurm["SLURM_CONF"]).parent / "run" / f"slurmd.{node}.pid").read_text())
        downed.append(node)
        os.kill(slurmd, 9)
        os.kill(pid, 9)
        back = wait_for(lambda: "(step 80)" in head_log(hit), "resuming from step 80", 120)
        print(f"slurmd of {node} and trainer rank 1 killed at step 82: running again from step 80 after {back:.0f} s")
        final = jobs.wait(hit, timeout_s=600)
    finally:
        if downed:  # restart the killed slurmd, bring the nodes back for the tests that follow
            subprocess.run(["bash", str(REPO / "tools" / "local_slurm.sh"), "up"], capture_output=True, timeout=300)
            for node in downed:
                subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], env=local_slurm,
                               capture_output=True, timeout=30)
    assert final.state == "COMPLETED", final.render()
    assert "requeueing to resume from the last checkpoint (restart 2 of at most 3)" in head_log(hit)
    assert rows_of(hit) == rows_of(straight)


@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_the_pre_timeout_signal_makes_the_run_checkpoint_requeue_itself_and_finish_with_every_step_once(
        local_slurm, tiny_model, tmp_path):
    """Slurm sends SIGUSR2 to the batch step (the head) cluster.signal_delay_s before the time limit
    (`--signal=B:USR2@N` in the rendered script). When its timer fires depends on its 30 s check
    period and on how fast the machine trains (2.3 to 8 steps/s on the VMs this suite has run on:
    a 150-step run outlasted a 2-minute limit on one and finished in 46 s on the next), so the test
    sends the same signal the same way, `scancel --batch --signal=USR2`, at step 10: the head
    checkpoints after the step in progress, requeues the job, which starts again, resumes from that
    checkpoint and completes."""
    run_dir = tmp_path / "run"
    queued = submit(run_dir, tiny_model, "--cluster", "local", "--set", "trainer.checkpoint_interval=0",
                    "--set", "trainer.steps=150", env=local_slurm, timeout=120, wait=False)
    assert queued.returncode == 0, queued.stderr
    try:
        wait_for(lambda: "step   10/" in head_log(run_dir), "step 10", 300, poll_s=0.05)
        job_id = jobs.Run.open(run_dir).job_id
        signalled = subprocess.run(["scancel", "--batch", "--signal=USR2", job_id], env=local_slurm,
                                   capture_output=True, text=True, timeout=30)
        assert signalled.returncode == 0, signalled.stderr
        final = jobs.wait(run_dir, timeout_s=600)
    finally:
        cancel_unless_done(run_dir, local_slurm)
    assert final.state == "COMPLETED", final.render()
    log = head_log(run_dir)
    assert "SIGUSR2 (the time limit is near)" in log and "requeueing the job" in log
    stopped = int(re.search(r"preempted: stopped after step (\d+)", log).group(1))
    assert 10 <= stopped < 150, stopped
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped}'} (step {stopped})" in log
    assert read_json(run_dir / EXIT_FILE)["state"] == "COMPLETED"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 151))  # nothing lost, nothing twice


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_killing_the_inference_replica_loses_no_rollout_and_it_is_back_on_current_weights_within_60_s(
        local_slurm, tiny_model, tmp_path):
    """The head starts the replica again (srun --overlap in its component), re-forms the transfer group."""
    run_dir = tmp_path / "run"
    # In the chat format (issue 29): the head's rendered token ids travel to the replica over the bus,
    # and the config's evaluation (every 20 steps) generates greedily on it.
    queued = submit(run_dir, tiny_model, "--cluster", "local", "--set", "trainer.steps=40",
                    "--set", "trainer.checkpoint_interval=0", "--set", "data.format=chat",
                    env=local_slurm, timeout=120, wait=False)
    assert queued.returncode == 0, queued.stderr
    try:
        wait_for(lambda: "step   10/" in head_log(run_dir), "step 10", 300)
        # Issue 28: every TCP listener of a hetjob on the local cluster is listed (tests/rl/listening.py).
        sockets = listening(job_processes(run_dir))
        print("listening:\n" + "\n".join(f"  {role} (pid {p}): {ip}:{port}" for role, p, ip, port in sockets))
        head = [port for role, _, _, port in sockets if role == "head"]
        assert len(head) == 2, sockets  # the bus and the signed rendezvous store; no TCPStore
        check_listening(sockets, SLURM_JOB)
        pid = reported_pid(run_dir, "inference", rank=0)
        # Right after a step's line the next batch is being generated (~0.1-0.2 s): kill it then.
        wait_for(lambda: "step   15/" in head_log(run_dir), "step 15", 120, poll_s=0.01)
        engine = descendants(pid)  # vLLM's EngineCore (and workers): they must not outlive the replica
        os.kill(pid, 9)
        back = wait_for(lambda: "weight-transfer group formed (generation 1)" in head_log(run_dir),
                        "the replica's return", 60)
        left = live(engine)
        final = jobs.wait(run_dir, timeout_s=400)
    finally:
        cancel_unless_done(run_dir, local_slurm)
    in_flight = "generate on inference/0/0 lost" in head_log(run_dir)
    print(f"the replica was back in the weight-transfer group {back:.0f} s after it was killed "
          f"({'mid-generation: the call was sent again' if in_flight else 'between generations'})")
    assert final.state == "COMPLETED", final.render()
    # its supervisor told the head at once, on the bus, how the task ended
    assert ("group inference rank 0 lost (it exited with code 137: the task killed by SIGKILL); starting it again"
            in head_log(run_dir))
    assert any(name.startswith("VLLM::") for name in engine.values()), engine  # vLLM titles its processes
    assert left == [], f"processes of the killed replica still running: {[engine[p] for p in left]}"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert all(r["groups"] == 8 and r["reward_errors"] == 0 for r in rows)  # nothing lost, nothing scored zero
    assert rows[-1]["groups_held_out_total"] == 0
    assert all(r["logprob_mismatch"] < 1e-3 for r in rows)  # the new replica serves the trainer's weights
    evals = [r for r in read_metrics(run_dir) if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [20, 40] and all(r["eval/prompts"] == 64 for r in evals), evals


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_an_inference_replica_lost_during_a_weight_push_is_started_again_and_caught_up_without_a_requeue(
        local_slurm, tiny_model, tmp_path):
    """The replica dies while the trainer's new weights are being pushed to it. To put its death inside
    a push: the trainer is stopped (SIGSTOP) while the next batch is generated, then the replica is
    stopped and the trainer let go, so the head's push waits on the replica; then it is killed. The
    push is reported lost, not fatal; the head starts the replica again, forms the weight-transfer
    group again and pushes the trainer's weights before the next call."""
    run_dir = tmp_path / "run"
    queued = submit(run_dir, tiny_model, "--cluster", "local", "--set", "trainer.steps=30",
                    "--set", "trainer.checkpoint_interval=0", env=local_slurm, timeout=120, wait=False)
    assert queued.returncode == 0, queued.stderr
    stopped: list[int] = []
    try:
        wait_for(lambda: "step   10/" in head_log(run_dir), "step 10", 300, poll_s=0.05)
        trainer, replica = reported_pid(run_dir, "trainer", rank=0), reported_pid(run_dir, "inference", rank=0)
        stopped += [trainer, replica]
        os.kill(trainer, signal.SIGSTOP)  # the next train step waits; the next batch is generated meanwhile
        time.sleep(2)
        os.kill(replica, signal.SIGSTOP)
        os.kill(trainer, signal.SIGCONT)  # the step ends and the head pushes its weights to the stopped replica
        time.sleep(1)
        os.kill(replica, signal.SIGKILL)
        stopped.remove(replica)
        back = wait_for(lambda: "weight-transfer group formed (generation 1)" in head_log(run_dir),
                        "the replica's return", 60)
        final = jobs.wait(run_dir, timeout_s=400)
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        cancel_unless_done(run_dir, local_slurm)
    print(f"the replica was back in the weight-transfer group {back:.0f} s after it was killed")
    assert final.state == "COMPLETED", final.render()
    log = head_log(run_dir)
    assert re.search(r"weight version \d+ did not reach the inference replicas \(peer inference/0/0", log), log[-3000:]
    assert "group inference rank 0 lost (it exited with code 137: the task killed by SIGKILL); starting it again" in log
    assert "requeueing" not in log
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert all(r["groups"] == 8 and r["reward_errors"] == 0 for r in rows)
    assert all(r["logprob_mismatch"] < 1e-3 for r in rows)  # the new replica serves the trainer's weights
