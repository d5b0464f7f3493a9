"""The submitit adapter: the only module that imports submitit (lazily, from hpcrl.launch.submit).

HetJobExecutor is submitit's SlurmExecutor with our batch script: `_make_submission_file_text`
returns render_script(spec, ...) - one #SBATCH block per component - instead of submitit's
single block, and everything else (pickling the callable, sbatch, job ids, result pickles,
requeue on USR2) stays submitit's. The callable (hpcrl.launch.head.HeadJob) runs in the batch step
of component 0, not under srun, so it sees the whole hetjob's SLURM_*_HET_GROUP_i variables.

HetJob replaces submitit's sacct-only watcher with hpcrl.slurm.tracking, which falls back to
squeue when accounting is off (submitit alone then reports UNKNOWN for ever and `result()`
never returns on a cancelled job) and understands hetjob rows (N+0, N+1, ...).

DetachedLocalExecutor is submitit's LocalExecutor, with the head as its single task (the head
starts the groups as local process trees), except that its controller is detached like a
batch job: own session, stdin from /dev/null, output to the submitit folder. submitit's own
controller inherits the caller's stdout, so `hpcrl submit | tee` would wait for the whole run.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from submitit.core import core, utils
from submitit.local.local import LocalExecutor, LocalJob
from submitit.slurm.slurm import SlurmExecutor, SlurmInfoWatcher, SlurmJob

from hpcrl.errors import SlurmError
from hpcrl.slurm import tracking
from hpcrl.slurm.render import render_script
from hpcrl.slurm.spec import JobSpec


class HetJobWatcher(SlurmInfoWatcher):
    """submitit's watcher, fed by hpcrl.slurm.tracking (sacct, else squeue) instead of sacct only."""

    def update(self) -> None:
        self._num_calls += 1
        for job_id in self._registered - self._finished:
            state = tracking.query(job_id).state
            self._info_dict[job_id] = {"JobID": job_id, "State": state}
        self._last_status_check = time.time()
        for job_id in self._registered - self._finished:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)


class HetJob(SlurmJob):
    """A submitted run (the hetjob leader id); `result()` returns what the head returned."""

    watcher = HetJobWatcher(delay_s=30)
    _results_timeout_s = 10


class HetJobExecutor(SlurmExecutor):
    """Submits one run: the head callable, in a batch script rendered from a JobSpec."""

    job_class = HetJob

    def __init__(self, folder: Path | str, *, spec: JobSpec, run_dir: Path, python: str | None = None) -> None:
        # SlurmExecutor.__init__ refuses to exist without srun; a dry run needs no Slurm.
        core.PicklingExecutor.__init__(self, folder, max_num_timeout=3, max_pickle_size_gb=1.0)
        self.python = shlex.quote(sys.executable) if python is None else python
        self.spec = spec
        self.run_dir = Path(run_dir)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        paths = utils.JobPaths(folder=self.folder)
        # submitit finds its job environment through SUBMITIT_EXECUTOR.
        return render_script(self.spec, run_dir=str(self.run_dir), command=f"env SUBMITIT_EXECUTOR=slurm {command}",
                             stdout=str(paths.stdout).replace("%t", "0"),
                             stderr=str(paths.stderr).replace("%t", "0"), python=self.python)

    def script_text(self) -> str:
        """The exact script `submit` would write (for --dry-run)."""
        return self._make_submission_file_text(self._submitit_command_str, "dry-run")

    def _num_tasks(self) -> int:
        return 1  # one result: the head's

    def _internal_process_submissions(self, delayed_submissions: list[utils.DelayedSubmission]) -> list[core.Job[Any]]:
        if len(delayed_submissions) != 1:
            raise SlurmError("a run is one job: submit one head, not an array")
        if shutil.which("sbatch") is None:
            raise SlurmError("sbatch is not on PATH: run on a Slurm login node, or set cluster.executor = \"local\"")
        return core.PicklingExecutor._internal_process_submissions(self, delayed_submissions)


class DetachedLocalExecutor(LocalExecutor):
    """submitit's LocalExecutor whose controller outlives the caller and keeps off its terminal."""

    def _submit_command(self, command: str) -> LocalJob:
        env = {**os.environ, "SUBMITIT_LOCAL_NTASKS": "1", "SUBMITIT_LOCAL_COMMAND": command,
               "SUBMITIT_LOCAL_TIMEOUT_S": str(int(60 * self.parameters.get("timeout_min", 2.0))),
               "SUBMITIT_LOCAL_SIGNAL_DELAY_S": str(int(self.parameters.get("signal_delay_s", 30))),
               "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
               "SUBMITIT_STDERR_TO_STDOUT": "", "SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_WITH_SHELL": ""}
        folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
        with open(folder / "controller.log", "ab") as log:
            process = subprocess.Popen([sys.executable, "-m", "submitit.local._local", str(self.folder)], env=env,
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        return LocalJob(folder=self.folder, job_id=str(process.pid), process=process, tasks=[0])


def local_executor(folder: Path | str, *, timeout_min: float) -> DetachedLocalExecutor:
    executor = DetachedLocalExecutor(folder)
    executor.update_parameters(timeout_min=timeout_min, tasks_per_node=1, nodes=1)
    return executor


__all__ = ["DetachedLocalExecutor", "HetJob", "HetJobExecutor", "local_executor"]
