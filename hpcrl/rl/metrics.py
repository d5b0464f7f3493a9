"""Per-step metrics of a run: metrics.jsonl in the run directory, TensorBoard when installed, and
Weights & Biases when the run names a project (`run.wandb_project`).

    log = MetricsLog(run_dir, wandb=WandbTarget(project="hpcrl", name="tiny-grpo"))
    log.write({"step": 3, "reward_mean": 0.4, ...})
    log.truncate_after(step=2)   # on resume: forget steps the checkpoint does not contain

One JSON object per line, flushed and fsynced per step, so a crash loses at most the line being
written. A torn line never hides the rows after it: the writer starts on a fresh line when the file
does not end with one, `truncate_after` (on every start) drops a torn line, and `read_metrics`
skips any line that is not a JSON object.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hpcrl.errors import ConfigError
from hpcrl.fsio import write_atomic

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_id"

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class WandbTarget:
    """Where a run's W&B metrics go (see RunConfig.wandb_*)."""

    project: str
    name: str
    entity: str = ""
    mode: Literal["online", "offline"] = "online"
    config: dict = field(default_factory=dict)
    """The run's configuration, shown beside its curves."""


def _wandb_run(run_dir: Path, target: WandbTarget):
    """Start (or, after a requeue, resume) the run's W&B run. Its id is kept in run_dir/wandb_id,
    so every incarnation of the job logs to the same W&B run. Steps re-run after a resume are
    not logged again (W&B keeps the steps it has; a resumed run repeats them bit for bit)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(key="run.wandb_project", problem=f"is {target.project!r} but wandb is not installed "
                          "in the head's Python", fix="pip install wandb (or pip install 'hpcrl[wandb]'), or "
                          "remove run.wandb_project") from None
    id_file = run_dir / WANDB_ID_FILE
    if id_file.exists():
        run_id = id_file.read_text().strip()
    else:
        run_id = f"{target.name}-{secrets.token_hex(4)}"
        write_atomic(id_file, run_id + "\n")
    return wandb.init(project=target.project, entity=target.entity or None, name=target.name, id=run_id,
                      resume="allow", dir=str(run_dir), mode=target.mode, config=target.config,
                      settings=wandb.Settings(silent=True, console="off"))


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every row of run_dir/metrics.jsonl. A line that is not a JSON object (torn by a crash, or
    glued to the next row by an older writer) is skipped, with a warning unless it is the last,
    and the rows after it are read."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    rows = []
    lines = path.read_text(errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif number < len(lines) and line.strip():
            log.warning(f"{path}:{number} is not a JSON object (a torn write?): skipped: {line[:80]!r}")
    return rows


def _ends_torn(path: Path) -> bool:
    """Whether `path` exists, is not empty and does not end with a newline."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            if handle.tell() == 0:
                return False
            handle.seek(-1, os.SEEK_END)
            return handle.read(1) != b"\n"
    except FileNotFoundError:
        return False


