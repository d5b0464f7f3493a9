"""metrics.jsonl: one line per step, torn lines skipped and never glued to the next, truncation on every start."""

import json
import sys
from pathlib import Path

import pytest

from hpcrl.rl.metrics import MetricsLog, read_metrics


def test_rows_are_appended_and_non_finite_numbers_become_null(tmp_path: Path):
    log = MetricsLog(tmp_path, tensorboard=False)
    log.write({"step": 1, "reward_mean": 0.5})
    log.write({"step": 2, "reward_mean": float("nan")})
    assert read_metrics(tmp_path) == [{"step": 1, "reward_mean": 0.5}, {"step": 2, "reward_mean": None}]


def test_a_torn_last_line_is_ignored(tmp_path: Path):
    log = MetricsLog(tmp_path, tensorboard=False)
    log.write({"step": 1})
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 2, "rew')
    assert read_metrics(tmp_path) == [{"step": 1}]


def test_a_row_written_after_a_torn_line_starts_on_a_fresh_line_and_is_read(tmp_path: Path):
    """A head killed mid-write leaves a line without its newline; the next head's first row was glued to
    it, and the reader stopped there: every later row was hidden."""
    MetricsLog(tmp_path, tensorboard=False).write({"step": 1})
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 2, "rew')
    log = MetricsLog(tmp_path, tensorboard=False)  # the next incarnation, with no rewind before it
    log.write({"step": 2})
    log.write({"step": 3})
    assert read_metrics(tmp_path) == [{"step": 1}, {"step": 2}, {"step": 3}]
    assert (tmp_path / "metrics.jsonl").read_text().splitlines()[1] == '{"step": 2, "rew'


def test_rows_after_a_line_that_is_not_json_are_read(tmp_path: Path, caplog):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "rew{"step": 1}\n{"step": 2}\n[3]\n{"step": 3}\n')
    assert read_metrics(tmp_path) == [{"step": 1}, {"step": 2}, {"step": 3}]
    assert "metrics.jsonl:2 is not a JSON object" in caplog.text and "metrics.jsonl:4" in caplog.text


def test_truncate_after_forgets_steps_past_the_checkpoint(tmp_path: Path):
    log = MetricsLog(tmp_path, tensorboard=False)
    for step in range(1, 6):
        log.write({"step": step})
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 6, "rew')  # torn by a crash: dropped, so the next row starts a line
    log.truncate_after(3)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert (tmp_path / "metrics.jsonl").read_text().endswith('{"step": 3}\n')
    log.truncate_after(0)  # a start from scratch
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_tensorboard_shows_every_numeric_metric_of_every_step(tmp_path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path)
    log.write({"step": 1, "loss": 0.25, "groups": 8, "reward_mean": None, "note": "x", "stale": True})
    log.write({"step": 2, "loss": -0.5, "groups": 7, "reward_mean": 0.75})
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["groups", "loss", "reward_mean"]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.25), (2, -0.5)]
    assert [(e.step, e.value) for e in events.Scalars("groups")] == [(1, 8.0), (2, 7.0)]
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(2, 0.75)]


def test_the_reward_curve_shows_moving_means_and_the_best_step():
    from hpcrl.rl.metrics import reward_curve

    rows = [{"step": s, "reward_mean": 0.0 if s <= 10 else 1.0} for s in range(1, 31)]
    text = reward_curve(rows, window=10, points=3)
    lines = text.splitlines()
    assert lines[0] == "reward curve (10-step mean): best 1.000 at step 20"
    assert [line.split()[1] for line in lines[1:]] == ["10", "20", "30"]
    assert lines[1].split()[2] == "0.000" and lines[2].endswith("#" * 40)
    assert reward_curve([]) == "reward curve: no step has a reward yet"


def wandb_history(run_file: Path) -> list[dict]:
    """The history rows W&B wrote to a run's .wandb file (its LevelDB-style record log, read
    here so that the test sees what `wandb sync` would upload)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos = run_file.read_bytes(), 32768, 7
    assert data[:4] == b":W&B", "not a W&B run file"
    records, pending = [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
    rows = []
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_") or k == "_step"})
    return rows


def test_every_step_goes_to_weights_and_biases_and_a_resumed_run_keeps_its_wandb_run(tmp_path: Path):
    pytest.importorskip("wandb")  # installed by tools/setup_env.sh (the [wandb] extra)
    from hpcrl.rl.metrics import WandbTarget

    target = WandbTarget(project="hpcrl-test", name="tiny", mode="offline", config={"trainer": {"lr": 1e-3}})
    log = MetricsLog(tmp_path, tensorboard=False, wandb=target)
    log.write({"step": 1, "reward_mean": 0.25, "loss": 1.5, "note": "text is not a metric"})
    log.write({"step": 2, "reward_mean": float("nan"), "loss": 1.25})
    log.close()
    run_id = (tmp_path / "wandb_id").read_text().strip()
    first = list(tmp_path.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(first) == 1
    assert wandb_history(first[0]) == [{"_step": 1, "reward_mean": 0.25, "loss": 1.5},
                                       {"_step": 2, "loss": 1.25}]
    # The job is requeued: the new head logs to the same W&B run.
    log = MetricsLog(tmp_path, tensorboard=False, wandb=target)
    log.write({"step": 3, "reward_mean": 0.75})
    log.close()
    assert (tmp_path / "wandb_id").read_text().strip() == run_id
    files = sorted(tmp_path.glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb"))  # "-1" if in the same second
    assert {"_step": 3, "reward_mean": 0.75} in [row for f in files for row in wandb_history(f)]


def test_a_wandb_project_without_wandb_installed_is_a_clear_error(tmp_path: Path, monkeypatch):
    from hpcrl.errors import ConfigError
    from hpcrl.rl.metrics import WandbTarget

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError, match="wandb is not installed") as err:
        MetricsLog(tmp_path, wandb=WandbTarget(project="p", name="n"))
    assert "run.wandb_project" in str(err.value)
    assert not (tmp_path / "metrics.jsonl").exists() or (tmp_path / "metrics.jsonl").read_text() == ""
