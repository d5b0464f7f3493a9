"""The RL loop without processes: the real controller and run_loop over in-memory groups (fake_ports.py),
and the real BusPorts over an in-memory bus and job (fake_head.py). The whole file runs in about a second.

    pytest tests/rl/test_controller.py --durations=0
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch  # noqa: F401  the algorithm's advantages need it: a one-off import (~1.5 s) at collection, not in a test
from fake_config import fake_config
from fake_head import FakeHead, FakeJob
from fake_ports import FakeGroupError, FakePorts, FakeReward

import hpcrl.rl.ports as ports_module
from hpcrl.algorithms import algorithm_options
from hpcrl.config.schema import Config
from hpcrl.data.prompts import Prompt
from hpcrl.errors import ConfigError
from hpcrl.rl.controller import FLOAT32_MISMATCH_ALARM, FLOAT32_MISMATCH_FLOOR, ControllerError, mismatch_alarm
from hpcrl.rl.loop import Preempted, run_loop
from hpcrl.rl.metrics import read_metrics
from hpcrl.rl.ports import BusPorts

STEPS = 6
PROMPTS_PER_STEP = 3
GROUP_SIZE = 4
SEED = 3


def config_for(run_dir: Path, *, lag: int = 1, steps: int = STEPS, interval: int = 0, replicas: int = 1,
               trainer_nodes: int = 1) -> Config:
    return fake_config(run_dir, run_name="fake-run", seed=SEED, steps=steps, prompts_per_step=PROMPTS_PER_STEP,
                       group_size=GROUP_SIZE, interval=interval, replicas=replicas, trainer_nodes=trainer_nodes,
                       max_policy_lag=lag)


@contextlib.contextmanager
def memory_dir(fallback: Path):
    """A fresh directory in memory (/dev/shm) where there is one, else `fallback`: the loop fsyncs every
    metrics line and checkpoint file, some milliseconds each on a disk, microseconds in memory."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield fallback
        return
    path = Path(tempfile.mkdtemp(prefix="hpcrl-test-controller-", dir=shm))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def runs(tmp_path):
    """Where a test's runs write (see memory_dir)."""
    with memory_dir(tmp_path) as path:
        yield path


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """uninterrupted(lag): (ports, run directory) of an undisturbed run, made once per lag for every test."""
    made: dict[int, tuple[FakePorts, Path]] = {}
    with memory_dir(tmp_path_factory.mktemp("uninterrupted")) as root:
        def get(lag: int) -> tuple[FakePorts, Path]:
            if lag not in made:
                ports = FakePorts(reward=FakeReward(broken_sample))
                loop_once(config_for(root / f"lag{lag}", lag=lag), ports)
                made[lag] = ports, root / f"lag{lag}"
            return made[lag]
        yield get


def run(coro, timeout: float = 10.0):
    """One test coroutine on a fresh loop, with a deadline (a hang fails the test, it does not stall it)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def loop_once(config: Config, ports, **kwargs) -> None:
    """run_loop to its end (or `steps`)."""
    run(run_loop(config, ports, **kwargs))


@pytest.fixture
def logged():
    """What hpcrl logs during the test (run_loop's and BusPorts' messages), in order."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())
    handler, logger = Collect(), logging.getLogger("hpcrl")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def outcome(run_dir: Path) -> list[dict]:
    """Every step's metrics, without wall times (which differ between any two runs)."""
    return [{k: v for k, v in row.items()
             if not (k.startswith(("time_", "startup_")) or k.endswith("_per_s") or k == "eval/time_s")}
            for row in read_metrics(run_dir)]


def batch_of(seed: int) -> int:
    """The batch index a generation seed stands for (hpcrl.rl.controller: run.seed * 1_000_003 + index)."""
    return seed - SEED * 1_000_003


def broken_sample(sample_id: str) -> bool:
    """The reward of every run here: one sample of batch 1's second prompt fails to score (its group is held out)."""
    return sample_id == "echo-train-4/1"


def prompt_ids(batch: int) -> list[str]:
    return [f"echo-train-{batch * PROMPTS_PER_STEP + k}" for k in range(PROMPTS_PER_STEP)]


