"""The fault matrix (issues 17, 37): real hetjobs of the embedded default on the namespaced local cluster (head n1,
trainer n2+n3, inference n4, reward n5, spare n6). One uninterrupted run, then one run of the same seed hit by
every fault in turn, each two steps after a checkpoint; after each, the test waits until the run is running
again (within the case's bound, or it never stopped) and repairs what the fault broke (a node powered on, a
link mended, a slurmd started) before the next. The run passes when it finishes every step once and its
per-step metrics are bitwise equal to the uninterrupted run's.

One run for all the faults, not one each: a hetjob's start (vLLM's above all) is most of a case's time, and
the cases are independent of each other by construction (each resumes from its own checkpoint). The log
names the case a failure happened in.

Power loss (tools/local_slurm.sh poweroff): the node's link goes down, then slurmd, its slurmstepds, the
tasks and every descendant are frozen together and killed; the node is powered on once the run runs again.

Marked `faults` (about 15 min in all): `tools/test.sh --faults` runs them with the rest, as CI does
(.ci/run); plain `tools/test.sh` leaves them out. Each case prints a row of BENCHMARKS.md "Recovery".
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from run_helpers import cluster_tool, head_log, wait_for

from hpcrl.launch import follow
from hpcrl.rl.metrics import read_metrics
from hpcrl.rundir import EXIT_FILE, read_json

REPO = Path(__file__).resolve().parents[2]
INTERVAL = 10
"""Checkpoint interval: each case strikes two steps after a checkpoint, before the next is written."""
HEARTBEAT_S = 10
"""cluster.heartbeat_timeout_s of these runs: the tiny model's steps are short, and a silent task is noticed sooner."""

pytestmark = [pytest.mark.slurm, pytest.mark.faults]


def run_args(steps: int, interval: int, *extra: str) -> tuple[str, ...]:
    return ("--cluster", "local", "--set", "trainer.nodes=2", "--set", f"trainer.checkpoint_interval={interval}",
            "--set", f"trainer.steps={steps}", "--set", "cluster.max_requeues=20",
            "--set", f"cluster.heartbeat_timeout_s={HEARTBEAT_S}", *extra)


def submit(run_dir: Path, model: Path, env: dict[str, str], *, wait: bool, config: str,
           args: tuple[str, ...]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcrl", "submit", config, "--set", f"run.run_dir={run_dir}",
         "--set", f"model.path={model}", *args, *(["--wait"] if wait else [])],
        cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=900 if wait else 120)


def rows_of(run_dir: Path, extra: tuple[str, ...] = ()) -> list[tuple]:
    """What a run produced, step by step, to the bit; `extra`: more of each row's metrics to hold equal."""
    return [(r["step"], r["weight_version"], r["reward_mean"], r.get("loss"), r.get("grad_norm"), r.get("entropy"),
             *(r.get(key) for key in extra)) for r in read_metrics(run_dir)]


def stamp(line: str) -> float:
    return time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000


def lines_after(run_dir: Path, t0: float) -> list[str]:
    return [line for line in head_log(run_dir).splitlines() if line[:4].isdigit() and stamp(line) >= t0]


@pytest.fixture(scope="module")
def namespaced(local_slurm: dict[str, str]) -> dict[str, str]:
    if "# hpcrl-local-slurm netns" not in Path(local_slurm["SLURM_CONF"]).read_text():
        pytest.skip("the local cluster's nodes share localhost (no network namespaces): no node can lose power")
    return local_slurm


@dataclass(frozen=True)
class Case:
    name: str
    target: str
    """"head", or GROUP:RANK: whose node (or process) is hit."""
    fault: str
    """poweroff | kill-head | kill (the target's task, kill -9) | sigstop | cut | cut-5s | down | slurmd | usr2"""
    bound_s: float | None
    """Running again within this many seconds of the fault; None: no recovery is needed."""
    back: str = "resumed from"
    """What the head logs once the run is running again (or back at full strength, where it never stopped)."""


CASES = [
    Case("power loss of the head's node", "head", "poweroff", 120),
    Case("power loss of a trainer node", "trainer:1", "poweroff", 120),
    Case("power loss of the inference node", "inference:0", "poweroff", 120),
    Case("power loss of the reward node", "reward:0", "poweroff", 120),
    Case("kill -9 of the head process", "head", "kill-head", 120),
    Case("SIGSTOP of one trainer rank", "trainer:1", "sigstop", 120),
    Case("cut of the inference node for good", "inference:0", "cut", 120),
    # An admin marks the node down: Slurm requeues the hetjob itself.
    Case("a trainer node marked down", "trainer:1", "down", 120),
    # Its slurmd dies, and the rank's process with it: the head requeues the job (it would otherwise wait for ever).
    Case("slurmd and the rank of a trainer node killed", "trainer:1", "slurmd", 120),
    # Slurm's pre-timeout signal, sent as Slurm does (--signal=B:USR2@N reaches the batch step): the head
    # checkpoints after the step in progress, requeues the job, and it resumes from that step.
    Case("the pre-timeout signal (SIGUSR2)", "head", "usr2", 120),
    Case("cut of a trainer node for 5 s", "trainer:1", "cut-5s", None),
]
STEPS = INTERVAL * (len(CASES) + 1)
"""120: every case strikes in its own checkpoint interval; the 10-step mean reward passes 0.8 near step 95."""


