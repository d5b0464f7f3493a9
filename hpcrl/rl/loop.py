"""Run (or resume) the GRPO loop over any `Ports`: in one process (hpcrl run) or over the bus (the head).

    controller = await run_loop(config, ports, log=print)

Resumes from the newest complete checkpoint of the run directory (a corrupt or partial one is
reported and skipped), writes metrics.jsonl (and TensorBoard, and W&B when run.wandb_project is
set), prints a progress line per step, and checkpoints every trainer.checkpoint_interval steps and
after the last one.
Ports must also offer `save_trainer(directory)` and `load_trainer(directory)`.
"""

from __future__ import annotations

import dataclasses

from hpcrl.config.schema import Config
from hpcrl.rl.checkpointing import TRAINER_DIR, load_run_state, newest_checkpoint, rewind_metrics, save_checkpoint, \
    store_for
from hpcrl.rl.controller import Controller
from hpcrl.rl.metrics import MetricsLog, WandbTarget, read_metrics, reward_curve


def progress_line(metrics: dict, total: int | None = None) -> str:
    def num(key: str, fmt: str) -> str:
        value = metrics.get(key)
        return "-" if value is None else format(value, fmt)
    of = f"/{total}" if total else ""
    return (f"step {metrics['step']:>4}{of}  reward {num('reward_mean', '.3f')}  loss {num('loss', '+.4f')}  "
            f"mismatch {num('logprob_mismatch', '.1e')}  gen {num('time_generate_s', '.2f')}s  "
            f"train {num('time_train_s', '.2f')}s  sync {num('time_weight_sync_s', '.2f')}s")


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


async def run_loop(config: Config, ports, *, log=print, steps: int | None = None,
                   stop_requested=None) -> Controller:
    """See the module docstring. `stop_requested()`, checked after every step, makes the loop
    checkpoint at once and raise Preempted (the head's answer to Slurm's pre-timeout signal)."""
    controller = Controller(config, ports)
    store = store_for(config)
    found = newest_checkpoint(config, log=log)
    if found is not None:
        await ports.load_trainer(found.path / TRAINER_DIR)
        controller.restore(load_run_state(found, config))
        rewind_metrics(config, found.step)
        log(f"resumed from {found.path} (step {found.step})")
    metrics_log = MetricsLog(config.run_dir, wandb=wandb_target(config))
    interval = config.trainer.checkpoint_interval
    total = config.trainer.steps
    last = steps if steps is not None else total

    async def on_step(ctl: Controller, metrics: dict) -> None:
        metrics_log.write(metrics)
        log(progress_line(metrics, total))
        step = metrics["step"]
        stopping = stop_requested is not None and stop_requested()
        if (interval and step % interval == 0) or step in (total, last) or stopping:
            path = await save_checkpoint(store, config, ctl.snapshot(), ports.save_trainer)
            log(f"checkpoint {path}")
        if step >= last:
            raise _StopAfter()
        if stopping:
            raise Preempted(step)

    controller.on_step = on_step
    try:
        await controller.run()
    except _StopAfter:
        pass
    finally:
        metrics_log.close()
    log(reward_curve(read_metrics(config.run_dir)))
    return controller
