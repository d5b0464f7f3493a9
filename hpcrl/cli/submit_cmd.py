"""`hpcrl submit CONFIG`: check, write the run directory, submit one job (Slurm or local).

    hpcrl submit configs/tiny_grpo.toml --cluster local       # a hetjob on tools/local_slurm.sh
    hpcrl submit configs/tiny_grpo.toml --dry-run             # write RUN_DIR/job.sbatch only
    hpcrl submit configs/tiny_grpo.toml                       # no sbatch here: local executor
    hpcrl submit configs/llama70b_grpo.toml --check --wait    # start every task, report, end: no model loaded
"""

from __future__ import annotations

import argparse
import re
import sys

from hpcrl.config import load_config
from hpcrl.errors import ConfigError


def add_parser(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "submit", parents=[common], help="submit a run: one Slurm hetjob (or local processes)",
        description="Validate the config, write the run directory (resolved config, launch.json, "
                    "job.sbatch) and submit one job whose components are the run's groups.")
    parser.add_argument("--dry-run", action="store_true",
                        help="write RUN_DIR/job.sbatch (the exact script) and submit nothing")
    parser.add_argument("--wait", action="store_true", help="wait for the run to end; exit 1 unless COMPLETED")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="hpcrl's DEBUG lines in every task's log, and other libraries' INFO lines on the head's "
                             "terminal (vLLM's INFO lines are always in the inference tasks' logs)")
    parser.add_argument("--steps", type=int, metavar="N", default=None,
                        help="stop after step N (default: trainer.steps), with a checkpoint; submitting the "
                             "same run directory again resumes from it")
    parser.add_argument("--check", action="store_true",
                        help="do not train: start every task of every group, have each report to the head, "
                             "then end them (tests the allocation, srun layout and start-up in seconds)")
    parser.add_argument("--hold", type=float, default=0.0, metavar="S",
                        help="with --check: keep every group alive S seconds after all reported")
    parser.add_argument("--debug-exit", action="append", default=[], metavar="GROUP/RANK=CODE",
                        help="with --check: make that task exit with CODE after reporting (tests failure handling)")
    parser.set_defaults(func=run)


def parse_exit_codes(items: list[str]) -> dict[str, int]:
    codes = {}
    for item in items:
        match = re.fullmatch(r"(head|trainer|inference|reward)/(\d+)=(\d+)", item)
        if not match:
            raise ConfigError(file="--debug-exit", key="", problem=f"{item!r} is not GROUP/RANK=CODE",
                              fix="write it like --debug-exit trainer/1=3")
        codes[f"{match.group(1)}/{match.group(2)}"] = int(match.group(3))
    return codes


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, cluster=args.cluster, overrides=args.set)
    from hpcrl.cli.plan_cmd import check_data_columns, refuse_unfit_plan, refuse_unwritable_run_dir
    refuse_unwritable_run_dir(config, args.config)
    check_data_columns(config, args.config)
    if not args.check:  # a start-up check loads no model: memory is not its question
        refuse_unfit_plan(config, args.config)
    from hpcrl.launch.submit import submit_run
    if (args.hold or args.debug_exit) and not args.check:
        raise ConfigError(file="--hold/--debug-exit", key="", problem="these shape a start-up check, not a training run",
                          fix="add --check (or drop them to train)")
    done = submit_run(config, dry_run=args.dry_run, hold_s=args.hold, exit_codes=parse_exit_codes(args.debug_exit),
                      program="check" if args.check else "rl", stop_after=args.steps, verbose=args.verbose)
    if args.dry_run:
        if done.note:
            print(f"hpcrl: {done.note}", file=sys.stderr)
        print(f"dry run: wrote {done.script or done.run_dir} (nothing submitted)")
        return 0
    return report_submission(config, done, wait_for_end=args.wait)


def report_submission(config, done, *, wait_for_end: bool) -> int:
    """Say where the job went; with `wait_for_end`, wait for it and exit 1 unless it COMPLETED."""
    from hpcrl.launch.follow import wait

    if done.note:
        print(f"hpcrl: {done.note}", file=sys.stderr)
    print(f"submitted {config.run.name}: {done.executor} job {done.job_id}, run directory {done.run_dir}")
    if not wait_for_end:
        return 0
    final = wait(done.run_dir, timeout_s=float("inf"))
    print(final.render())
    return 0 if final.state == "COMPLETED" else 1
