"""`hpcrl run CONFIG`: the whole RL loop in this one process (no Slurm, no bus).

One trainer rank, one vLLM engine, a reward pool, with weights moving trainer -> vLLM through the
same transfer plan and engine as in a job (see hpcrl.launch.inprocess). Resumes from the run
directory's newest complete checkpoint when there is one, with the config that made it (but for
hpcrl.launch.submit.CHANGEABLE_KEYS; --resume takes any change). Runs under hpcrl.roles.reaper's
supervisor, so vLLM's engine processes end with it however it ends. It holds the run directory's
lock (hpcrl.rundir.RunLock) for the whole run, under umask 077, and writes RUN_DIR/config.toml.

The terminal (stdout) shows hpcrl's lines only: set-up progress, one progress line per step
(rewritten in place on a TTY, with one kept every tenth of the run), the summary, hpcrl's
warnings, and other libraries' errors. Everything else - vLLM's INFO lines, other libraries'
warnings, and what any process of the run writes to its stderr (torch's C++ warnings, vLLM's
EngineCore before it configures its logging) - goes to RUN_DIR/logs/run/rank0.log (hpcrl.logs).
--verbose shows it all on the terminal too.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from pathlib import Path

from hpcrl.config import load_config
from hpcrl.config.dump import dump_toml
from hpcrl.config.schema import Config
from hpcrl.fsio import PRIVATE_UMASK, write_atomic
from hpcrl.logs import setup_logging, stderr_to_log
from hpcrl.roles.reaper import supervise

log = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "run", parents=[common], help="run the whole RL loop in this process (1 trainer rank, 1 replica)",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, metavar="N", help="stop after step N (default: trainer.steps)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show every library's INFO lines and warnings (vLLM's, torch's) on the terminal too, "
                             "and hpcrl's DEBUG lines")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run directory's checkpoints even though this config differs from the one "
                             "that made them (without it, such a run is refused with the keys that differ)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hpcrl.launch.submit import refuse_changed_config, refuse_live_run
    from hpcrl.rundir import CONFIG_FILE, RunLock, create_run_dir

    config = load_config(args.config, cluster=args.cluster, overrides=args.set)
    os.umask(PRIVATE_UMASK)  # the run directory, its logs, checkpoints and metrics: the owner's only
    run_dir = create_run_dir(Path(config.run_dir))
    with RunLock(run_dir, "hpcrl run"):  # for the whole run: a submit or another run here is refused
        refuse_live_run(run_dir)
        if not args.resume:
            refuse_changed_config(run_dir, config, command="hpcrl run")
        write_atomic(run_dir / CONFIG_FILE, dump_toml(config))
        return _run(args, config)


def _run(args: argparse.Namespace, config: Config) -> int:
    log_file = setup_logging(config.run_dir, "run", 0, args.verbose, stream="stdout")
    assert log_file is not None
    if not args.verbose:
        stderr_to_log(log_file)  # before vLLM's processes start: they inherit it
    supervise("hpcrl run")  # vLLM's engine processes must not outlive this one, even after a kill -9
    from hpcrl.launch.inprocess import run as run_inprocess

    log.info(f"hpcrl run {config.run.name}: {args.steps or config.trainer.steps} steps, run directory {config.run_dir}, "
             f"full log in {log_file}")
    started = time.monotonic()
    asyncio.run(run_inprocess(config, steps=args.steps))
    log.info(f"done in {time.monotonic() - started:.0f} s; metrics in {Path(config.run_dir) / 'metrics.jsonl'} "
             f"(python tools/plot_metrics.py {config.run_dir})")
    return 0