def node_of(run_dir: Path, target: str) -> str:
    log = head_log(run_dir)
    if target == "head":
        return re.findall(r"\): head on (\S+),", log)[-1]
    group, rank = target.split(":")
    return re.findall(rf"registered: {group} rank {rank} replica \d+ on node (\S+)", log)[-1]


def pid_of(run_dir: Path, target: str) -> int:
    if target == "head":  # the batch step's child: python -m submitit.core._submit RUN_DIR/submitit
        found = subprocess.run(["pgrep", "-f", f"submitit.core._submit {run_dir}/submitit"], capture_output=True,
                               text=True, timeout=10).stdout.split()
        assert len(found) == 1, found
        return int(found[0])
    group, rank = target.split(":")
    return int(re.findall(rf"registered: {group} rank {rank} replica \d+ on node \S+ \(pid (\d+)[,)]",
                          head_log(run_dir))[-1])


def strike(case: Case, run_dir: Path, env: dict[str, str]) -> Callable[[], None]:
    """Hit the run with `case`'s fault; what repairs it (run once the run is running again, or at the end)."""
    node = node_of(run_dir, case.target)
    scontrol = lambda *args: subprocess.run(["scontrol", *args], env=env, capture_output=True, text=True,  # noqa: E731
                                            timeout=30)
    if case.fault == "poweroff":
        cluster_tool(env, "poweroff", node)
        return lambda: cluster_tool(env, "poweron", node)
    if case.fault == "kill-head":
        os.kill(pid_of(run_dir, "head"), signal.SIGKILL)
    elif case.fault == "kill":
        os.kill(pid_of(run_dir, case.target), signal.SIGKILL)
    elif case.fault == "sigstop":
        pid = pid_of(run_dir, case.target)
        os.kill(pid, signal.SIGSTOP)
        return lambda: os.kill(pid, signal.SIGKILL) if os.path.exists(f"/proc/{pid}") else None
    elif case.fault == "cut":
        cluster_tool(env, "cut", node)
        return lambda: cluster_tool(env, "mend", node)
    elif case.fault == "cut-5s":
        cluster_tool(env, "cut", node)
        time.sleep(5)  # the fault itself: 5 s off the network
        cluster_tool(env, "mend", node)
    elif case.fault == "down":
        done = scontrol("update", f"nodename={node}", "state=down", "reason=hpcrl-test")
        assert done.returncode == 0, done.stderr
        return lambda: scontrol("update", f"nodename={node}", "state=resume")
    elif case.fault == "slurmd":
        pid = pid_of(run_dir, case.target)
        os.kill(int((Path(env["SLURM_CONF"]).parent / "run" / f"slurmd.{node}.pid").read_text()), signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)
        return lambda: cluster_tool(env, "poweron", node)  # starts the dead slurmd again, resumes the node
    elif case.fault == "usr2":
        done = subprocess.run(["scancel", "--batch", "--signal=USR2", follow.Run.open(run_dir).job_id], env=env,
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
    else:
        raise AssertionError(f"unknown fault {case.fault}")
    return lambda: None


def recovery(case: Case, run_dir: Path, t0: float, at_step: int) -> dict:
    """How the run took `case`, from the head's log: when it noticed, when it ran again, from which step."""
    after = lines_after(run_dir, t0)
    # The first word of it in the head's log: a loss, a silence, a requeue, the guard, a signal, or a new head.
    noticed = next((stamp(line) - t0 for line in after
                    if re.search(r"lost|silent|unhealthy|requeu|killed by|SIGUSR2|: head on ", line)), float("nan"))
    resumed = [(stamp(line) - t0, int(m.group(1))) for line in after if (m := re.search(r"resumed from .* \(step (\d+)\)", line))]
    back_s, from_step = resumed[0] if resumed else (float("nan"), None)
    if case.back != "resumed from":  # recovered inside the job: nothing resumed, back at full strength
        back_s = next((stamp(line) - t0 for line in after if case.back in line), float("nan"))
    return {"case": case.name, "at": t0, "noticed_s": round(noticed, 1), "running_again_s": round(back_s, 1),
            "resumed_from": from_step, "steps_lost": at_step - from_step if from_step is not None else 0}


def cluster_state(run_dir: Path, env: dict[str, str], t0: float) -> str:
    """What a stuck recovery looks like from outside: the job's components in the queue, the nodes, the
    head's log since the fault, and slurmctld's lines on the job and the nodes since then."""
    run = lambda *args: subprocess.run(list(args), env=env, capture_output=True, text=True,  # noqa: E731
                                       timeout=30).stdout.strip()
    job = follow.Run.open(run_dir).job_id
    ctld = Path(env["SLURM_CONF"]).parent / "log" / "slurmctld.log"
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0))
    ctld_lines = [line for line in (ctld.read_text(errors="replace").splitlines() if ctld.is_file() else [])
                  if line[1:20] >= since and re.search(rf"JobId={job}\b|\bn\d+\b.*(DOWN|respond|IDLE|RESUME)|requeue",
                                                       line)]
    return "\n".join(["squeue:", run("squeue", "-j", job, "-o", "%i %T %r %N"), "sinfo:", run("sinfo", "-N", "-o", "%N %T"),
                      "head log since the fault:", *lines_after(run_dir, t0)[-25:], "slurmctld since the fault:",
                      *ctld_lines[-40:]])


