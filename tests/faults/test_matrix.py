"""The fault matrix (issue 17): real hetjobs of the embedded default on the namespaced local cluster (head n1,
trainer n2+n3, inference n4, reward n5, spare n6), each hit by one fault two steps after a checkpoint, each
compared with an uninterrupted run of the same seed. A case passes when the run is running again within its
bound (or never stopped), finishes every step once, and its per-step metrics are bitwise equal.

Power loss (tools/local_slurm.sh poweroff): the node's link goes down, then slurmd, its slurmstepds, the
tasks and every descendant are frozen together and killed; the node stays down until the case ends.

Marked `faults` (about 20 min in all): `tools/test.sh --faults` runs them with the rest, as CI does
(.ci/run); plain `tools/test.sh` leaves them out. Each case prints a row of BENCHMARKS.md "Recovery".
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from run_helpers import head_log, wait_for

from hpcrl.launch import follow
from hpcrl.rl.metrics import read_metrics
from hpcrl.rundir import EXIT_FILE, read_json

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "local_slurm.sh"
STEPS, INTERVAL, STRIKE = 40, 10, 12
ARGS = ("--cluster", "local", "--set", "trainer.nodes=2", "--set", f"trainer.checkpoint_interval={INTERVAL}",
        "--set", f"trainer.steps={STEPS}")

pytestmark = [pytest.mark.slurm, pytest.mark.faults]


def cluster_tool(env: dict[str, str], *args: str) -> None:
    done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={**env, "HPCRL_LOCAL_SLURM_DIR": str(Path(env["SLURM_CONF"]).parent)})
    assert done.returncode == 0, done.stderr


def submit(run_dir: Path, model: Path, env: dict[str, str], *, wait: bool, config: str = "configs/tiny_grpo.toml",
           args: tuple[str, ...] = ARGS) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcrl", "submit", config, "--set", f"run.run_dir={run_dir}",
         "--set", f"model.path={model}", *args, *(["--wait"] if wait else [])],
        cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600 if wait else 120)


def rows_of(run_dir: Path) -> list[tuple]:
    """What a run produced, step by step, to the bit."""
    return [(r["step"], r["weight_version"], r["reward_mean"], r.get("loss"), r.get("grad_norm"), r.get("entropy"))
            for r in read_metrics(run_dir)]


def stamp(line: str) -> float:
    return time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000


def lines_after(run_dir: Path, t0: float) -> list[str]:
    return [line for line in head_log(run_dir).splitlines() if line[:4].isdigit() and stamp(line) >= t0]


@pytest.fixture(scope="module")
def namespaced(local_slurm: dict[str, str]) -> dict[str, str]:
    if "# hpcrl-local-slurm netns" not in Path(local_slurm["SLURM_CONF"]).read_text():
        pytest.skip("the local cluster's nodes share localhost (no network namespaces): no node can lose power")
    return local_slurm


@pytest.fixture(scope="module")
def straight(namespaced, tiny_model, tmp_path_factory) -> list[tuple]:
    """The uninterrupted run every case is compared with."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    done = submit(run_dir, tiny_model, namespaced, wait=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    rows = rows_of(run_dir)
    assert [r[0] for r in rows] == list(range(1, STEPS + 1))
    return rows


@dataclass(frozen=True)
class Case:
    name: str
    target: str
    """"head", or GROUP:RANK: whose node (or process) is hit."""
    fault: str
    """poweroff | kill-head | sigstop | cut | cut-5s"""
    bound_s: float | None
    """Running again within this many seconds of the fault; None: no recovery is needed."""


CASES = [
    Case("power loss of the head's node", "head", "poweroff", 120),
    Case("power loss of a trainer node", "trainer:1", "poweroff", 120),
    Case("power loss of the inference node", "inference:0", "poweroff", 120),
    Case("power loss of the reward node", "reward:0", "poweroff", 120),
    Case("kill -9 of the head process", "head", "kill-head", 120),
    Case("SIGSTOP of one trainer rank", "trainer:1", "sigstop", 120),
    Case("cut of the inference node for good", "inference:0", "cut", 120),
    Case("cut of a trainer node for 5 s", "trainer:1", "cut-5s", None),
]


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


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", CASES, ids=[c.name.replace(" ", "-") for c in CASES])
def test_the_run_survives_the_fault_and_ends_bitwise_equal(case: Case, namespaced, tiny_model, straight, tmp_path):
    strike_and_compare(case, tmp_path, tiny_model, namespaced, straight)


