"""metrics.jsonl: one line per step, torn lines ignored, truncation on resume."""

from pathlib import Path

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


def test_truncate_after_forgets_steps_past_the_checkpoint(tmp_path: Path):
    log = MetricsLog(tmp_path, tensorboard=False)
    for step in range(1, 6):
        log.write({"step": step})
    log.truncate_after(3)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_tensorboard_events_are_written_when_available(tmp_path: Path):
    log = MetricsLog(tmp_path)
    log.write({"step": 1, "loss": 0.25})
    log.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_the_reward_curve_shows_moving_means_and_the_best_step():
    from hpcrl.rl.metrics import reward_curve

    rows = [{"step": s, "reward_mean": 0.0 if s <= 10 else 1.0} for s in range(1, 31)]
    text = reward_curve(rows, window=10, points=3)
    lines = text.splitlines()
    assert lines[0] == "reward curve (10-step mean): best 1.000 at step 20"
    assert [line.split()[1] for line in lines[1:]] == ["10", "20", "30"]
    assert lines[1].split()[2] == "0.000" and lines[2].endswith("#" * 40)
    assert reward_curve([]) == "reward curve: no step has a reward yet"