def survive_in_turn(cases: list[Case], tmp_path: Path, model: Path, env: dict[str, str], *, config: str,
                    args: tuple[str, ...], first: int, every: int, extra: tuple[str, ...] = ()
                    ) -> tuple[Path, list[dict]]:
    """Submit `config` and hit it with each of `cases` in turn, case k once step first + k * every is logged;
    the run's directory and a recovery row per case, once it ended. Asserts each case's bound, and that the
    steps it ran before each fault are bitwise what it ended with (rows_of, with the metrics `extra` names):
    the steps a recovery ran twice (those after the checkpoint it resumed from) came out the same both times."""
    run_dir = tmp_path / "run"
    queued = submit(run_dir, model, env, wait=False, config=config, args=args)
    assert queued.returncode == 0, queued.stderr
    rows: list[dict] = []
    before: list[list[tuple]] = []  # what the run had computed when each fault struck
    repairs: list[Callable[[], None]] = []
    try:
        for k, case in enumerate(cases):
            step = first + k * every
            wait_for(lambda step=step: f"step {step:>4}/" in head_log(run_dir), f"step {step} (before: {case.name})",
                     300, poll_s=0.05)
            t0 = time.time()
            before.append(rows_of(run_dir, extra))
            repairs.append(strike(case, run_dir, env))
            at_step = max(int(m) for m in re.findall(r"step +(\d+)/", head_log(run_dir)))
            if case.bound_s is not None:
                try:
                    wait_for(lambda t0=t0, case=case: any(case.back in line for line in lines_after(run_dir, t0)),
                             f"the run running again after: {case.name}", case.bound_s + 60)
                except AssertionError as err:
                    raise AssertionError(f"{err}\n{cluster_state(run_dir, env, t0)}") from None
            row = recovery(case, run_dir, t0, at_step)
            rows.append(row)
            print(f"\nRecovery | {case.name} | noticed {row['noticed_s']} s | running again {row['running_again_s']} s"
                  f" | resumed from step {row['resumed_from']} | steps lost {row['steps_lost']}")
            if case.bound_s is not None:
                assert row["running_again_s"] <= case.bound_s, (row, lines_after(run_dir, t0)[:20])
            repairs.pop()()  # repaired before the next: the cluster has its spare node again
        final = follow.wait(run_dir, timeout_s=600)
    finally:
        for repair in repairs:
            with contextlib.suppress(Exception):
                repair()
        # Whatever state it is in (a half-requeued hetjob counts as ended): leave nothing queued.
        subprocess.run([sys.executable, "-m", "hpcrl", "cancel", str(run_dir)], cwd=REPO, timeout=60,
                       env={**env, "PYTHONPATH": str(REPO)}, capture_output=True)
        (tmp_path / "recovery.json").write_text(json.dumps(rows))  # for BENCHMARKS.md, found after the run
    assert final.state == "COMPLETED", final.render()
    assert read_json(run_dir / EXIT_FILE)["state"] == "COMPLETED"
    ended = rows_of(run_dir, extra)
    assert [r[0] for r in ended] == list(range(1, len(ended) + 1))  # every step once
    for case, row, seen in zip(cases, rows, before, strict=True):
        assert ended[:len(seen)] == seen, f"{case.name}: the steps before it differ from the ones the run ended with"
        if row["steps_lost"] > 0:
            assert len(seen) > row["resumed_from"], f"{case.name}: no step it ran twice was seen before it"
    return run_dir, rows


