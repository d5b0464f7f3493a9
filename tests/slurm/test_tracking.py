"""Job state from sacct or squeue output, hetjob rows (N+0, N+1, ...) included.

The squeue lines were recorded on tools/local_slurm.sh (Slurm 22.05, no accounting); the sacct
files in data/ are real `sacct --parsable2 -o JobID,State,ExitCode,NodeList,Elapsed` output recorded
on the accounting cluster of tools/local_slurm.sh (HPCRL_LOCAL_SLURM_ACCOUNTING=1, MariaDB + slurmdbd).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.slurm import tracking
from hpcrl.slurm.tracking import TERMINAL, overall_state, parse_sacct, parse_squeue

SQUEUE_HETJOB_DONE = "5+0|COMPLETED|n1|0:00\n5+1|COMPLETED|n[2-3]|0:00\n5+2|COMPLETED|n4|0:00\n5+3|COMPLETED|n5|0:00\n"
SQUEUE_CANCELLING = ("22+0|COMPLETING|n1|0:03\n22+1|COMPLETING|n[2-3]|0:03\n22+2|CANCELLED|n4|0:03\n"
                     "22+3|COMPLETING|n5|0:03\n")
SQUEUE_PLAIN = "31|RUNNING|n[1-4]|0:07\n"


def test_squeue_rows_of_a_hetjob_become_one_state_per_component():
    rows = parse_squeue(SQUEUE_HETJOB_DONE)
    assert [(r.component, r.state, r.nodes) for r in rows] == [
        (0, "COMPLETED", "n1"), (1, "COMPLETED", "n[2-3]"), (2, "COMPLETED", "n4"), (3, "COMPLETED", "n5")]
    assert overall_state([r.state for r in rows]) == "COMPLETED"


def test_a_plain_job_is_component_zero():
    rows = parse_squeue(SQUEUE_PLAIN)
    assert [(r.job_id, r.component, r.state) for r in rows] == [("31", 0, "RUNNING")]


def test_a_run_is_not_cancelled_until_every_component_has_ended():
    assert overall_state([r.state for r in parse_squeue(SQUEUE_CANCELLING)]) == "COMPLETING"
    assert overall_state(["CANCELLED"] * 4) == "CANCELLED"


@pytest.mark.parametrize("states, expected", [
    (["RUNNING", "RUNNING"], "RUNNING"),
    (["PENDING", "PENDING"], "PENDING"),
    (["FAILED", "COMPLETED", "COMPLETED"], "FAILED"),
    (["FAILED", "CANCELLED"], "FAILED"),
    (["NODE_FAIL", "CANCELLED"], "NODE_FAIL"),
    (["COMPLETED", "CANCELLED"], "CANCELLED"),
    ([], "UNKNOWN"),
])
def test_overall_state_prefers_failures_then_cancellation(states, expected):
    assert overall_state(states) == expected


def test_every_state_a_waiter_stops_on_is_terminal():
    assert {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "ENDED"} <= TERMINAL
    assert not {"RUNNING", "PENDING", "COMPLETING", "REQUEUED"} & TERMINAL


DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("name, expected, components", [
    ("sacct_hetjob_completed.txt", "COMPLETED", ["COMPLETED"] * 4),
    ("sacct_hetjob_failed.txt", "FAILED", ["FAILED"] * 4),
    ("sacct_hetjob_cancelled.txt", "CANCELLED", ["CANCELLED"] * 4),
])
def test_recorded_sacct_output_of_a_hetjob_gives_one_row_per_component_without_steps(name, expected, components):
    rows = parse_sacct((DATA / name).read_text())
    assert [r.component for r in rows] == [0, 1, 2, 3]
    assert [r.state for r in rows] == components  # "CANCELLED by 0" read as CANCELLED; .batch/.0 steps skipped
    assert overall_state([r.state for r in rows]) == expected
    assert rows[1].nodes == "n[2-3]"


def test_empty_sacct_output_means_no_rows_yet():
    assert parse_sacct("JobID|State|ExitCode|NodeList|Elapsed\n") == []
    assert parse_sacct("") == []


@pytest.mark.parametrize("states, expected", [
    (["COMPLETING", "PENDING", "RUNNING"], True),   # a node failed: Slurm requeues component by component
    (["RUNNING", "REQUEUED", "RUNNING", "RUNNING"], True),
    (["RUNNING", "RUNNING", "RUNNING"], False),     # running
    (["PENDING", "PENDING", "PENDING"], False),     # all back in the queue: nothing left to flag
    (["CANCELLED", "CANCELLED", "COMPLETING"], False),  # scancel
    (["COMPLETED", "PENDING", "PENDING"], False),  # half-requeued already: no component runs to flag
    ([], False),
])
def test_a_requeue_under_way_is_some_components_queued_while_others_still_run(states, expected):
    assert tracking.requeue_under_way(states) is expected
