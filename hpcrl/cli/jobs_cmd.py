"""`hpcrl status | logs | cancel`: a submitted run seen from the login node.

    hpcrl status RUN_DIR|JOBID
    hpcrl logs RUN_DIR [--group trainer [--rank 3]] [-f]
    hpcrl cancel RUN_DIR
"""

from __future__ import annotations

import argparse
import sys

from hpcrl.config.groups import GROUP_NAMES


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    status = subparsers.add_parser("status", help="state of a run: components, nodes, elapsed, last metrics")
    status.add_argument("target", metavar="RUN_DIR|JOBID")
    status.set_defaults(func=run_status)
    logs = subparsers.add_parser("logs", help="print (or follow) the logs of a run's tasks")
    logs.add_argument("run_dir", metavar="RUN_DIR")
    logs.add_argument("--group", choices=GROUP_NAMES)
    logs.add_argument("--rank", type=int, help="one rank of --group")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing until the run ends")
    logs.set_defaults(func=run_logs)
    cancel = subparsers.add_parser("cancel", help="cancel every component of a run")
    cancel.add_argument("run_dir", metavar="RUN_DIR")
    cancel.add_argument("--wait", type=float, default=15.0, metavar="S",
                        help="seconds to wait for the run to end (default 15; 0 = do not wait)")
    cancel.set_defaults(func=run_cancel)


def run_status(args: argparse.Namespace) -> int:
    from hpcrl.launch.follow import status
    print(status(args.target).render())
    return 0


def run_logs(args: argparse.Namespace) -> int:
    from hpcrl.launch.follow import log_files, tail_logs
    if args.rank is not None and args.group is None:
        print("hpcrl: error: --rank needs --group", file=sys.stderr)
        return 2
    if args.follow:
        log_files(args.run_dir, group=args.group, rank=args.rank, must_exist=False)  # checks the group
        prefix = args.rank is None
        for path, line in tail_logs(args.run_dir, group=args.group, rank=args.rank):
            print(f"[{path.parent.name}/{path.stem[4:]}] {line}" if prefix else line, flush=True)
        return 0
    files = log_files(args.run_dir, group=args.group, rank=args.rank)
    prefix = len(files) > 1
    for path in files:
        for line in path.read_text(errors="replace").splitlines():
            print(f"[{path.parent.name}/{path.stem[4:]}] {line}" if prefix else line)
    return 0


def run_cancel(args: argparse.Namespace) -> int:
    from hpcrl.launch.follow import cancel, wait
    run = cancel(args.run_dir)
    print(f"cancelled {run.executor} job {run.job_id}")
    if args.wait > 0:
        print(wait(args.run_dir, timeout_s=args.wait).render())
    return 0