def uninterrupted_run(root: Path, model: Path, env: dict[str, str], args: tuple[str, ...]) -> Path:
    """ROOT/straight/run: configs/tiny_grpo.toml run to its end with `args`, untouched: the reference a struck run of
    the same layout and length is held to, step by step."""
    run_dir = root / "straight" / "run"
    done = submit(run_dir, model, env, wait=True, config="configs/tiny_grpo.toml", args=args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return run_dir


def struck_once(case: Case, tmp_path: Path, model: Path, env: dict[str, str], *, config: str, steps: int,
                interval: int, strike: int, args: tuple[str, ...] = (), extra: tuple[str, ...] = ()
                ) -> tuple[Path, list[dict]]:
    """A variant run of `config` (`steps` steps, a checkpoint every `interval`) hit by `case` once step `strike` is
    logged: it resumed from the checkpoint before the strike, ran the steps after it twice (bitwise equal both
    times, survive_in_turn) and ended with every step once. Its directory and metric rows."""
    run_dir, (row,) = survive_in_turn([case], tmp_path, model, env, config=config, args=run_args(steps, interval, *args),
                                      first=strike, every=interval, extra=extra)
    assert row["resumed_from"] == interval and row["steps_lost"] >= 2, row
    rows = read_metrics(run_dir)
    assert len(rows) == steps
    return run_dir, rows


@pytest.fixture(scope="module")
def straight(namespaced, tiny_model, tmp_path_factory) -> Path:
    """The uninterrupted run the struck one is compared with."""
    return uninterrupted_run(tmp_path_factory.mktemp("matrix"), tiny_model, namespaced, run_args(STEPS, INTERVAL))


@pytest.mark.timeout(300)
def test_the_embedded_default_as_a_hetjob_learns_with_every_task_on_its_own_node(straight):
    ended = read_json(straight / EXIT_FILE)
    assert ended["state"] == "COMPLETED"
    where = {(r["group"], r["rank"]): r["node"] for r in ended["tasks"]}
    assert set(where) == {("head", 0), ("trainer", 0), ("trainer", 1), ("inference", 0), ("reward", 0)}
    assert len(set(where.values())) == 5  # every task on its own node: the components of one hetjob
    rows = read_metrics(straight)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    rewards = [r["reward_mean"] for r in rows]
    assert sum(rewards[:10]) / 10 < 0.1, rewards[:10]
    assert max(sum(rewards[i:i + 10]) / 10 for i in range(len(rewards) - 9)) >= 0.8, rewards
    probed = [r["logprob_mismatch"] for r in rows if r.get("logprob_mismatch") is not None]
    assert probed and all(m < 1e-3 for m in probed), probed  # vLLM serves the trainer's weights


@pytest.mark.timeout(2400)
def test_one_run_survives_every_fault_in_turn_and_ends_bitwise_equal(namespaced, tiny_model, straight, tmp_path):
    run_dir, _ = survive_in_turn(CASES, tmp_path, tiny_model, namespaced, config="configs/tiny_grpo.toml",
                                 args=run_args(STEPS, INTERVAL), first=INTERVAL + 2, every=INTERVAL)
    log = head_log(run_dir)
    assert "SIGUSR2 (the time limit is near)" in log
    stopped = int(re.search(r"preempted: stopped after step (\d+)", log).group(1))
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped}'} (step {stopped})" in log
    probed = [r["logprob_mismatch"] for r in read_metrics(run_dir) if r.get("logprob_mismatch") is not None]
    assert probed and all(m < 1e-3 for m in probed), probed  # after every recovery vLLM has the trainer's weights
    assert rows_of(run_dir) == rows_of(straight)  # every step once, bitwise equal


# -- the same fault on another kind of run: a multi-turn environment (issue 32) on a Mixture-of-Experts model (31),
# served at TP 2. A shorter run, and no uninterrupted run of its own: it is held to what it computed before the
# fault (survive_in_turn: the steps after the checkpoint, run twice, are bitwise equal both times).
VARIANT_STEPS, VARIANT_INTERVAL, VARIANT_STRIKE = 12, 5, 7


@pytest.mark.timeout(900)
def test_a_multi_turn_environment_on_a_mixture_of_experts_model_survives_a_power_loss_bitwise_equal(
        namespaced, tiny_moe_model, tmp_path):
    # The environment workers live in the reward group: its node is the environment node.
    case = Case("power loss of the environment node", "reward:0", "poweroff", 120)
    _, rows = struck_once(case, tmp_path, tiny_moe_model, namespaced, config="configs/tiny_env_grpo.toml",
                          steps=VARIANT_STEPS, interval=VARIANT_INTERVAL, strike=VARIANT_STRIKE,
                          args=("--set", "model.preset=tiny-qwen3-moe", "--set", "inference.tensor_parallel=2"))
    assert all(r["moe_aux_loss"] > 0 for r in rows), rows[-1]  # its routers' loss: a MoE trained, not a dense model
    assert all(r["turns_mean"] > 1 for r in rows), rows[-1]  # episodes of more than one turn


def struck_with_a_spare(case: Case, tmp_path: Path, model: Path, env: dict[str, str],
                        args: tuple[str, ...]) -> tuple[Path, str, str]:
    """Run configs/tiny_grpo.toml with `args` (a split job with a spare) and strike it with `case`, a task's loss the
    job takes inside the allocation: one head and no requeue, nothing resumed, back within the case's bound, the lost
    task started again on a spare node, where the run ended with it. The run's directory, its head log and the spare."""
    run_dir, (row,) = survive_in_turn([case], tmp_path, model, env, config="configs/tiny_grpo.toml", args=args,
                                      first=INTERVAL + 2, every=INTERVAL)
    log = head_log(run_dir)
    assert len(re.findall(r"\): head on ", log)) == 1 and "requeueing" not in log  # one head, one job: no requeue
    assert row["resumed_from"] is None and row["running_again_s"] <= case.bound_s, row
    group, rank = case.target.split(":")
    lost_on = re.search(rf"{group} rank {rank} lost \(.*\); starting it again on spare node (\S+)", log)
    assert lost_on, log[-3000:]
    where = {(t["group"], t["rank"]): t["node"] for t in read_json(run_dir / EXIT_FILE)["tasks"]}
    assert where[(group, int(rank))] == lost_on.group(1)
    return run_dir, log, lost_on.group(1)


