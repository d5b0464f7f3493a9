"""The head's side of checkpoints: what a step's checkpoint holds, and resuming from the newest one.

    step_N/
      trainer/          model + optimizer of every trainer rank (torch.distributed.checkpoint, sharded)
      run_state.json    the controller's state (step, batches generated, prompt cursor, scored
                        batches not trained on yet), the config's seed and run name
      MANIFEST.json     written last (hpcrl.ckpt.store)

The trainer group writes `trainer/` itself (every rank its shards, in parallel); the head writes
`run_state.json` and seals the directory. On every start metrics.jsonl is cut back to the step the
run starts from (0 without a checkpoint), so a run's metrics continue exactly where its checkpoint
left them, and every row past it is written again.

A run directory holding checkpoints none of which verifies is an error (UnusableCheckpoints), not a
silent start from step 0, unless checkpoint.on_unusable = "start_over".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from hpcrl.ckpt import CORRUPT_DIR, CheckpointError, CheckpointStore, FoundCheckpoint, write_atomic
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


class UnusableCheckpoints(CheckpointError):
    """The run directory holds checkpoints and none of them verifies."""


def unusable_message(store: CheckpointStore) -> str:
    """What UnusableCheckpoints says: the directory, each checkpoint and why it failed, and the key to set."""
    listed = "\n".join(f"  {path.name}: {why}" for path, why in store.skipped)
    return (f"{store.root} holds {len(store.skipped)} checkpoint(s) and none of them verifies:\n{listed}\n"
            "The run stops rather than train from step 0 and lose what they hold. Fix: restore or repair them "
            "(the manifest in each lists every file's size and sha256), or to train from step 0 set "
            'checkpoint.on_unusable = "start_over" (--set checkpoint.on_unusable=start_over), which moves them to '
            f"{store.root / CORRUPT_DIR}/ with the reason in each")


def newest_checkpoint(config: Config, store: CheckpointStore | None = None) -> FoundCheckpoint | None:
    """The newest complete checkpoint of the run; skipped ones are logged as warnings. When there are
    checkpoints but none verifies, raises UnusableCheckpoints, or with checkpoint.on_unusable =
    "start_over" warns and returns None. Reads only (the caller may `set_aside` `store.skipped`)."""
    store = store if store is not None else store_for(config)
    found = store.latest()
    for path, why in store.skipped:
        log.warning(f"checkpoint {path} skipped: {why}")
    if found is None and store.skipped:
        if config.checkpoint.on_unusable == "stop":
            raise UnusableCheckpoints(unusable_message(store))
        log.warning(f"no checkpoint in {store.root} verifies: starting over from step 0, as "
                    'checkpoint.on_unusable = "start_over" says')
    return found


def refuse_unusable_checkpoints(config: Config) -> None:
    """Raise UnusableCheckpoints when the run has checkpoints and none is even whole by its files' sizes
    (checkpoint.on_unusable = "stop"): the job's head asks this before it starts any group, so such a run
    ends FAILED in seconds instead of being requeued after each start. It reads sizes only, no checksums:
    a checkpoint whose bytes changed in place is caught by the loop's full check."""
    store = store_for(config)
    if config.checkpoint.on_unusable == "stop" and store.latest(checksums=False) is None and store.skipped:
        raise UnusableCheckpoints(unusable_message(store))


def rewind_metrics(config: Config, step: int) -> None:
    """Forget metrics of steps after `step`, and a torn last line (they will be produced again): called
    on every start, with 0 when the run starts from scratch, so metrics.jsonl always ends at the step
    the run continues from. Rows are dropped, not moved aside: the run writes every one of them again,
    the same (a resumed run repeats its steps bit for bit, and the run directory holds one config)."""
    MetricsLog(config.run_dir, tensorboard=False).truncate_after(step)
