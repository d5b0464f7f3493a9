"""Run (or resume) the RL loop over any `Ports`: in one process (hpcrl run) or over the bus (the head).

    controller = await run_loop(config, ports)

Resumes from the newest complete checkpoint of the run directory (a corrupt or partial one is
reported and moved to checkpoints/corrupt/; when none verifies the run stops, see
checkpoint.on_unusable), rewinds metrics.jsonl to that step (or empties it), writes metrics.jsonl (and TensorBoard, and W&B when run.wandb_project is
set), logs a progress line per step (logger hpcrl.progress: on a terminal it rewrites itself, and
every tenth of the run it stays; a step evaluated ([eval]) shows its eval pass@1), and checkpoints
every trainer.checkpoint_interval steps and after the last one. The evaluation of the initial
weights (eval.at_start) is row 0 of metrics.jsonl. At the end it logs the reward curve and, when
the run evaluated, its eval pass@1 from first to last.
Ports must also offer `save_trainer(directory)` and `load_trainer(directory)`.
"""

from __future__ import annotations

import dataclasses
import logging

from hpcrl.config.schema import Config
from hpcrl.logs import PROGRESS
from hpcrl.rl.checkpointing import (
    TRAINER_DIR,
    load_run_state,
    newest_checkpoint,
    rewind_metrics,
    save_checkpoint,
    store_for,
)
from hpcrl.rl.controller import Controller
from hpcrl.rl.metrics import MetricsLog, WandbTarget, eval_summary, read_metrics, reward_curve
from hpcrl.rl.startup import startup_summary

log = logging.getLogger(__name__)
progress = logging.getLogger(PROGRESS)
#: Progress lines that stay on a terminal over a run, besides the first step's (its time is the warm-up).
KEPT_LINES = 10


def progress_line(metrics: dict, total: int | None = None) -> str:
    def num(key: str, fmt: str) -> str:
        value = metrics.get(key)
        return "-" if value is None else format(value, fmt)
    of = f"/{total}" if total else ""
    # A step evaluated ([eval]) shows its pass@1 and what the evaluation took.
    evaluated = f"  eval pass@1 {num('eval/pass@1', '.3f')} ({num('eval/time_s', '.2f')}s)" \
        if "eval/pass@1" in metrics else ""
    if metrics["step"] == 0:  # the evaluation of the initial weights (eval.at_start), before step 1
        return f"step {0:>4}{of}  initial weights{evaluated}"
    return (f"step {metrics['step']:>4}{of}  reward {num('reward_mean', '.3f')}  loss {num('loss', '+.4f')}  "
            f"mismatch {num('logprob_mismatch', '.1e')}  gen {num('time_generate_s', '.2f')}s  "
            f"train {num('time_train_s', '.2f')}s  sync {num('time_weight_sync_s', '.2f')}s{evaluated}")


class _StopAfter(Exception):
    """Ends a run early after `steps` (tests and smoke runs)."""


class Preempted(Exception):
    """The run was asked to stop (the pre-timeout signal): it checkpointed after `step` and stopped."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped after step {step}, checkpointed")
        self.step = step


def wandb_target(config: Config) -> WandbTarget | None:
    """Where W&B metrics go, or None when the run names no W&B project."""
    run = config.run
    if not run.wandb_project:
        return None
    return WandbTarget(project=run.wandb_project, entity=run.wandb_entity, mode=run.wandb_mode, name=run.name,
                       config=dataclasses.asdict(config))


def kept(step: int, last: int) -> bool:
    """Whether the progress line of `step` stays on a terminal: every last/KEPT_LINES-th, and the last."""
    return step >= last or step % max(1, round(last / KEPT_LINES)) == 0


async def run_loop(config: Config, ports, *, steps: int | None = None,
                   stop_requested=None, on_resumed=None) -> Controller:
    """See the module docstring. `stop_requested()`, checked after every step, makes the loop
    checkpoint at once and raise Preempted (the head's answer to Slurm's pre-timeout signal);
    `on_resumed(step)` is called once the trainer holds the checkpoint it resumed from (0: none)."""
    controller = Controller(config, ports, startup=getattr(ports, "startup", None))
    store = store_for(config)
    found = newest_checkpoint(config, store)  # raises when none verifies, unless checkpoint.on_unusable
    store.set_aside(store.skipped)  # never usable: out of the way of pruning and of every later start
    if found is not None:
        await ports.load_trainer(found.path / TRAINER_DIR)
        controller.restore(load_run_state(found, config))
        log.info(f"resumed from {found.path} (step {found.step})")
    if on_resumed is not None:
        on_resumed(found.step if found is not None else 0)
    rewind_metrics(config, found.step if found is not None else 0)
    metrics_log = MetricsLog(config.run_dir, wandb=wandb_target(config))
    interval = config.trainer.checkpoint_interval
    total = config.trainer.steps
    last = steps if steps is not None else total
    shown = 0

    async def on_step(ctl: Controller, metrics: dict) -> None:
        nonlocal shown
        metrics_log.write(metrics)
        step = metrics["step"]
        if "startup_total_s" in metrics:
            log.info(startup_summary(metrics))
        stopping = stop_requested is not None and stop_requested()
        # On a terminal the line stays for this process's first step (the warm-up), every tenth of
        # the run, and a stop; the others are rewritten by the next.
        progress.info(progress_line(metrics, total), extra={"keep": shown == 0 or stopping or kept(step, last)})
        shown += 1
        if (interval and step % interval == 0) or step in (total, last) or stopping:
            path = await save_checkpoint(store, config, ctl.snapshot(), ports.save_trainer)
            log.info(f"checkpoint {path}")
        if step >= last:
            raise _StopAfter()
        if stopping:
            raise Preempted(step)

    async def on_eval(ctl: Controller, metrics: dict) -> None:
        """The evaluation of the initial weights (eval.at_start): row 0 of metrics.jsonl, a line that stays."""
        metrics_log.write(metrics)
        progress.info(progress_line(metrics, total), extra={"keep": True})

    controller.on_step = on_step
    controller.on_eval = on_eval
    try:
        await controller.run()
    except _StopAfter:
        pass
    finally:
        metrics_log.close()
    rows = read_metrics(config.run_dir)
    log.info(reward_curve(rows))
    evaluated = eval_summary(rows)
    if evaluated is not None:
        log.info(evaluated)
    return controller