def bitwise_until_the_replica_serves(run_dir: Path, log: str, reference: Path) -> None:
    """Every step once; bitwise equal to the uninterrupted `reference` until the replica started again serves (the batch
    after the one the step logged before it caught up: max_policy_lag = 1). From there they differ, as the algorithm
    allows: the push the loss broke is made again with the trainer's newest weights (the trainer holds no older ones),
    so the batch generated after it is one version fresher than the uninterrupted run's (lag 0 instead of 1;
    rl/controller.py accepts it), and every later step follows from it. The probe: it serves the trainer's weights."""
    ended, expected = rows_of(run_dir), rows_of(reference)
    assert [r[0] for r in ended] == [r[0] for r in expected]
    caught_up = next(line for line in log.splitlines() if "inference replicas caught up" in line)
    before = max(int(m) for m in re.findall(r"step +(\d+)/", log[:log.index(caught_up)]))
    assert ended[:before + 1] == expected[:before + 1]
    probed = [r["logprob_mismatch"] for r in read_metrics(run_dir) if r.get("logprob_mismatch") is not None]
    assert probed and all(m < 1e-3 for m in probed), probed


# -- recovery inside the allocation (issue 41): layout split with a spare node, two inference replicas (one per node).
# Slurm 22.05 keeps a homogeneous --no-kill job when a node fails (docs/FACTS.md); the head starts the lost replica
# again on the spare, the survivor takes the lost calls, and the transfer group forms again with the newcomer. Two
# short runs (one uninterrupted): two replicas draw other seeds than the matrix's one (a chunk's seed is its place in
# the batch), so the matrix's uninterrupted run is no reference for this one.
SPARE_STEPS = 30
SPARE_ARGS = ("--set", 'cluster.layout="split"', "--set", "cluster.spare_nodes=1", "--set", "inference.replicas=2")
BACK_BOUND_S = 90
"""Back at full strength (both replicas on current weights) within this many seconds of the power loss. Issue 41 aims
at 45 s; the replacement's vLLM start is most of it: back after 33 s on a quiet machine, 59 s on one shared with two
other sessions (2026-11-29)."""


@pytest.mark.extended  # ~5 min of CI's 45 (tools/test.sh --faults --extended runs it)
@pytest.mark.timeout(900)
def test_a_lost_inference_node_is_replaced_by_a_spare_inside_the_job_without_a_requeue_or_a_lost_step(
        namespaced, tiny_model, tmp_path):
    # Split layout: trainer n1+n2 (the head in the batch step on n1), inference n3+n4, reward n5, spare n6.
    args = run_args(SPARE_STEPS, INTERVAL, *SPARE_ARGS)
    uninterrupted = uninterrupted_run(tmp_path, tiny_model, namespaced, args)
    case = Case("power loss of an inference node, a spare in the job", "inference:1", "poweroff", BACK_BOUND_S,
                back="inference replicas caught up")
    run_dir, log, spare = struck_with_a_spare(case, tmp_path, tiny_model, namespaced, args)
    recovery, = read_json(run_dir / "recoveries.json")["recoveries"]
    assert recovery["restarted_on"] == spare and recovery["ready_after_s"] is not None, recovery
    print(f"Recovery | {case.name}: the replacement served {recovery['ready_after_s']} s after it was started")
    bitwise_until_the_replica_serves(run_dir, log, uninterrupted)


# -- DeepSeek-V3 (issue 42): MLA, a dense block, routed and shared experts, and the router's correction bias, which
# the trainer moves every step (auxiliary-loss-free balancing) and vLLM reads: trainer state beside the weights that a
# resume must bring back to the bit. As the variant above: a short run, no uninterrupted run of its own.
DSV3_BIAS_RATE = 1e-3
"""algorithm.moe_bias_update_rate of the DeepSeek-V3 case (torchtitan's default): the bias moves every step."""


def router_biases(checkpoint: Path) -> dict[str, list[float]]:
    """The router biases (torchtitan's `expert_bias_E`, one per MoE block) of a run's checkpoint, read from its
    trainer's DCP files in this process."""
    import torch
    import torch.distributed.checkpoint as dcp

    directory = checkpoint / "trainer"
    meta = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    state = {k: torch.full(meta[k].size, float("nan"), dtype=meta[k].properties.dtype)
             for k in meta if k.startswith("model.") and k.endswith(".expert_bias_E")}
    with warnings.catch_warnings():  # DCP warns that it loads in one process, as asked
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    return {k: v.tolist() for k, v in state.items()}


