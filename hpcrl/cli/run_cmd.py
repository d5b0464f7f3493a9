"""`hpcrl run CONFIG`: the whole GRPO loop in this one process (no Slurm, no bus).

One trainer rank, one vLLM engine, a reward pool, with weights moving trainer -> vLLM through the
same transfer plan and engine as in a job (see hpcrl.rl.inprocess). Resumes from the run
directory's newest complete checkpoint when there is one. Runs under hpcrl.roles.reaper's
supervisor, so vLLM's engine processes end with it however it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from hpcrl.config import load_config
from hpcrl.roles.reaper import supervise


def add_parser(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "run", parents=[common], help="run the whole GRPO loop in this process (1 trainer rank, 1 replica)",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, metavar="N", help="stop after step N (default: trainer.steps)")
    parser.set_defaults(func=run)


def _live_log():
    """On a terminal, step lines overwrite each other (one live progress line); others scroll."""
    state = {"live": False}

    def log(line: str) -> None:
        if line.startswith("step "):
            sys.stdout.write("\r\x1b[2K" + line)
            state["live"] = True
        else:
            sys.stdout.write(("\n" if state["live"] else "") + line + "\n")
            state["live"] = False
        sys.stdout.flush()
    return log


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, cluster=args.cluster, overrides=args.set)
    supervise("hpcrl run")  # vLLM's engine processes must not outlive this one, even after a kill -9
    from hpcrl.rl.inprocess import run as run_inprocess

    started = time.monotonic()
    asyncio.run(run_inprocess(config, steps=args.steps, log=_live_log() if sys.stdout.isatty() else print))
    print(f"done in {time.monotonic() - started:.0f} s; metrics in {Path(config.run_dir) / 'metrics.jsonl'} "
          f"(python tools/plot_metrics.py {config.run_dir})")
    return 0
