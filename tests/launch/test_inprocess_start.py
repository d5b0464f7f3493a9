"""`hpcrl run`'s start-up: vLLM, the trainer and the reward pool start at once, and a part that fails
still lets every other part be ended. The parts are stand-ins here: what is tested is their order."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import hpcrl.inference.engine as engine_module
import hpcrl.launch.inprocess as inprocess
from hpcrl.config import load_config

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(60)]
#: How long a part waits for the others to have started: only a start one after the other runs into it.
OVERLAP_S = 10.0


class Part:
    """A part that, once started, waits until every part has started (a barrier), then is up."""

    def __init__(self, name: str, barrier: threading.Barrier, closed: list[str], fail: str | None) -> None:
        self.name, self.closed = name, closed
        barrier.wait(OVERLAP_S)  # BrokenBarrierError unless the others start meanwhile
        if fail == name:
            raise RuntimeError(f"{name} failed to start")
        self.engine = self.thread = self  # OneProcessTrainer's attributes

    def close(self) -> None:
        self.closed.append(self.name)


@pytest.fixture
def parts(monkeypatch):
    """Stand-ins for the three parts; returns (closed names, a setter of which part fails)."""
    barrier = threading.Barrier(3)
    closed: list[str] = []
    failing: dict[str, str | None] = {"name": None}
    make = lambda name: lambda *a, **k: Part(name, barrier, closed, failing["name"])  # noqa: E731
    monkeypatch.setattr(inprocess, "OneProcessTrainer", make("trainer"))
    monkeypatch.setattr(inprocess, "make_scorer", make("reward"))
    monkeypatch.setattr(engine_module.VllmEngine, "from_config", make("inference"))
    monkeypatch.setattr(inprocess.InProcessPorts, "_join_transfer", lambda self, transport: None)
    return closed, failing


def tiny_config():
    return load_config(REPO / "configs" / "tiny_grpo.toml")


def test_hpcrl_run_starts_vllm_the_trainer_and_the_reward_pool_at_once_and_times_each(parts):
    closed, _ = parts
    ports = inprocess.InProcessPorts(tiny_config())
    assert set(ports.startup.parts()) == {"trainer", "reward", "inference", "weights"}
    ports.close()
    assert closed == ["reward", "inference", "trainer"]  # the reverse of the making


@pytest.mark.parametrize("failing", ["trainer", "inference", "reward"])
def test_a_part_that_fails_to_start_is_raised_after_every_part_that_started_is_ended(parts, failing):
    closed, fail = parts
    fail["name"] = failing
    with pytest.raises(RuntimeError, match=f"{failing} failed to start"):
        inprocess.InProcessPorts(tiny_config())
    assert sorted(closed) == sorted({"trainer", "inference", "reward"} - {failing})


@pytest.mark.parametrize(("cpus", "tp", "binding", "trainer"), [
    ([0, 1], 1, "0", [1]),                 # this VM: vLLM's worker on one core, the trainer on the other
    ([3], 1, "3", [3]),                    # one CPU: shared
    ([0, 1, 2, 3], 2, "0|1", [2, 3]),      # TP 2: a core per rank
    ([5, 4, 7, 6, 8], 1, "4,5,6", [7, 8]),
])
def test_hpcrl_run_gives_vllms_workers_and_the_trainer_cpus_of_their_own(cpus, tp, binding, trainer):
    assert inprocess.split_cpus(cpus, tp) == (binding, trainer)