@pytest.mark.extended  # 75-82 s beyond CI's 45 min (tools/test.sh --faults --extended runs it)
@pytest.mark.timeout(900)
def test_a_deepseek_v3_run_survives_a_power_loss_of_a_trainer_node_with_its_router_bias_bitwise_equal(
        namespaced, tiny_deepseek_v3_model, tmp_path):
    case = Case("power loss of a trainer node (DeepSeek-V3)", "trainer:1", "poweroff", 120)
    run_dir, rows = struck_once(case, tmp_path, tiny_deepseek_v3_model, namespaced,
                                config="configs/tiny_deepseek_v3_grpo.toml", steps=VARIANT_STEPS,
                                interval=VARIANT_INTERVAL, strike=VARIANT_STRIKE,
                                args=("--set", f"algorithm.moe_bias_update_rate={DSV3_BIAS_RATE}",
                                      "--set", "trainer.keep_last=3"))
    trained = [r for r in rows if r.get("loss") is not None]  # a step whose groups all tied trains nothing
    assert trained and all(r["moe_aux_loss"] > 0 for r in trained), rows  # routed experts trained
    # The bias is trainer state: the checkpoint the run resumed from holds it moved from the loaded zeros, and the
    # steps run twice after it (bitwise equal, survive_in_turn) routed with it; it moved on after the resume.
    resumed, after = (router_biases(run_dir / "checkpoints" / f"step_{s}") for s in (VARIANT_INTERVAL, 2 * VARIANT_INTERVAL))
    assert resumed.keys() == after.keys() == {"model.layers.1.moe.expert_bias_E"}, resumed
    assert all(any(b != 0 for b in bias) for bias in resumed.values()), resumed
    assert resumed != after
    probed = [r["logprob_mismatch"] for r in rows if r.get("logprob_mismatch") is not None]
    print(f"DeepSeek-V3 | router bias at step {VARIANT_INTERVAL}: {list(resumed.values())[0]} | logprob_mismatch "
          f"probes {probed}")
    assert probed and all(m < 1e-6 for m in probed), probed  # vLLM serves the trainer's weights and bias


# -- the reward node lost in the same kind of job (issue 41): its score calls in flight wait for the reward task started
# again on the spare and are made again; scoring holds no weights, so nothing drifts: every step is bitwise the
# uninterrupted run's. Trainer on one node: trainer n1 (the head's batch step there), inference n2, reward n3, spare n4.
REWARD_STEPS = 20
REWARD_ARGS = ("--set", 'cluster.layout="split"', "--set", "cluster.spare_nodes=1", "--set", "trainer.nodes=1")
REWARD_BACK_BOUND_S = 45
"""The reward task started again on the spare registered within this many seconds of the power loss (issue 41's 45 s;
by hand, quiet: the next step 11.8 s after the loss, 10.6 s of it the heartbeat timeout)."""


@pytest.fixture(scope="module")
def one_spare(namespaced, tiny_model, tmp_path_factory) -> Path:
    """The uninterrupted run of the split layout with one spare, trainer on one node and one inference replica."""
    return uninterrupted_run(tmp_path_factory.mktemp("one-spare"), tiny_model, namespaced,
                             run_args(REWARD_STEPS, INTERVAL, *REWARD_ARGS))


@pytest.mark.extended  # ~1.5 min beyond CI's 45 (two 20-step runs; tools/test.sh --faults --extended)
@pytest.mark.timeout(900)
def test_a_lost_reward_node_is_replaced_by_a_spare_inside_the_job_with_every_step_bitwise_equal(
        namespaced, tiny_model, one_spare, tmp_path):
    args = run_args(REWARD_STEPS, INTERVAL, *REWARD_ARGS)  # the later trainer.nodes=1 wins over run_args' 2
    case = Case("power loss of the reward node, a spare in the job", "reward:0", "poweroff", REWARD_BACK_BOUND_S,
                back="registered: reward rank 0")
    run_dir, _, spare = struck_with_a_spare(case, tmp_path, tiny_model, namespaced, args)
    recovery, = read_json(run_dir / "recoveries.json")["recoveries"]
    assert recovery["restarted_on"] == spare and recovery["registered_after_s"] is not None, recovery
    print(f"Recovery | {case.name}: registered on the spare {recovery['registered_after_s']} s after it was started")
    rows = read_metrics(run_dir)
    assert all(r["reward_errors"] == 0 for r in rows), [(r["step"], r["reward_errors"]) for r in rows]
    assert rows_of(run_dir) == rows_of(one_spare)  # every step once, bitwise: no sample lost or scored twice


@pytest.mark.extended  # ~1 min beyond CI's 45 (one 20-step run beside the fixture's; tools/test.sh --faults --extended)
@pytest.mark.timeout(900)
def test_the_only_inference_replica_lost_the_step_waits_for_its_replacement_on_a_spare_without_a_requeue(
        namespaced, tiny_model, one_spare, tmp_path):
    # One replica: nothing survives to take its calls, so the step waits for the one started again on the spare.
    args = run_args(REWARD_STEPS, INTERVAL, *REWARD_ARGS)
    case = Case("power loss of the only inference node, a spare in the job", "inference:0", "poweroff", BACK_BOUND_S,
                back="inference replicas caught up")
    run_dir, log, _ = struck_with_a_spare(case, tmp_path, tiny_model, namespaced, args)
    bitwise_until_the_replica_serves(run_dir, log, one_spare)  # as with two replicas


# -- the trainer group started again inside the allocation (issue 41): the same split job with a spare. A trainer rank
# killed (its node lives) starts the group again in place; its node's power loss starts it on the survivor + the spare;
# a third loss, with no spare left, requeues the job (the last resort), which `hpcrl status` lists. Each time the group
# resumes from the last checkpoint, and every step is bitwise the uninterrupted run's (the inference replica kept
# running through the first two: the loop pushes the checkpoint's weights to it before generating).
TRAINER_ARGS = ("--set", 'cluster.layout="split"', "--set", "cluster.spare_nodes=1")
TRAINER_STEPS = 40
KILL_BOUND_S, POWER_BOUND_S = 45, 60
"""Running again ("resumed from") within this many seconds of the fault. Issue 41 aims at 30 s (kill -9) and 40 s
(power loss: 10 s of it the heartbeat timeout); the trainer's start on this shared 2-vCPU machine is most of the rest
(BENCHMARKS.md "Recovery inside the allocation")."""


