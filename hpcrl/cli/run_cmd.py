"""`hpcrl run CONFIG`: the whole GRPO loop in this one process (no Slurm, no bus).

One trainer rank, one vLLM engine, a reward pool, with weights moving trainer -> vLLM through the
same transfer plan and engine as in a job (see hpcrl.rl.inprocess). Resumes from the run
directory's newest complete checkpoint when there is one. Runs under hpcrl.roles.reaper's
supervisor, so vLLM's engine processes end with it however it ends.

The terminal (stdout) shows set-up progress, one progress line per step (rewritten in place on a
TTY, with one kept every tenth of the run), the summary, and warnings; everything else - vLLM's
INFO lines included - goes to RUN_DIR/logs/run/rank0.log (hpcrl.logs). --verbose shows it all.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from pathlib import Path

from hpcrl.config import load_config
from hpcrl.logs import setup_logging
from hpcrl.roles.reaper import supervise

log = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "run", parents=[common], help="run the whole GRPO loop in this process (1 trainer rank, 1 replica)",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, metavar="N", help="stop after step N (default: trainer.steps)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show every library's INFO lines (vLLM's) on the terminal too, and hpcrl's DEBUG lines")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, cluster=args.cluster, overrides=args.set)
    log_file = setup_logging(config.run_dir, "run", 0, args.verbose, stream="stdout")
    supervise("hpcrl run")  # vLLM's engine processes must not outlive this one, even after a kill -9
    from hpcrl.rl.inprocess import run as run_inprocess

    log.info(f"hpcrl run {config.run.name}: {args.steps or config.trainer.steps} steps, run directory {config.run_dir}, "
             f"full log in {log_file}")
    started = time.monotonic()
    asyncio.run(run_inprocess(config, steps=args.steps))
    log.info(f"done in {time.monotonic() - started:.0f} s; metrics in {Path(config.run_dir) / 'metrics.jsonl'} "
             f"(python tools/plot_metrics.py {config.run_dir})")
    return 0
