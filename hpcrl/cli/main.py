"""Entry point of the `hpcrl` command: sub-commands, and turning HpcrlError into one line.

    hpcrl plan CONFIG [--cluster NAME] [--set key=value ...] [--json]   (exit 3: DOES NOT FIT)
    hpcrl run CONFIG [--steps N] [-v]          (the whole loop in this process)
    hpcrl submit CONFIG [--cluster NAME] [--set ...] [--dry-run] [--wait] [-v]
    hpcrl status RUN_DIR|JOBID
    hpcrl logs RUN_DIR [--group G [--rank K]] [-f]
    hpcrl cancel RUN_DIR
    hpcrl export RUN_DIR [--step N] [--out DIR] [--merged]   (a LoRA run: PEFT adapter or merged HF model)

Exit status: 0 done; 2 an error the message explains (HpcrlError: a wrong config, a refused
submission, Slurm's refusal) or a bad command line; 1 `submit --wait` of a run that did not
COMPLETE; 3 `hpcrl plan` of a plan that DOES NOT FIT; 130 interrupted.

Logging is set up here for every command (the terminal: hpcrl's records, other libraries'
warnings; hpcrl.logs); `hpcrl run` sets it up again once it knows its run directory.
"""

from __future__ import annotations

import argparse
import os
import sys

from hpcrl import __version__
from hpcrl.errors import HpcrlError
from hpcrl.logs import setup_logging


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("config", help="experiment TOML file, e.g. configs/tiny_grpo.toml")
    common.add_argument("--cluster", metavar="NAME",
                        help="cluster profile: launch/NAME.toml, or a path to a profile")
    common.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                        help="override a config key, e.g. --set trainer.lr=1e-5 (repeatable)")
    parser = argparse.ArgumentParser(
        prog="hpcrl", description="Slurm-native RL post-training of LLMs.")
    parser.add_argument("--version", action="version", version=f"hpcrl {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from hpcrl.cli import export_cmd, jobs_cmd, plan_cmd, resume_cmd, run_cmd, submit_cmd
    plan_cmd.add_parser(subparsers, common)
    run_cmd.add_parser(subparsers, common)
    submit_cmd.add_parser(subparsers, common)
    resume_cmd.add_parser(subparsers)
    jobs_cmd.add_parsers(subparsers)
    export_cmd.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(None, "hpcrl", 0, getattr(args, "verbose", False))
    try:
        return args.func(args)
    except HpcrlError as err:
        print(f"hpcrl: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of stdout went away (`hpcrl plan ... | head`): what it read was the output, no error.
        # Python's advice: point stdout at /dev/null so that the flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