@pytest.mark.extended  # 2-4 min beyond CI's 45 (130 s quiet, 233 s loaded; tools/test.sh --faults --extended)
@pytest.mark.timeout(1500)
def test_a_lost_trainer_rank_restarts_the_trainer_group_inside_the_job_in_place_then_on_a_spare(
        namespaced, tiny_model, tmp_path):
    # Split layout: trainer n1+n2 (the head in the batch step on n1), inference n3, reward n4, spare n5.
    args = run_args(TRAINER_STEPS, INTERVAL, *TRAINER_ARGS)
    uninterrupted = uninterrupted_run(tmp_path, tiny_model, namespaced, args)
    cases = [Case("kill -9 of a trainer rank, restarted in place", "trainer:1", "kill", KILL_BOUND_S),
             Case("power loss of a trainer node, a spare in the job", "trainer:1", "poweroff", POWER_BOUND_S),
             Case("power loss of the spare's node, no spare left: requeued", "trainer:1", "poweroff", 120)]
    run_dir, rows = survive_in_turn(cases, tmp_path, tiny_model, namespaced, config="configs/tiny_grpo.toml",
                                    args=args, first=INTERVAL + 2, every=INTERVAL)
    log = head_log(run_dir)
    assert len(re.findall(r"\): head on ", log)) == 2 and log.count("requeueing to resume") == 1  # the third only
    # At least the 2 steps since the checkpoint: 3 when the next step was logged as the fault struck.
    assert all(row["resumed_from"] is not None and row["steps_lost"] >= 2 for row in rows), rows
    in_place, on_spare = read_json(run_dir / "recoveries.json")["recoveries"]
    assert in_place["group"] == "trainer" and in_place["ranks"] == [1] and in_place["spares_used"] == []
    assert on_spare["spares_used"] == [on_spare["restarted_on"].split(",")[1]], on_spare  # n2 -> the spare
    assert on_spare["lost_on"] not in on_spare["restarted_on"].split(","), on_spare
    for entry, row in zip((in_place, on_spare), rows, strict=False):
        assert entry["resumed_from_step"] == row["resumed_from"] and entry["running_again_after_s"] is not None
        print(f"Recovery | {entry['why']}: stopped in {entry['stopped_after_s']} s, registered "
              f"{entry['registered_after_s']} s, running again {entry['running_again_after_s']} s after it was noticed")
    heads = read_json(run_dir / "requeues.json")  # each head's start, and the requeue the first one asked for
    assert [start["restart"] for start in heads["starts"]] == [0, 1], heads
    requeue, = heads["requeues"]
    assert requeue["restart"] == 0 and "0 spare node(s) left" in requeue["why"], requeue
    shown = follow.status(run_dir).render()
    assert shown.count("recovered: trainer rank(s) 1 lost on ") == 2 and "spare nodes: 1 (used: 1)" in shown, shown
    assert shown.count("requeued: requeue ") == 1 and "requeued: requeue 1 at " in shown, shown
    assert "0 spare node(s) left" in shown and "; head running again at " in shown, shown
    print(shown)
    probed = [r["logprob_mismatch"] for r in read_metrics(run_dir) if r.get("logprob_mismatch") is not None]
    assert probed and all(m < 1e-3 for m in probed), probed  # the replica that kept running has the trainer's weights
    assert rows_of(run_dir) == rows_of(uninterrupted)  # every step once, bitwise the uninterrupted run's


@pytest.mark.extended  # beyond CI's 45 min, as the case above
@pytest.mark.timeout(900)
def test_a_killed_trainer_rank_restarts_its_group_in_place_in_a_split_job_without_spare_nodes(
        namespaced, tiny_model, tmp_path):
    # Split layout, cluster.spare_nodes = 0 (no --no-kill): a rank killed on a living node needs no spare.
    args = run_args(2 * INTERVAL, INTERVAL, "--set", 'cluster.layout="split"')
    case = Case("kill -9 of a trainer rank, no spare node", "trainer:1", "kill", KILL_BOUND_S)
    run_dir, (row,) = survive_in_turn([case], tmp_path, tiny_model, namespaced, config="configs/tiny_grpo.toml",
                                      args=args, first=INTERVAL + 2, every=INTERVAL)
    log = head_log(run_dir)
    assert len(re.findall(r"\): head on ", log)) == 1 and "requeueing" not in log, log[-3000:]  # one job, never requeued
    assert row["resumed_from"] == INTERVAL and row["steps_lost"] >= 2, row
    entry, = read_json(run_dir / "recoveries.json")["recoveries"]
    assert entry["group"] == "trainer" and entry["ranks"] == [1] and entry["spares_used"] == [], entry
    assert entry["restarted_on"].split(",")[1] == entry["lost_on"], entry  # in place: rank 1 on its own node
    assert entry["resumed_from_step"] == INTERVAL and entry["running_again_after_s"] is not None, entry
    print(f"\nRecovery | {entry['why']}: stopped in {entry['stopped_after_s']} s, registered "
          f"{entry['registered_after_s']} s, running again {entry['running_again_after_s']} s after it was noticed")