# -- policy lag -------------------------------------------------------------------------------------
# -- policy lag -------------------------------------------------------------------------------------
@pytest.mark.parametrize("lag", [0, 1, 2])
def test_each_step_trains_on_rollouts_of_weight_version_step_minus_lag(uninterrupted, lag):
    ports, run_dir = uninterrupted(lag)
    made_with = {prompt: version for _, prompt, version in ports.inference.generated}
    for step in range(STEPS):
        versions = {made_with[p] for p in ports.trainer.trained[step]}
        assert versions == {max(0, step - lag)}, (step, versions)
        assert step - min(versions) <= lag  # the staleness bound
    assert ports.trainer.version == ports.inference.version == STEPS
    rows = read_metrics(run_dir)
    assert [r["weight_version"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["policy_lag"] == lag and r["logprob_mismatch"] == 0.0 for r in rows)
    assert any(r["ratio_max"] != 1.0 for r in rows) == (lag > 0)  # off-policy batches show in the ratio


class ProbeCounting(FakePorts):
    """FakePorts that count the mismatch probe's trainer forwards."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.probes = 0

    async def trainer_logprobs(self, sequences):
        self.probes += 1
        return await super().trainer_logprobs(sequences)


@pytest.mark.timeout(30)
def test_at_lag_0_the_train_step_measures_the_mismatch_and_no_probe_runs(runs):
    ports = ProbeCounting(reward=FakeReward(broken_sample))
    loop_once(config_for(runs / "lag0", lag=0), ports)
    rows = read_metrics(runs / "lag0")
    assert ports.probes == 0
    assert [r["logprob_mismatch"] for r in rows] == [r["sampling_logprob_diff"] for r in rows] == [0.0] * STEPS


@pytest.mark.timeout(30)
def test_at_lag_1_the_mismatch_is_probed_every_mismatch_every_steps(runs):
    ports = ProbeCounting(reward=FakeReward(broken_sample))
    config = config_for(runs / "lag1", lag=1)
    config = dataclasses.replace(config, algorithm=dataclasses.replace(config.algorithm, mismatch_every=2))
    loop_once(config, ports)
    rows = read_metrics(runs / "lag1")
    assert ports.probes == STEPS // 2
    assert [r["logprob_mismatch"] is not None for r in rows] == [step % 2 == 0 for step in range(1, STEPS + 1)]
    with pytest.raises(ConfigError, match="at least 1"):
        algorithm_options(group_size=GROUP_SIZE, mismatch_every=0)


class OffsetInference(FakePorts):
    """FakePorts whose inference side reports every logprob `offset` above the trainer's: each probe then
    reads a logprob_mismatch of `offset`."""

    def __init__(self, offset: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.offset = offset

    async def inference_logprobs(self, sequences):
        return [[v + self.offset for v in row] for row in await super().inference_logprobs(sequences)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("offset, warns", [(FLOAT32_MISMATCH_FLOOR, False), (2 * FLOAT32_MISMATCH_ALARM, True)])
def test_a_float32_run_warns_when_the_mismatch_is_far_above_the_measured_floor(runs, logged, offset, warns):
    loop_once(config_for(runs / "alarm", lag=1), OffsetInference(offset, reward=FakeReward(broken_sample)))
    rows = read_metrics(runs / "alarm")
    assert [r["logprob_mismatch"] for r in rows] == pytest.approx([offset] * STEPS, rel=1e-6)
    alarms = [line for line in logged if "logprob_mismatch" in line and "above" in line]
    assert len(alarms) == (STEPS if warns else 0), alarms
    # one weight tensor of SmolLM2 rounded through bfloat16 reads 7.4e-4 (tools/bench/bench_mismatch.py)
    assert FLOAT32_MISMATCH_FLOOR < FLOAT32_MISMATCH_ALARM < 7.4e-4


def test_only_float32_runs_have_a_mismatch_alarm(tmp_path):
    config = config_for(tmp_path)
    assert mismatch_alarm(config) == FLOAT32_MISMATCH_ALARM  # on CPU both sides compute in float32
    on_gpus = dataclasses.replace(
        config, model=dataclasses.replace(config.model, dtype="bfloat16"),
        trainer=dataclasses.replace(config.trainer, gpus_per_node=1),
        inference=dataclasses.replace(config.inference, gpus_per_node=1))
    assert mismatch_alarm(on_gpus) is None  # no bfloat16 floor is measured
    assert mismatch_alarm(dataclasses.replace(on_gpus, model=dataclasses.replace(config.model, dtype="float32"))) \
        == FLOAT32_MISMATCH_ALARM


@pytest.mark.parametrize("lag", [1, 2])
def test_with_a_lag_the_next_batch_is_generated_while_the_step_trains(uninterrupted, lag):
    events = uninterrupted(lag)[0].events
    for step in range(STEPS - lag):
        begin, end = events.index(("train", step, "begin")), events.index(("train", step, "end"))
        assert [batch_of(e[1]) for e in events[begin:end] if e[0] == "generate"] == [step + lag]
        assert events.index(("sync", step + 1)) > end


class ScoringEndsOnlyAfterASync(FakePorts):
    """Scores a batch generated inside the loop only once a weight sync has begun after its generation."""

    def __init__(self, lag: int) -> None:
        super().__init__(reward=FakeReward(broken_sample))
        self.lag, self.batch, self.synced = lag, -1, asyncio.Event()

    async def generate(self, prompts, *, n, seed, temperature=None):
        self.batch, self.synced = batch_of(seed), asyncio.Event()
        return await super().generate(prompts, n=n, seed=seed, temperature=temperature)

    async def score(self, samples):
        if self.batch >= self.lag:  # batches 0 .. lag - 1 come before the first step, with no sync after them
            await self.synced.wait()
        return await super().score(samples)

    async def sync_weights(self, version: int) -> None:
        self.synced.set()
        await super().sync_weights(version)


@pytest.mark.parametrize("lag", [1, 2])
def test_with_a_lag_the_next_batch_is_scored_while_the_weights_go_to_the_inference_group(uninterrupted, runs, lag):
    """The reward group is not the inference group: the sync need not wait for the scoring (a step's
    reward + sync: 15 ms -> 10 ms of the tiny default's 63 ms). A loop that waited would hang here."""
    ports = ScoringEndsOnlyAfterASync(lag)
    loop_once(config_for(runs / "run", lag=lag), ports)
    assert outcome(runs / "run") == outcome(uninterrupted(lag)[1])


def test_fully_on_policy_generates_each_batch_after_the_last_sync_and_before_its_step(uninterrupted):
    events = uninterrupted(0)[0].events
    generations = [(at, batch_of(e[1])) for at, e in enumerate(events) if e[0] == "generate"]
    assert [batch for _, batch in generations] == list(range(STEPS))
    for at, batch in generations:
        assert events.index(("sync", batch)) < at < events.index(("train", batch, "begin"))


# -- resume ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("lag", [0, 1, 2])
def test_a_run_resumed_from_a_checkpoint_equals_an_uninterrupted_one(uninterrupted, runs, lag, logged):
    whole, whole_dir = uninterrupted(lag)
    config = config_for(runs, lag=lag)
    loop_once(config, FakePorts(reward=FakeReward(broken_sample)), steps=3)
    assert [r["step"] for r in read_metrics(runs)] == [1, 2, 3]
    second = FakePorts(reward=FakeReward(broken_sample))  # a new job: nothing carried over but the run dir
    loop_once(config, second)

    assert f"resumed from {runs / 'checkpoints' / 'step_3'} (step 3)" in logged
    assert outcome(runs) == outcome(whole_dir)
    assert (second.trainer.version, second.trainer.weights) == (whole.trainer.version, whole.trainer.weights)
    assert (second.inference.version, second.inference.weights) == (whole.inference.version, whole.inference.weights)
    assert second.events[0] == ("sync", 3)  # the resumed weights reach inference before anything runs
    # The batches generated before the checkpoint came back from it, scored, not generated again.
    assert [batch_of(seed) for seed, _, _ in second.inference.generated[::PROMPTS_PER_STEP]] == \
        list(range(3 + lag, STEPS))


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_a_finished_run_resumed_with_more_steps_trains_every_added_step_on_a_full_batch(runs, lag, logged):
    loop_once(config_for(runs, lag=lag, steps=3), FakePorts(reward=FakeReward(broken_sample)))
    longer = FakePorts(reward=FakeReward(broken_sample))
    loop_once(config_for(runs, lag=lag), longer)  # trainer.steps raised from 3 to STEPS
    rows = read_metrics(runs)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # Every added step trains on the batch's groups (before the fix: none, silently, at lag 1 and 2).
    assert all(r["groups"] == PROMPTS_PER_STEP for r in rows[3:]), [(r["step"], r["groups"]) for r in rows]
    # The batches the finished run never generated (3 .. 3 + lag - 1) come from the newest weights, version 3.
    generated = [batch_of(seed) for seed, _, _ in longer.inference.generated[::PROMPTS_PER_STEP]]
    assert generated == list(range(3, STEPS))
    if lag:
        assert any("trainer.steps raised from 3 to 6" in line for line in logged), logged


def test_a_run_that_crashed_between_checkpoints_repeats_the_lost_steps_exactly(uninterrupted, runs, logged):
    whole, whole_dir = uninterrupted(1)
    config = config_for(runs, interval=3)
    crashing = FakePorts(reward=FakeReward(broken_sample))

    def lose_the_trainer(step: int) -> None:
        if step == 4:
            raise FakeGroupError("trainer rank 0 lost")
    crashing.trainer.during_step = lose_the_trainer
    with pytest.raises(FakeGroupError, match="trainer rank 0 lost"):
        loop_once(config, crashing)
    assert [r["step"] for r in read_metrics(runs)] == [1, 2, 3, 4]  # step 4 was logged after checkpoint 3

    again = FakePorts(reward=FakeReward(broken_sample))
    loop_once(config, again)
    assert f"resumed from {runs / 'checkpoints' / 'step_3'} (step 3)" in logged
    assert outcome(runs) == outcome(whole_dir)
    assert again.trainer.weights == whole.trainer.weights


# -- held-out groups -------------------------------------------------------------------------------
def test_a_group_whose_reward_failed_is_held_out_of_training_and_counted(uninterrupted):
    ports, run_dir = uninterrupted(1)
    trained = {p for ids in ports.trainer.trained.values() for p in ids}
    assert "echo-train-4" not in trained and {"echo-train-3", "echo-train-5"} <= trained
    rows = read_metrics(run_dir)
    assert [r["groups"] for r in rows] == [3, 2, 3, 3, 3, 3]
    # Counted when scored: with a lag of 1, batch 1 is scored while step 0 trains.
    assert [r["groups_held_out_total"] for r in rows] == [1, 1, 1, 1, 1, 1]
    assert [r["reward_errors"] for r in rows] == [0, 1, 0, 0, 0, 0]
    assert rows[1]["reward_error_example"] == "echo-train-4/1: ValueError: the verifier could not parse the completion"


def test_a_step_whose_every_group_is_held_out_trains_nothing_and_still_advances_the_weights(runs):
    ports = FakePorts(reward=FakeReward(lambda sample_id: sample_id.split("/")[0] in prompt_ids(2)))
    loop_once(config_for(runs), ports)
    assert sorted(ports.trainer.trained) == [0, 1, 3, 4, 5]
    rows = read_metrics(runs)
    assert rows[2]["groups"] == 0 and rows[2]["reward_mean"] is None and "loss" not in rows[2]
    assert rows[2]["groups_held_out_total"] == PROMPTS_PER_STEP and rows[2]["weight_version"] == 3
    assert ("sync", 3) in ports.events and ports.inference.version == STEPS


# -- weight versions the controller did not push ---------------------------------------------------
def test_a_replica_that_missed_a_push_fails_the_loop_naming_the_batch_and_versions(runs):
    ports = FakePorts()
    ports.inference.ignored_versions = {2}
    with pytest.raises(ControllerError, match=r"batch 3 was generated with weight versions \[1\], expected 2 "
                                              r"\(at most 3\): the inference group missed a weight sync"):
        loop_once(config_for(runs, lag=1), ports)


def test_a_replica_reporting_a_version_never_pushed_fails_the_loop_before_training(runs):
    ports = FakePorts()
    ports.inference.claimed_version = 7
    with pytest.raises(ControllerError, match=r"batch 0 was generated with weight versions \[7\], expected 0"):
        loop_once(config_for(runs, lag=1), ports)
    assert ("train", 0, "begin") not in ports.events


# -- preemption ------------------------------------------------------------------------------------
def test_a_stop_request_checkpoints_after_the_step_in_progress_and_a_resume_finishes_the_run(uninterrupted, runs,
                                                                                             logged):
    whole, whole_dir = uninterrupted(1)
    config = config_for(runs)
    signalled: list[int] = []
    first = FakePorts(reward=FakeReward(broken_sample))
    first.trainer.during_step = lambda step: signalled.append(step) if step == 2 else None  # the signal, mid-step
    with pytest.raises(Preempted) as stopped:
        run(run_loop(config, first, stop_requested=lambda: bool(signalled)))
    assert stopped.value.step == 3 and first.trainer.version == 3
    assert logged[-1] == f"checkpoint {runs / 'checkpoints' / 'step_3'}"
    assert [r["step"] for r in read_metrics(runs)] == [1, 2, 3]

    second = FakePorts(reward=FakeReward(broken_sample))
    loop_once(config, second)
    assert outcome(runs) == outcome(whole_dir)
    assert second.trainer.weights == whole.trainer.weights


# -- BusPorts over a fake bus: replicas lost around a weight push ----------------------------------
PROBE = [Prompt(id=f"p{k}", text=f"say {k}:", answer=str(k)) for k in range(3)]


def bus_config(run_dir: Path) -> Config:
    """Two trainer ranks and two inference replicas (the in-memory ports ignore the layout)."""
    return config_for(run_dir, replicas=2, trainer_nodes=2)


async def connected(config: Config, **job_options) -> tuple[FakeJob, BusPorts]:
    """The real BusPorts over a fake job, connected, every replica on weight version 0."""
    head = FakeHead()
    job = FakeJob(config, head, **job_options)
    ports = BusPorts(config, head, store="tcp://127.0.0.1:29500")
    await ports.connect(timeout=5)
    await ports.sync_weights(0)
    return job, ports


def trained(job: FakeJob, version: int) -> None:
    """The trainer made weight version `version` (as a train step would: new weights, the counter)."""
    job.trainer.weights = [0.5 * version, -0.25 * version, 0.125]
    job.trainer.version = version


def assert_every_replica_serves(job: FakeJob, version: int) -> None:
    for replica, process in job.replicas.items():
        assert (replica, process.engine.version, process.engine.weights) == (replica, version, job.trainer.weights)


def versions_of(completions) -> set[int]:
    return {c.weight_version for group in completions for c in group}


@pytest.fixture
def no_retry_pause(monkeypatch):
    """BusPorts pauses between tries for a real head to notice a death; the fake head knows at once."""
    monkeypatch.setattr(ports_module, "RETRY_PAUSE_S", 0.0)


def test_a_replica_lost_before_a_push_gets_it_once_started_again_in_a_new_transfer_group(runs, no_retry_pause,
                                                                                          logged):
    async def scenario() -> None:
        job, ports = await connected(bus_config(runs), relaunch=False)
        lost = job.kill_replica(1)
        trained(job, 1)
        sync = asyncio.create_task(ports.sync_weights(1))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not sync.done()  # it waits for the lost replica to come back
        job.start_replica(1)
        await sync
        assert ports.current and ports.generation == 1
        assert_every_replica_serves(job, 1)
        assert lost.engine.version == 0
        assert "an inference replica was replaced: forming the weight-transfer group again" in logged
        assert logged[-1] == "inference replicas caught up to weight version 1"
        assert versions_of(await ports.generate(PROBE, n=2, seed=5)) == {1}
    run(scenario())


def test_a_replica_lost_during_a_push_is_caught_up_by_the_next_inference_call(runs, no_retry_pause, logged):
    async def scenario() -> None:
        job, ports = await connected(bus_config(runs))
        doomed = job.replicas[1]
        job.on_call = lambda process, endpoint, args: (
            job.kill_replica(1) if process is doomed and endpoint == "receive_weights" else None)
        trained(job, 1)
        await ports.sync_weights(1)  # does not fail the loop
        assert not ports.current and doomed.engine.version == 0
        assert any(line.startswith("weight version 1 did not reach the inference replicas") for line in logged)
        completions = await ports.generate(PROBE, n=2, seed=5)
        assert versions_of(completions) == {1}
        assert job.replicas[1] is not doomed and ports.generation == 1
        assert_every_replica_serves(job, 1)
        assert "inference replicas caught up to weight version 1" in logged
        sequences = [c.prompt_token_ids + c.token_ids for group in completions for c in group]
        assert await ports.inference_logprobs(sequences) == await ports.trainer_logprobs(sequences)
    run(scenario())


def test_a_replica_lost_after_a_push_loses_no_call_and_serves_again_only_once_caught_up(runs, no_retry_pause,
                                                                                        logged):
    async def scenario() -> None:
        job, ports = await connected(bus_config(runs))
        trained(job, 1)
        await ports.sync_weights(1)
        undisturbed = await ports.generate(PROBE, n=2, seed=5)
        doomed = job.replicas[1]
        job.on_call = lambda process, endpoint, args: (
            job.kill_replica(1) if process is doomed and endpoint == "generate" else None)
        assert await ports.generate(PROBE, n=2, seed=5) == undisturbed  # its chunk went to replica 0
        assert any(line.startswith("generate on inference/1/0 lost") for line in logged)
        restarted = job.replicas[1]
        assert restarted is not doomed and restarted.engine.version == 0
        assert await ports.generate(PROBE, n=2, seed=5) == undisturbed
        assert restarted.engine.generated == []  # not on the current weights: it serves nothing yet
        trained(job, 2)
        await ports.sync_weights(2)
        assert ports.generation == 1
        assert_every_replica_serves(job, 2)
        assert versions_of(await ports.generate(PROBE, n=2, seed=5)) == {2} and restarted.engine.generated
    run(scenario())



def test_a_lost_replica_that_never_comes_back_fails_the_push_after_run_rejoin_timeout_s(runs, no_retry_pause):
    from hpcrl.bus.errors import BusError

    derived = bus_config(runs)
    config = dataclasses.replace(derived, run=dataclasses.replace(derived.run, rejoin_timeout_s=0.3))

    async def scenario() -> None:
        job, ports = await connected(config, relaunch=False)
        assert BusPorts(derived, FakeHead(), store="tcp://127.0.0.1:29500").rejoin_timeout_s == 300
        job.kill_replica(1)
        trained(job, 1)
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(BusError, match="fewer than 2 replicas registered within 0.3 s"):
            await asyncio.wait_for(ports.sync_weights(1), 30)
        assert 0.3 <= loop.time() - began < 5
    run(scenario())

async def bus_run(config: Config, *, on_call=None) -> FakeJob:
    """run_loop over the real BusPorts and a fake job (`on_call(job)` makes the job's on_call)."""
    head = FakeHead()
    job = FakeJob(config, head, reward=FakeReward(broken_sample))
    if on_call is not None:
        job.on_call = on_call(job)
    ports = BusPorts(config, head, store="tcp://127.0.0.1:29500")
    await ports.connect(timeout=5)
    await run_loop(config, ports)
    return job


def test_the_loop_over_bus_ports_makes_the_same_steps_as_over_the_in_memory_ports(uninterrupted, runs):
    job = run(bus_run(bus_config(runs)))
    assert outcome(runs) == outcome(uninterrupted(1)[1])
    assert {process.replica for process in job.processes if process.engine.generated} == {0, 1}  # both served
    first, *later = read_metrics(runs)
    # When each group was ready (from the head's launch), the transfer group, the first sync: with the first step.
    parts = {f"startup_{p}_s" for p in ("trainer", "reward", "inference", "weights", "first_sync", "total")}
    assert parts <= set(first) and not any(k.startswith("startup_") for row in later for k in row)
    assert first["startup_trainer_s"] <= first["startup_inference_s"] <= first["startup_total_s"]
    # The prompts left out for length (none of a builtin task's) are reported once, with the first step.
    assert first["prompts_dropped_too_long"] == 0 and first["eval_prompts_dropped_too_long"] == 0
    assert not any("prompts_dropped_too_long" in row for row in later)


def test_the_loop_goes_on_unchanged_when_a_replica_is_lost_during_a_push(uninterrupted, runs, no_retry_pause,
                                                                          logged):
    def lose_replica_1_receiving_version_3(job: FakeJob):
        doomed = job.replicas[1]
        return lambda process, endpoint, args: (
            job.kill_replica(1) if process is doomed and endpoint == "receive_weights" and args["version"] == 3
            else None)
    job = run(bus_run(bus_config(runs), on_call=lose_replica_1_receiving_version_3))
    assert outcome(runs) == outcome(uninterrupted(1)[1])
    assert [p.engine.version for p in job.processes] == [STEPS, 2, STEPS]  # replica 0, the lost 1, the new 1
    assert "inference replicas caught up to weight version 3" in logged


def test_a_train_step_that_never_returns_while_every_rank_is_alive_fails_the_run_at_its_deadline(
        runs, monkeypatch):
    """Heartbeats cannot see ranks that are alive but deadlocked (a collective one rank never joins): the head
    gives each step 10 x the median of the recent ones (floor patched here to 0.5 s), then ends the attempt."""
    import fake_head

    from hpcrl.rl import deadline
    from hpcrl.rl.ports import StepStuck

    monkeypatch.setattr(deadline, "DEADLINE_FLOOR_S", 0.5)
    plain = fake_head.FakeTrainerRank.train_step

    async def deadlocked_at_step_5(self, args: dict) -> dict | None:
        if args["step"] == 5 and self.rank == 1:
            await asyncio.Event().wait()  # never: its bus thread stays alive, only the step hangs
        return await plain(self, args)

    monkeypatch.setattr(fake_head.FakeTrainerRank, "train_step", deadlocked_at_step_5)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(StepStuck, match=r"train step 5 did not finish within its deadline of 0.5 s \(10 x the "
                                            r"median of the last \d+ steps"):
            await bus_run(bus_config(runs))
        assert loop.time() - began < 8
    run(scenario(), timeout=20)


@pytest.mark.parametrize("times, expected", [
    ([], 600.0), ([0.2, 0.2], 600.0),                   # fewer than 3 steps timed: the call timeout
    ([0.2, 0.3, 0.25], 60.0),                          # tiny steps: the floor
    ([30.0, 31.0, 200.0, 29.0], 305.0),                # 10 x the median (30.5 s); one slow step moves it little
    ([100.0] * 5, 600.0),                              # never above the call timeout
])
def test_the_step_deadline_is_ten_times_the_recent_median_between_a_floor_and_the_call_timeout(times, expected):
    from hpcrl.rl.deadline import StepDeadline

    deadline = StepDeadline(ceiling_s=600.0)
    for seconds in times:
        deadline.observe(seconds)
    assert deadline.seconds() == pytest.approx(expected)


# -- evaluation on the held-out prompts ([eval]) -----------------------------------------------------
EVAL_PROMPTS = 10


def with_eval(config: Config, **keys) -> Config:
    """`config` evaluating on the first EVAL_PROMPTS prompts of builtin:echo's test split; `keys` are [eval] keys."""
    from hpcrl.config.schema import EvalConfig

    return dataclasses.replace(config, eval=EvalConfig(**{"interval": 2, **keys}),
                               data=dataclasses.replace(config.data, eval_source="builtin:echo",
                                                        eval_size=EVAL_PROMPTS))


def training(run_dir: Path) -> list[dict]:
    """outcome() of the training alone: no evaluation row nor figure."""
    return [{k: v for k, v in row.items() if not k.startswith("eval/")} for row in outcome(run_dir) if row["step"]]


def evaluations(run_dir: Path) -> list[dict]:
    """The eval/ figures of every row that has them, with its step, without the evaluation's wall time."""
    return [{"step": row["step"], **{k: v for k, v in row.items() if k.startswith("eval/") and k != "eval/time_s"}}
            for row in read_metrics(run_dir) if "eval/pass@1" in row]


def eval_versions(ports: FakePorts) -> dict[str, set[int]]:
    """Which weight versions generated for the evaluation prompts, by the seed of the call."""
    versions: dict[str, set[int]] = {}
    for seed, prompt, version in ports.inference.generated:
        if prompt.startswith("echo-test-"):
            versions.setdefault(str(seed), set()).add(version)
    return versions


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_a_run_with_evaluation_trains_exactly_as_the_same_run_without(uninterrupted, runs, lag):
    """The evaluation draws no prompt from the stream and no training seed and touches neither buffer nor
    trainer: every training figure and the final weights are the same, bit for bit, at every policy lag."""
    whole, whole_dir = uninterrupted(lag)
    ports = FakePorts(reward=FakeReward(broken_sample))
    loop_once(with_eval(config_for(runs, lag=lag), interval=2, n=4, k=2), ports)
    assert training(runs) == outcome(whole_dir)
    assert ports.trainer.weights == whole.trainer.weights
    assert [e for e in ports.events if len(e) == 2 or e[0] != "generate"] == whole.events  # the same calls, in order
    assert [r["step"] for r in evaluations(runs)] == [0, 2, 4, 6]


@pytest.mark.parametrize("lag", [0, 1])
def test_the_evaluation_after_step_s_uses_weight_version_s_and_its_figures_join_row_s(runs, lag):
    ports = FakePorts()
    config = with_eval(config_for(runs, lag=lag, steps=7), interval=3)  # 3, 6 and the last step, 7
    loop_once(config, ports)
    rows = read_metrics(runs)
    assert [r["step"] for r in rows] == list(range(8))  # row 0: the initial weights (eval.at_start)
    evaluated = [r["step"] for r in rows if "eval/pass@1" in r]
    assert evaluated == [0, 3, 6, 7]
    assert rows[0].keys() == {"step", "weight_version", "eval/pass@1", "eval/reward_mean", "eval/length_mean",
                              "eval/prompts", "eval/reward_errors", "eval/time_s"}
    # one greedy call per evaluation, each with the version the step made (just synced), its seed from the step
    from hpcrl.rl.evaluation import eval_seed
    assert eval_versions(ports) == {str(eval_seed(SEED, step)): {step} for step in evaluated}
    assert all(r["eval/prompts"] == EVAL_PROMPTS and r["eval/length_mean"] == 1.0 for r in rows if r["step"] in evaluated)
    # The fake policy learns to echo: greedy at the initial weights picks "0" (every digit ties), then the digit asked.
    answers = [p.answer for p in eval_set()]
    assert rows[0]["eval/pass@1"] == answers.count("0") / EVAL_PROMPTS < rows[7]["eval/pass@1"] == 1.0


def eval_set() -> list[Prompt]:
    """The evaluation prompts of with_eval's configs."""
    from hpcrl.config.schema import DataConfig
    from hpcrl.data.prompts import PromptStream

    return PromptStream.from_config(DataConfig(source="builtin:echo", eval_source="builtin:echo",
                                               eval_size=EVAL_PROMPTS)).eval_prompts()


def test_an_evaluation_sample_whose_reward_failed_is_counted_and_its_prompt_left_out_not_scored_zero(runs):
    ports = FakePorts(reward=FakeReward({"echo-test-2/0"}))  # prompt 2's greedy completion, and its first sample
    loop_once(with_eval(config_for(runs), interval=3, n=4, k=2), ports)
    for row in evaluations(runs):
        assert (row["eval/prompts"], row["eval/reward_errors"]) == (EVAL_PROMPTS - 1, 2), row
    assert evaluations(runs)[-1]["eval/pass@1"] == 1.0  # the nine scored prompts pass; a zero would make it 0.9


def test_an_evaluation_generated_with_other_weights_than_the_step_made_fails_the_loop(runs):
    ports = FakePorts()
    ports.inference.ignored_versions = {2}  # on-policy, batch 2 would be the first to show it: the evaluation is
    with pytest.raises(ControllerError, match=r"the evaluation after step 2 was generated with weight versions "
                                              r"\[1\], expected 2: the inference group missed a weight sync"):
        loop_once(with_eval(config_for(runs, lag=0), interval=2), ports)
    assert ("train", 2, "begin") not in ports.events


def test_a_resumed_run_repeats_the_evaluations_of_an_uninterrupted_one(runs, logged):
    config = with_eval(config_for(runs / "whole"), interval=2, n=4, k=3)
    loop_once(config, FakePorts())
    split = dataclasses.replace(config, run=dataclasses.replace(config.run, run_dir=str(runs / "split")))
    loop_once(split, FakePorts(), steps=3)
    assert [r["step"] for r in evaluations(runs / "split")] == [0, 2]
    second = FakePorts()
    loop_once(split, second)
    assert f"resumed from {runs / 'split' / 'checkpoints' / 'step_3'} (step 3)" in logged
    assert outcome(runs / "split") == outcome(runs / "whole")  # row 0 once, each evaluation's figures the same
    assert {v for vs in eval_versions(second).values() for v in vs} == {4, 6}  # the initial weights not again


def test_over_bus_ports_the_evaluation_is_shared_by_the_replicas_and_gives_the_in_memory_figures(runs):
    """The greedy and sampled calls cross the bus with their temperature, split between the replicas as a batch is."""
    loop_once(with_eval(config_for(runs / "memory"), interval=3, n=4, k=2), FakePorts(reward=FakeReward(broken_sample)))
    job = run(bus_run(with_eval(bus_config(runs / "bus"), interval=3, n=4, k=2)))
    assert outcome(runs / "bus") == outcome(runs / "memory")
    served = {p.replica for p in job.processes for _, prompt, _ in p.engine.generated if prompt.startswith("echo-test")}
    assert served == {0, 1}


def with_spares(config: Config) -> Config:
    """The same run in a split job holding a spare node (cluster.spare_nodes: the head revives reward tasks too)."""
    return dataclasses.replace(config, cluster=dataclasses.replace(config.cluster, layout="split", spare_nodes=1))


@pytest.mark.parametrize("spares", [True, False])
def test_a_score_call_that_finds_no_reward_task_waits_for_the_one_started_again_only_with_spare_nodes(
        runs, no_retry_pause, logged, spares):
    from hpcrl.bus.errors import NoHealthyReplicaError
    from hpcrl.contract.endpoints import RewardEndpoints
    from hpcrl.reward.types import Sample

    async def scenario() -> None:
        config = bus_config(runs)
        job, ports = await connected(with_spares(config) if spares else config)
        lost, = job.head.peers("reward")
        job.head.mark_dead(lost.name, "silent for 10.4 s (heartbeat_timeout 10.0 s)")  # its node lost power
        samples = [Sample(id=f"s{k}", prompt_id="p", prompt="say 7:", completion=str(k), answer="7") for k in (6, 7)]
        scoring = asyncio.create_task(ports.score(samples))
        if not spares:  # today's path: the loop fails, and the head requeues the job
            with pytest.raises(NoHealthyReplicaError):
                await scoring
            return
        for _ in range(20):
            await asyncio.sleep(0)
        assert not scoring.done()  # it waits for the reward task the head starts on a spare
        job.head.register(dataclasses.replace(lost, pid=lost.pid + 1, host="spare-node"),
                          {RewardEndpoints.score: job._score})
        results = await scoring
        assert [r.reward for r in results] == [r.reward for r in job.reward.score(samples)]
        assert "score: no reward task serves; waiting for the one started again" in logged
    run(scenario())
