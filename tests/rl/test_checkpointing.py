"""Starting a run over checkpoints it cannot use, and metrics.jsonl on every start: the real run_loop over
in-memory groups (fake_ports.py), in milliseconds."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
from fake_config import fake_config
from fake_ports import FakeGroupError, FakePorts

from hpcrl.config.schema import CheckpointConfig, Config
from hpcrl.rl.checkpointing import UnusableCheckpoints, refuse_unusable_checkpoints
from hpcrl.rl.loop import run_loop
from hpcrl.rl.metrics import read_metrics


def config_for(run_dir: Path, *, interval: int = 3, on_unusable: str = "stop") -> Config:
    config = fake_config(run_dir, run_name="fake-run", seed=3, steps=6, prompts_per_step=3, group_size=4,
                         interval=interval)
    return dataclasses.replace(config, checkpoint=CheckpointConfig(on_unusable=on_unusable))


def loop_once(config: Config, ports: FakePorts, **kwargs) -> None:
    asyncio.run(asyncio.wait_for(run_loop(config, ports, **kwargs), 10.0))


def steps_of(run_dir: Path) -> list[int]:
    return [row["step"] for row in read_metrics(run_dir)]


def without_times(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not (k.startswith(("time_", "startup_")) or k.endswith("_per_s"))}
            for row in read_metrics(run_dir)]


def corrupt(checkpoint: Path) -> None:
    """A checkpoint damaged after it was written: its run state has bytes its manifest does not."""
    with open(checkpoint / "run_state.json", "a") as handle:
        handle.write(" ")


@pytest.fixture
def broken_run(tmp_path: Path) -> Path:
    """A run directory of 6 steps (checkpoints at steps 3 and 6) whose both checkpoints are corrupt."""
    loop_once(config_for(tmp_path), FakePorts())
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_3", "step_6"]
    for step in (3, 6):
        corrupt(checkpoints / f"step_{step}")
    return tmp_path


def test_a_run_whose_every_checkpoint_is_corrupt_stops_naming_each_one_and_the_key_to_start_over(broken_run):
    """It trained from step 0 after a warning, and pruning then deleted each new checkpoint."""
    before = (broken_run / "metrics.jsonl").read_text()
    ports = FakePorts()
    with pytest.raises(UnusableCheckpoints) as stopped:
        loop_once(config_for(broken_run), ports)
    message = str(stopped.value)
    assert f"{broken_run / 'checkpoints'} holds 2 checkpoint(s) and none of them verifies" in message
    for step in (6, 3):
        assert f"step_{step}: {broken_run / 'checkpoints' / f'step_{step}' / 'run_state.json'} is truncated or " \
               "altered" in message
    assert 'checkpoint.on_unusable = "start_over"' in message and "--set checkpoint.on_unusable=start_over" in message
    assert ports.events == []  # nothing ran
    assert sorted(p.name for p in (broken_run / "checkpoints").iterdir()) == ["step_3", "step_6"]
    assert (broken_run / "metrics.jsonl").read_text() == before


def test_the_head_refuses_a_run_whose_every_checkpoint_has_a_file_of_the_wrong_size_before_any_group_starts(broken_run):
    """Before any group starts (it would be requeued after each start otherwise), by file sizes alone."""
    with pytest.raises(UnusableCheckpoints, match="holds 2 checkpoint"):
        refuse_unusable_checkpoints(config_for(broken_run))
    refuse_unusable_checkpoints(config_for(broken_run, on_unusable="start_over"))  # the loop starts over
    refuse_unusable_checkpoints(config_for(broken_run.parent / "fresh"))  # no checkpoint: nothing to refuse


def test_starting_over_sets_the_corrupt_checkpoints_aside_and_keeps_the_new_ones(broken_run):
    """The issue's repro through the loop: the run starts over and stops after step 2; its checkpoint
    must survive the corrupt step_3 and step_6, and metrics.jsonl hold steps 1 and 2 only."""
    loop_once(config_for(broken_run, on_unusable="start_over"), FakePorts(), steps=2)
    checkpoints = broken_run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["corrupt", "step_2"]
    assert sorted(p.name for p in (checkpoints / "corrupt").iterdir()) == ["step_3", "step_6"]
    assert "is truncated or altered" in (checkpoints / "corrupt" / "step_6" / "REASON.txt").read_text()
    assert steps_of(broken_run) == [1, 2]
    resumed = FakePorts()
    loop_once(config_for(broken_run), resumed)  # the next start resumes from step 2, with the default "stop"
    assert resumed.events[0] == ("sync", 2)
    assert steps_of(broken_run) == [1, 2, 3, 4, 5, 6]


def test_a_start_from_step_0_drops_the_rows_of_a_run_that_never_checkpointed(tmp_path: Path):
    """Its rows, and a torn last line, stayed: the new rows restarted at step 1 after them, and the first
    was glued to the torn line."""
    whole = tmp_path / "whole"
    loop_once(config_for(whole, interval=0), FakePorts())
    crashing = FakePorts()

    def lose_the_trainer(step: int) -> None:
        if step == 3:
            raise FakeGroupError("trainer rank 0 lost")
    crashing.trainer.during_step = lose_the_trainer
    run_dir = tmp_path / "crashed"
    with pytest.raises(FakeGroupError):
        loop_once(config_for(run_dir, interval=0), crashing)
    assert steps_of(run_dir) == [1, 2, 3] and not (run_dir / "checkpoints").exists()
    with open(run_dir / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 4, "rew')  # the head was killed writing step 4's row
    loop_once(config_for(run_dir, interval=0), FakePorts())
    assert without_times(run_dir) == without_times(whole)
