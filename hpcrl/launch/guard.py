"""After the head's process ends: requeue a run whose head died while its node lived.

    python -m hpcrl.launch.guard RUN_DIR CODE        (the batch script, once the head has exited)

The batch script starts the head as its child and waits (hpcrl.slurm.render), so when the head
dies by a signal no one sent as a request - SIGKILL from the OOM killer or by hand, SIGSEGV,
SIGABRT - the batch step is still there to see it. The head had no chance to write exit.json or
to requeue, so the guard does: `scontrol requeue` while SLURM_RESTART_COUNT < max_requeues (the
run resumes from its newest checkpoint), else the run ends FAILED with exit.json naming the cause
and how many starts it had. Any other end (an exit code of the head's own: COMPLETED, FAILED,
REQUEUED, CANCELLED on SIGTERM) is the head's word and is passed through.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpcrl.config.groups import HEAD
from hpcrl.logs import setup_logging
from hpcrl.rundir import EXIT_FILE, write_json
from hpcrl.slurm.record import read_launch

log = logging.getLogger("hpcrl.launch.guard")  # not __main__: it runs as python -m

#: Signals that mean the head crashed or was killed outright, not asked to stop (SIGTERM, SIGINT: a
#: cancel, which the head handles itself; SIGUSR2: the time limit, likewise).
CRASH_SIGNALS = (signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)


@dataclass(frozen=True)
class Verdict:
    action: str
    """"pass" (the head's own end), "requeue" or "fail"."""
    message: str


def judge(code: int, *, restarts: int, max_requeues: int, node: str) -> Verdict:
    """What to do after the head's process ended with `code` (a shell's: 128 + N for signal N). Pure."""
    if code <= 128 or code - 128 not in {int(s) for s in CRASH_SIGNALS}:
        return Verdict("pass", f"the head exited with code {code}")
    cause = f"the head's process was killed by {signal.Signals(code - 128).name} on node {node}"
    if restarts < max_requeues:
        return Verdict("requeue", f"{cause}; requeueing to resume from the last checkpoint "
                                  f"(restart {restarts + 1} of at most {max_requeues})")
    return Verdict("fail", f"{cause}, and the job has used its {max_requeues} requeue(s) (cluster.max_requeues; "
                           f"{restarts + 1} starts): not requeueing. Look at logs/head/rank0.log for what it "
                           "was doing (the OOM killer says so in the node's kernel log: dmesg)")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        print("usage: python -m hpcrl.launch.guard RUN_DIR HEAD_EXIT_CODE", file=sys.stderr)
        return 2
    run_dir, code = Path(args[0]).absolute(), int(args[1])
    launch = read_launch(run_dir)
    node = os.environ.get("SLURMD_NODENAME", "")
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    verdict = judge(code, restarts=restarts, max_requeues=launch.max_requeues if launch.program == "rl" else 0,
                    node=node)
    if verdict.action == "pass":
        return code
    setup_logging(run_dir, HEAD, 0, launch.verbose)  # appends to logs/head/rank0.log
    if verdict.action == "requeue":
        log.error(verdict.message)
        job_id = os.environ.get("SLURM_JOB_ID", "")
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
        if done.returncode == 0:
            return code
        verdict = Verdict("fail", f"{verdict.message}; but scontrol requeue {job_id} failed: {done.stderr.strip()}")
    log.error(f"run FAILED: {verdict.message}")
    write_json(run_dir / EXIT_FILE, {"state": "FAILED", "error": verdict.message, "failures": [], "tasks": [],
                                     "elapsed_s": 0.0, "refused_messages": 0, "step_codes": {},
                                     "written_by": "guard", "at": time.time()})
    return code


if __name__ == "__main__":
    raise SystemExit(main())