class MetricsLog:
    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, wandb: WandbTarget | None = None) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A crash mid-write leaves a line without its newline: the next row must not be glued to it.
        self._torn_tail = _ends_torn(self.path)
        self._wandb = _wandb_run(self.path.parent, wandb) if wandb is not None else None
        self._tb: Any = None
        if tensorboard:
            # TensorBoard's own event writer, not torch's SummaryWriter around it: importing
            # torch.utils.tensorboard imports torch, 3 s of CPU at every start of a head that
            # otherwise never needs torch (tensorboard alone: 0.3 s).
            try:
                from tensorboard.summary.writer.event_file_writer import EventFileWriter
            except ImportError:  # tensorboard is optional; metrics.jsonl is the record
                pass
            else:
                self._tb = EventFileWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with open(self.path, "a") as handle:
            handle.write(("\n" if self._torn_tail else "") + json.dumps(clean, sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        self._torn_tail = False
        if self._tb is None and self._wandb is None:
            return
        step = int(row["step"])
        scalars = {key: value for key, value in clean.items()
                   if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
        if self._tb is not None:
            self._tb_write(scalars, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def _tb_write(self, scalars: dict[str, float], step: int) -> None:
        """The step's scalars as one TensorBoard event (a Summary of one value per tag), then flushed.

        The head writes these between a weight sync and the next batch's generation, on the loop's
        critical path. One event per step, not one per tag: an event per tag goes through the
        writer thread's queue of 10, which blocks once full (33 scalars cost 1.4 ms a step, one
        event 0.25 ms, measured with torch's SummaryWriter.add_scalar). Each value is what
        add_scalar writes (tag, simple_value), so TensorBoard reads both alike."""
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        assert self._tb is not None
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(number)) for tag, number in scalars.items()])
        self._tb.add_event(Event(wall_time=time.time(), step=step, summary=summary))
        self._tb.flush()

    def truncate_after(self, step: int) -> None:
        """Keep only rows with row["step"] <= step, dropping torn lines (atomically: temp file, fsync, rename)."""
        rows = [r for r in read_metrics(self.path.parent) if int(r.get("step", 0)) <= step]
        write_atomic(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
        self._torn_tail = False

    def close(self) -> None:
        """Flush and close every target. W&B's data is on disk (offline) or sent when this returns:
        run.finish() only waits for W&B's service to take the run's end, the service writes the
        rest later (at interpreter exit otherwise, which a job's supervisor may cut short), so its
        service is torn down here too: the run is over, and a later run starts a new one."""
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            import wandb
            self._wandb.finish()
            wandb.teardown()
            self._wandb = None


def reward_curve(rows: list[dict], *, window: int = 10, points: int = 20) -> str:
    """The reward curve as text: the `window`-step mean reward at up to `points` steps, and its best."""
    rewards = [(r["step"], r["reward_mean"]) for r in rows if r.get("reward_mean") is not None]
    if not rewards:
        return "reward curve: no step has a reward yet"
    means = []
    for i in range(len(rewards)):
        chunk = [v for _, v in rewards[max(0, i - window + 1):i + 1]]
        means.append((rewards[i][0], sum(chunk) / len(chunk)))
    stride = max(1, -(-len(means) // points))
    shown = means[stride - 1::stride]
    if shown[-1] != means[-1]:
        shown.append(means[-1])
    best_step, best = max(means, key=lambda m: m[1])
    lines = [f"reward curve ({window}-step mean): best {best:.3f} at step {best_step}"]
    lines += [f"  step {step:>5}  {mean:5.3f}  {'#' * round(mean * 40)}" for step, mean in shown]
    return "\n".join(lines)



def _pass_keys(rows: list[dict]) -> list[str]:
    """The eval/pass@K keys of `rows`, pass@1 first, then by K."""
    keys = {k for r in rows for k in r if k.startswith("eval/pass@")}
    return sorted(keys, key=lambda k: int(k.removeprefix("eval/pass@")))


def eval_summary(rows: list[dict], *, points: int = 20) -> str | None:
    """The run's evaluations as text (hpcrl.rl.evaluation): eval/pass@1 from the first to the last and its
    best, then up to `points` evaluations with their figures; None when the run evaluated nothing."""
    evals = [r for r in rows if "eval/pass@1" in r]
    if not evals:
        return None
    keys = _pass_keys(evals)

    def num(value, fmt: str = ".3f") -> str:
        return "-" if value is None else format(value, fmt)
    first, last = evals[0], evals[-1]
    scored = [r for r in evals if r["eval/pass@1"] is not None]
    best = f", best {num(max(scored, key=lambda r: r['eval/pass@1'])['eval/pass@1'])} at step " \
           f"{max(scored, key=lambda r: r['eval/pass@1'])['step']}" if scored else ""
    lines = [f"eval pass@1 ({last.get('eval/prompts', '?')} prompts): {num(first['eval/pass@1'])} at step "
             f"{first['step']} -> {num(last['eval/pass@1'])} at step {last['step']}{best}"]
    stride = max(1, -(-len(evals) // points))
    shown = evals[::stride]
    if shown[-1] is not last:
        shown.append(last)
    for r in shown:
        figures = "  ".join(f"{k.removeprefix('eval/')} {num(r.get(k))}" for k in keys)
        lines.append(f"  step {r['step']:>5}  {figures}  reward {num(r.get('eval/reward_mean'))}  "
                     f"length {num(r.get('eval/length_mean'), '.1f')}  {num(r.get('eval/time_s'), '.1f')} s")
    return "\n".join(lines)
