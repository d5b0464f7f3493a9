"""The start-up clock: each part's seconds, and the process's age since its launch."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from hpcrl.rl.startup import StartupClock, process_age_s, startup_summary

pytestmark = [pytest.mark.timeout(60)]


def test_a_process_age_counts_from_its_launch_not_from_the_import():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        young = process_age_s(child.pid)
        assert 0 <= young < 5
        assert process_age_s() > young  # this test's process was launched before its child
        time.sleep(0.3)
        assert process_age_s(child.pid) >= young + 0.25
    finally:
        child.communicate(b"")


def test_timed_parts_are_recorded_also_when_they_raise_and_metrics_add_the_total():
    clock = StartupClock()
    assert clock.timed("trainer", lambda x: x * 2, 21) == 42
    with pytest.raises(ValueError):
        clock.timed("inference", lambda: (_ for _ in ()).throw(ValueError("no engine")))
    clock.record("first_sync", 0.125)
    metrics = clock.metrics()
    assert list(metrics) == ["startup_trainer_s", "startup_inference_s", "startup_first_sync_s", "startup_total_s"]
    assert metrics["startup_first_sync_s"] == 0.125 and metrics["startup_total_s"] > 0


def test_the_summary_line_names_every_part_and_the_launch_to_first_step():
    line = startup_summary({"step": 1, "startup_inference_s": 11.204, "startup_first_sync_s": 0.04,
                            "startup_total_s": 14.93, "time_train_s": 0.1})
    assert line == "start-up: 14.9 s from launch to the first step (inference 11.20 s, first sync 0.04 s)"