# -- LoRA (issue 40): the tiny LoRA config (adapters on every linear and the lm_head, synced into vLLM's LoRA slots)
# on two trainer nodes, one of which loses power two steps after a checkpoint. The run requeues and resumes from
# the adapter-only checkpoint (the adapters, their optimizer state and the base model's path and hash: no base
# weight); the steps it runs twice are bitwise equal both times, as the MoE variant's above.
LORA_STEPS, LORA_INTERVAL, LORA_STRIKE = 12, 5, 7


@pytest.mark.extended  # 86 s beyond CI's 45 min (2026-11-30, 2-vCPU VM; tools/test.sh --faults --extended runs it)
@pytest.mark.timeout(900)
def test_a_lora_run_survives_a_power_loss_of_a_trainer_node_resuming_its_adapter_checkpoint_bitwise_equal(
        namespaced, tiny_model, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from hpcrl.trainer.checkpoint import BASE_FILE

    case = Case("power loss of a trainer node, LoRA", "trainer:1", "poweroff", 120)
    run_dir, rows = struck_once(case, tmp_path, tiny_model, namespaced, config="configs/tiny_lora_grpo.toml",
                                steps=LORA_STEPS, interval=LORA_INTERVAL, strike=LORA_STRIKE)
    probed = [r["logprob_mismatch"] for r in rows if r.get("logprob_mismatch") is not None]
    assert probed and all(m < 1e-3 for m in probed), probed  # after the recovery vLLM serves the synced adapters
    # The checkpoint it resumed from is pruned by now (keep_last 2); the newest, written after the resume, is alike.
    newest = max((run_dir / "checkpoints").glob("step_*"), key=lambda d: int(d.name.split("_")[1])) / "trainer"
    assert (newest / BASE_FILE).is_file()  # the base model it was trained on, checked at a resume
    saved = FileSystemReader(str(newest)).read_metadata().state_dict_metadata
    weights = [key for key in saved if key.startswith("model.")]
    assert weights and all(".lora_A." in key or ".lora_B." in key for key in weights), weights  # no base weight


# -- the long-completion task (issue 39) with packed micro-batches over two trainer ranks and partial rollouts: the
# checkpoint the run resumes from holds the half-made sequences of the window in flight, which go on after the
# resume from the same tokens, on the same weights, as before the fault. A window of 64 tokens: the random model
# seldom samples <eos>, so a sequence of the 264-token budget spans 5 windows and the first groups train at step 5.
LONG_STEPS, LONG_INTERVAL, LONG_STRIKE = 12, 5, 7
LONG_ARGS = ("--set", "algorithm.partial_rollouts=true", "--set", "algorithm.partial_tokens=64",
             "--set", "algorithm.max_policy_lag=6", "--set", "trainer.global_batch_size=64",
             "--set", "algorithm.mismatch_every=1", "--set", "eval.interval=0")
LONG_EXTRA = ("partial_carried", "partial_sequences", "partial_groups_finished", "token_lag_max", "train_tokens",
              "logprob_mismatch", "logprob_mismatch_max")
"""Held bitwise equal too: what each window carried and finished, and what the packed steps trained on."""


@pytest.mark.extended  # 168 s beyond CI's 45 min (2026-11-30, 2-vCPU VM; tools/test.sh --faults --extended runs it)
@pytest.mark.timeout(900)
def test_a_long_completion_run_with_packing_and_partial_rollouts_survives_a_power_loss_bitwise_equal(
        namespaced, tiny_model, tmp_path):
    case = Case("power loss of a trainer node, long completions", "trainer:1", "poweroff", 120)
    _, rows = struck_once(case, tmp_path, tiny_model, namespaced, config="configs/tiny_long_grpo.toml", steps=LONG_STEPS,
                          interval=LONG_INTERVAL, strike=LONG_STRIKE, args=LONG_ARGS, extra=LONG_EXTRA)
    # The checkpoint it resumed from held sequences in flight, and groups finished and trained on both sides of it.
    assert rows[LONG_INTERVAL - 1]["partial_carried"] > 0, rows[LONG_INTERVAL - 1]
    trained = [r["step"] for r in rows if r.get("loss") is not None]
    assert any(s <= LONG_INTERVAL for s in trained) and any(s > LONG_STRIKE for s in trained), trained
    assert max(r["token_lag_max"] or 0 for r in rows) >= 2, rows  # tokens of several weight versions in a group
    assert max(r["train_tokens"] for r in rows) > 64 * 64, rows  # long completions, not one-token answers
    probed = [r["logprob_mismatch_max"] for r in rows if r.get("logprob_mismatch_max") is not None]
    print(f"long completions | carried at step {LONG_INTERVAL}: {rows[LONG_INTERVAL - 1]['partial_carried']} | "
          f"trained at steps {trained} | largest probe difference {max(probed, default=None)}")
    assert probed and all(m < 1e-5 for m in probed), probed  # vLLM serves the trainer's weights after the recovery
    means = [r["logprob_mismatch"] for r in rows if r.get("logprob_mismatch") is not None]
    assert means and all(m < 1e-6 for m in means), means  # tokens scored under the weights that sampled them