def strike_and_compare(case: Case, tmp_path: Path, model: Path, namespaced: dict[str, str], straight: list[tuple],
                       *, config: str = "configs/tiny_grpo.toml", args: tuple[str, ...] = ARGS,
                       strike: int = STRIKE) -> None:
    """Submit `config`, hit it with `case` once step `strike` is logged, and compare its rows with `straight`."""
    run_dir = tmp_path / "run"
    queued = submit(run_dir, model, namespaced, wait=False, config=config, args=args)
    assert queued.returncode == 0, queued.stderr
    undo: list = []
    try:
        wait_for(lambda: f"step {strike:>4}/" in head_log(run_dir), f"step {strike}", 300, poll_s=0.05)
        node, t0 = node_of(run_dir, case.target), time.time()
        if case.fault == "poweroff":
            cluster_tool(namespaced, "poweroff", node)
            undo.append(lambda: cluster_tool(namespaced, "poweron", node))
        elif case.fault == "kill-head":
            os.kill(pid_of(run_dir, "head"), signal.SIGKILL)
        elif case.fault == "sigstop":
            pid = pid_of(run_dir, case.target)
            os.kill(pid, signal.SIGSTOP)
            undo.append(lambda: os.kill(pid, signal.SIGKILL) if os.path.exists(f"/proc/{pid}") else None)
        elif case.fault == "cut":
            cluster_tool(namespaced, "cut", node)
            undo.append(lambda: cluster_tool(namespaced, "mend", node))
        else:
            cluster_tool(namespaced, "cut", node)
            time.sleep(5)
            cluster_tool(namespaced, "mend", node)
        at_step = max(int(m) for m in re.findall(r"step +(\d+)/", head_log(run_dir)))
        if case.bound_s is not None:
            wait_for(lambda: any("resumed from" in line for line in lines_after(run_dir, t0)), "resuming",
                     case.bound_s + 60)
        final = follow.wait(run_dir, timeout_s=600)
    finally:
        for step in undo:
            step()
        # Whatever state it is in (a half-requeued hetjob counts as ended): leave nothing queued.
        subprocess.run([sys.executable, "-m", "hpcrl", "cancel", str(run_dir)], cwd=REPO, timeout=60,
                       env={**namespaced, "PYTHONPATH": str(REPO)}, capture_output=True)
    after = lines_after(run_dir, t0)
    # The first word of it in the head's log: a loss, a silence, a requeue, the guard, or a new head's start.
    noticed = next((stamp(line) - t0 for line in after
                    if re.search(r"lost|silent|unhealthy|requeu|killed by|: head on ", line)), float("nan"))
    resumed = [(stamp(line) - t0, int(m.group(1))) for line in after if (m := re.search(r"resumed from .* \(step (\d+)\)", line))]
    back_s, from_step = resumed[0] if resumed else (float("nan"), None)
    lost = at_step - from_step if from_step is not None else 0
    row = {"case": case.name, "noticed_s": round(noticed, 1), "running_again_s": round(back_s, 1),
           "resumed_from": from_step, "steps_lost": lost}
    (tmp_path / "recovery.json").write_text(json.dumps(row))  # for BENCHMARKS.md, found after the run
    print(f"\nRecovery | {case.name} | noticed {noticed:.1f} s | running again {back_s:.1f} s | "
          f"resumed from step {from_step} | steps lost {lost}")
    assert final.state == "COMPLETED", final.render()
    assert read_json(run_dir / EXIT_FILE)["state"] == "COMPLETED"
    if case.bound_s is not None:
        assert resumed and back_s <= case.bound_s, (resumed, after[:20])
    assert rows_of(run_dir) == straight  # every step once, bitwise equal


# -- the same faults on other kinds of run: a multi-turn environment (issue 32), a Mixture-of-Experts model (31) --
# Shorter runs (their own uninterrupted run each), to keep the matrix within CI's time.
VARIANT_STEPS, VARIANT_INTERVAL, VARIANT_STRIKE = 16, 5, 7


@dataclass(frozen=True)
class Variant:
    name: str
    config: str
    model: str
    """The fixture that makes the config's model."""
    case: Case
    extra: tuple[str, ...] = ()

    @property
    def args(self) -> tuple[str, ...]:
        return ("--cluster", "local", "--set", "trainer.nodes=2", "--set",
                f"trainer.checkpoint_interval={VARIANT_INTERVAL}", "--set", f"trainer.steps={VARIANT_STEPS}",
                *self.extra)


VARIANTS = [
    # The environment workers live in the reward group: its node is the environment node.
    Variant("multi-turn environment", "configs/tiny_env_grpo.toml", "tiny_model",
            Case("power loss of the environment node", "reward:0", "poweroff", 120)),
    Variant("Mixture-of-Experts", "configs/tiny_moe_grpo.toml", "tiny_moe_model",
            Case("power loss of a trainer node", "trainer:1", "poweroff", 120),
            ("--set", "inference.tensor_parallel=2")),
]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("variant", VARIANTS, ids=[v.name.replace(" ", "-") for v in VARIANTS])
def test_other_kinds_of_run_survive_a_power_loss_and_end_bitwise_equal(variant: Variant, namespaced, request,
                                                                       tmp_path):
    model = request.getfixturevalue(variant.model)
    run_dir = tmp_path / "straight"
    done = submit(run_dir, model, namespaced, wait=True, config=variant.config, args=variant.args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    straight = rows_of(run_dir)
    assert [r[0] for r in straight] == list(range(1, VARIANT_STEPS + 1))
    struck = tmp_path / "struck"
    struck.mkdir()
    strike_and_compare(variant.case, struck, model, namespaced, straight, config=variant.config,
                       args=variant.args, strike=VARIANT_STRIKE)
