"""Each requeue of a run's job, for `hpcrl status`: the head writes RUN_DIR/requeues.json at each start and
at each requeue it asks for.

    note_start(run_dir, restart=int(SLURM_RESTART_COUNT), node="n1")   # every head, as it starts
    note_requeue(run_dir, restart=..., why="trainer rank 1 lost: ...")  # a head that requeues its job
    describe_requeues(read_json(run_dir / REQUEUES_FILE))               # the lines `hpcrl status` prints

A requeue the head did not ask for (its node lost power, its process was killed, Slurm requeued the job)
leaves no word of its own: the next head's start, with a higher SLURM_RESTART_COUNT, shows it.
"""

from __future__ import annotations

import time
from pathlib import Path

from hpcrl.rundir import REQUEUES_FILE, read_json, write_json


def _read(run_dir: Path) -> dict:
    path = run_dir / REQUEUES_FILE
    record = read_json(path) if path.is_file() else {}
    return {"starts": list(record.get("starts", [])), "requeues": list(record.get("requeues", []))}


def note_start(run_dir: Path, *, restart: int, node: str, now: float | None = None) -> None:
    record = _read(run_dir)
    record["starts"].append({"restart": restart, "at": time.time() if now is None else now, "node": node})
    write_json(run_dir / REQUEUES_FILE, record)


def note_requeue(run_dir: Path, *, restart: int, why: str, now: float | None = None) -> None:
    """The head of start `restart` (SLURM_RESTART_COUNT) requeues its job, because of `why`."""
    record = _read(run_dir)
    record["requeues"].append({"restart": restart, "at": time.time() if now is None else now, "why": why})
    write_json(run_dir / REQUEUES_FILE, record)


def describe_requeues(record: dict) -> tuple[str, ...]:
    """One line per requeue (pure): when, why (the head's word, when it had one), and when the job ran again."""
    starts = {int(s["restart"]): s for s in record.get("starts", [])}
    asked = {int(r["restart"]): r for r in record.get("requeues", [])}
    clock = lambda t: time.strftime("%H:%M:%S", time.localtime(t))  # noqa: E731
    lines = []
    for number in sorted({k + 1 for k in asked} | {k for k in starts if k > 0}):
        before, after = asked.get(number - 1), starts.get(number)
        if before is not None:
            line = f"requeue {number} at {clock(before['at'])}: {before['why']}"
        else:
            line = f"requeue {number}: the head before it left no word (its node or process lost, or Slurm requeued)"
        if after is None:
            line += "; not running again yet"
        elif before is not None:
            line += f"; head running again at {clock(after['at'])} on {after['node']} ({after['at'] - before['at']:.1f} s later)"
        else:
            line += f"; head running again at {clock(after['at'])} on {after['node']}"
        lines.append(line)
    return tuple(lines)
