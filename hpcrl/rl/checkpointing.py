"""The head's side of checkpoints: what a step's checkpoint holds, and resuming from the newest one.

    step_N/
      trainer/          model + optimizer of every trainer rank (torch.distributed.checkpoint, sharded)
      run_state.json    the controller's state (step, batches generated, prompt cursor, scored
                        batches not trained on yet), the config's seed and run name
      MANIFEST.json     written last (hpcrl.ckpt.store)

The trainer group writes `trainer/` itself (every rank its shards, in parallel); the head writes
`run_state.json` and seals the directory. On resume, metrics.jsonl is cut back to the checkpoint's
step so a resumed run's metrics continue exactly where the checkpoint left them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from hpcrl.ckpt import CheckpointError, CheckpointStore, FoundCheckpoint, write_atomic
from hpcrl.config.schema import Config
from hpcrl.rl.metrics import MetricsLog

RUN_STATE = "run_state.json"
TRAINER_DIR = "trainer"

SaveTrainer = Callable[[Path], Awaitable[None]]

log = logging.getLogger(__name__)


def store_for(config: Config) -> CheckpointStore:
    return CheckpointStore(Path(config.run_dir) / "checkpoints", keep_last=config.trainer.keep_last)


async def save_checkpoint(store: CheckpointStore, config: Config, state: dict, save_trainer: SaveTrainer) -> Path:
    """Write step `state["step"]`'s checkpoint: trainer shards, run state, manifest last."""
    step = int(state["step"])
    staging = store.staging(step)
    await save_trainer(staging / TRAINER_DIR)
    run_state = {"run": config.run.name, "seed": config.run.seed, "controller": state}
    write_atomic(staging / RUN_STATE, json.dumps(run_state, sort_keys=True).encode())
    return store.commit(step, meta={"step": step, "weight_version": step})


def load_run_state(found: FoundCheckpoint, config: Config) -> dict:
    """The controller state of a found checkpoint, refusing one of another run or seed."""
    path = found.path / RUN_STATE
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is unreadable ({err})") from None
    if data.get("run") != config.run.name or data.get("seed") != config.run.seed:
        raise CheckpointError(f"{path} belongs to run {data.get('run')!r} with seed {data.get('seed')}, not "
                              f"{config.run.name!r} with seed {config.run.seed}. Fix: resume with the run's config, "
                              "or give this run its own run_dir")
    return data["controller"]


def newest_checkpoint(config: Config) -> FoundCheckpoint | None:
    """The newest complete checkpoint of the run; skipped ones are logged as warnings."""
    store = store_for(config)
    found = store.latest()
    for path, why in store.skipped:
        log.warning(f"checkpoint {path} skipped: {why}")
    return found


def rewind_metrics(config: Config, step: int) -> None:
    """Forget metrics of steps after `step` (they will be produced again)."""
    MetricsLog(config.run_dir, tensorboard=False).truncate_after(step)
