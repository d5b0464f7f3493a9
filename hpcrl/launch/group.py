"""The program every group task runs: `python -m hpcrl.trainer` (likewise hpcrl.inference, hpcrl.reward).

    python -m hpcrl.trainer [--exit-code N]

It works out its group, replica, rank and node from its environment (hpcrl.slurm.identity) and
reports them to the head over the report protocol (HPCRL_HEAD_ADDR). Then, by the run's program
(launch.json):

  rl      build the group's role and serve it to the head over the bus until the head says exit
          (hpcrl.roles.serve)
  check   wait until the head says how to exit (`hpcrl submit --check`: the allocation and every
          task's start-up, without loading a model), and exit with that code, or with N when
          --exit-code is given (to test how a failing rank is reported)

The task runs under a supervisor process (hpcrl.launch.reaper) that ends whatever the task
leaves running when it dies, e.g. vLLM's engine processes after a kill -9.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hpcrl.errors import HpcrlError
from hpcrl.launch.reaper import supervise
from hpcrl.launch.report import report_and_wait
from hpcrl.launch.rundir import LAUNCH_FILE, read_json
from hpcrl.slurm.identity import identify_task


def main(role: str, argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m hpcrl.{role}",
                                     description=f"A task of the {role} group (started by the head).")
    parser.add_argument("--exit-code", type=int, default=None,
                        help="exit with this code whatever the head says (after reporting)")
    args = parser.parse_args(argv)
    supervise(f"hpcrl.{role}")  # nothing the task starts (vLLM's engine processes) may outlive it
    try:
        identity = identify_task(os.environ)
        if identity.group != role:
            raise HpcrlError(f"hpcrl.{role} was started as a task of group {identity.group!r}; "
                             f"the head starts hpcrl.{identity.group} for that group")
        address = os.environ.get("HPCRL_HEAD_ADDR")
        if not address:
            raise HpcrlError("HPCRL_HEAD_ADDR is not set: group tasks are started by the head (hpcrl submit)")
        print(f"{role} rank {identity.rank}/{identity.group_size} replica {identity.replica} "
              f"on {identity.node} (node {identity.node_index}): reporting to {address}", flush=True)
        run_dir = Path(os.environ.get("HPCRL_RUN_DIR", "."))
        launch = read_json(run_dir / LAUNCH_FILE)
        if launch.get("program", "check") == "rl" and args.exit_code is None:
            from hpcrl.roles.serve import serve_role
            code = serve_role(role, identity, run_dir, launch, address)
            print(f"{role} rank {identity.rank}: exiting with code {code}", flush=True)
            sys.stderr.flush()
            # The role has closed its engines; skip interpreter teardown, where threads left by native
            # libraries (vLLM's, gloo's) can abort the process after its work is done.
            os._exit(code)
        else:
            code = report_and_wait(address, identity.to_dict(), pid=os.getpid(), given_code=args.exit_code)
    except HpcrlError as err:
        print(f"hpcrl.{role}: error: {err}", file=sys.stderr, flush=True)
        return 2
    print(f"{role} rank {identity.rank}: exiting with code {code}", flush=True)
    return code
