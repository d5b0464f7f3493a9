"""`hpcrl resume RUN_DIR`: submit a stopped run again; it continues from its newest complete checkpoint.

    hpcrl resume runs/tiny-grpo --wait

The run's own resolved config (RUN_DIR/config.toml) is submitted again the way it was (executor,
cluster, layout); `--set` changes it (e.g. trainer.nodes: a checkpoint resumes on another trainer
world size). A corrupt or partial checkpoint is reported by name and skipped for the next newest.
Unlike `hpcrl submit`, which refuses to continue checkpoints with a config changed beyond
hpcrl.launch.submit.CHANGEABLE_KEYS, resume takes any change: it is the explicit way to make one.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("resume", help="submit a stopped run again from its newest checkpoint",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                        help="override a key of the run's config (repeatable)")
    parser.add_argument("--steps", type=int, metavar="N", default=None, help="stop after step N")
    parser.add_argument("--wait", action="store_true", help="wait for the run to end; exit 1 unless COMPLETED")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hpcrl.cli import load_run_config
    from hpcrl.cli.submit_cmd import report_submission
    from hpcrl.launch.submit import submit_run
    from hpcrl.rl.checkpointing import newest_checkpoint

    config = load_run_config(args.run_dir, *args.set)
    found = newest_checkpoint(config)  # a skipped checkpoint is logged as a warning, on stderr
    print(f"resuming {config.run.name} from " + (f"{found.path} (step {found.step})" if found else
                                                 "the start: no complete checkpoint"))
    return report_submission(config, submit_run(config, stop_after=args.steps, resume=True), wait_for_end=args.wait)
