"""Submitting a run: config -> JobSpec -> run directory -> script -> job (Slurm or local).

    submission = submit_run(config)                  # returns once the job is queued
    submission = submit_run(config, dry_run=True)    # writes RUN_DIR/job.sbatch, submits nothing

Order matters: every check (config, JobSpec, partitions known to Slurm) runs before the run
directory is written and before sbatch. Rendering (hpcrl.slurm.render) and submitting
(hpcrl.slurm.executor, the submitit adapter, imported here lazily) stay separate.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.bus.secret import create_secret, secret_path
from hpcrl.config.dump import dump_toml
from hpcrl.config.schema import Config
from hpcrl.errors import ConfigError, SlurmError
from hpcrl.fsio import write_atomic
from hpcrl.launch.head import HeadJob
from hpcrl.rundir import (
    CONFIG_FILE,
    EXIT_FILE,
    JOB_FILE,
    JOB_ID_FILE,
    LOGS_DIR,
    SCRIPT_FILE,
    SUBMITIT_DIR,
    write_json,
)
from hpcrl.slurm.record import LaunchRecord, write_launch
from hpcrl.slurm.spec import JobSpec, job_spec, time_limit_seconds

LOCAL_NOTE = "no sbatch found: running with the local executor (each group a process tree on this machine)"


@dataclass(frozen=True)
class Submission:
    run_dir: Path
    executor: str
    job_id: str
    """The hetjob leader id (Slurm), or the local controller's pid; "" for a dry run."""
    script: Path | None
    note: str = ""
    job: Any = None
    """The submitit job (its result() is what the head returned); None for a dry run."""


def choose_executor(config: Config) -> tuple[str, str]:
    """("slurm" | "local", a one-line note when auto fell back to local)."""
    wanted = config.cluster.executor
    if wanted == "auto":
        return ("slurm", "") if shutil.which("sbatch") else ("local", LOCAL_NOTE)
    return wanted, ""


def launch_record(config: Config, spec: JobSpec, *, executor: str, python: str, hold_s: float = 0.0,
                  exit_codes: dict[str, int] | None = None, start_timeout_s: float | None = None,
                  program: str = "rl", stop_after: int | None = None, verbose: bool = False) -> LaunchRecord:
    """The content of launch.json: what the head needs (pure but for reading the model's config.json
    when there is no preset). start_timeout_s None = run.start_timeout_s, or derived from the model's
    size (hpcrl.plan.timeouts)."""
    if stop_after is not None and not 1 <= stop_after <= config.trainer.steps:
        raise ConfigError(file="--steps", key="", problem=f"{stop_after} is outside 1..trainer.steps "
                          f"({config.trainer.steps})", fix="give a step the run reaches, or raise trainer.steps")
    if start_timeout_s is None:
        from hpcrl.config.model_shapes import load_shape
        from hpcrl.plan.timeouts import run_timeouts
        shape = load_shape(preset_name=config.model.preset, path=config.model.path)
        start_timeout_s = run_timeouts(config, shape).start_s
    return LaunchRecord(program=program, stop_after=stop_after, run_name=config.run.name,
                        run_dir=str(Path(config.run_dir).absolute()), executor=executor, layout=spec.layout,
                        cluster=spec.cluster, python=python, groups=spec.groups, hold_s=hold_s,
                        exit_codes=dict(exit_codes or {}), start_timeout_s=start_timeout_s,
                        slurm_conf=config.cluster.slurm_conf, env=dict(config.cluster.env),
                        max_requeues=config.cluster.max_requeues, verbose=verbose)


def check_partitions(config: Config, spec: JobSpec, env: dict[str, str]) -> None:
    """Refuse partitions the cluster does not have, naming the key to change (needs sinfo)."""
    if shutil.which("sinfo") is None:
        return
    done = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=30, env=env)
    if done.returncode != 0:
        raise SlurmError(f"sinfo cannot reach a Slurm controller ({done.stderr.strip().splitlines()[-1][:200]}); "
                         "check SLURM_CONF (or cluster.slurm_conf), e.g. `tools/local_slurm.sh up` and --cluster local, "
                         'or run without Slurm: --set cluster.executor="local"')
    known = sorted(set(done.stdout.split()))
    groups = [g.name for g in spec.groups] if spec.layout == "hetjob" else [spec.groups[-1].name]
    for name, block in zip(groups, spec.blocks):
        partition = dict(block.options).get("partition")
        if partition and partition not in known:
            key = f"groups.{name}.partition" if config.group(name).partition else "cluster.partition"
            raise ConfigError(key=key, problem=f"partition {partition!r} does not exist on this cluster",
                              fix=f"use one of: {', '.join(known)}")


def refuse_live_run(run_dir: Path) -> None:
    """A run directory holds one job at a time: refuse to overwrite one whose job still runs."""
    if not (run_dir / JOB_FILE).is_file():
        return
    from hpcrl.launch.follow import status
    current = status(run_dir)
    if not current.done:
        raise SlurmError(f"{run_dir} belongs to {current.executor} job {current.job_id}, still {current.state}; "
                         f"`hpcrl cancel {run_dir}` first, or set run.run_dir to another directory")


def submit_run(config: Config, *, dry_run: bool = False, hold_s: float = 0.0,
               exit_codes: dict[str, int] | None = None, start_timeout_s: float | None = None,
               program: str = "rl", stop_after: int | None = None, verbose: bool = False) -> Submission:
    """Check, write the run directory, render, and (unless dry_run) submit; see the module docstring.

    program "rl" trains (the head runs the RL loop over the bus); "check" only starts every
    task, has it register, and ends it (with `exit_codes`, after `hold_s`): the allocation's smoke test."""
    executor, note = choose_executor(config)
    spec = job_spec(config)
    run_dir = Path(config.run_dir).absolute()
    env = dict(os.environ)
    if config.cluster.slurm_conf:
        # sbatch, squeue and the job's own srun calls all read it; the job inherits it from sbatch.
        os.environ["SLURM_CONF"] = env["SLURM_CONF"] = config.cluster.slurm_conf
    if executor == "slurm" and not dry_run:
        if shutil.which("sbatch") is None:
            raise SlurmError('cluster.executor = "slurm" but sbatch is not on PATH: run on a Slurm login node, '
                             'or set cluster.executor = "auto" (local when no sbatch) or "local"')
        check_partitions(config, spec, env)
    refuse_live_run(run_dir)
    python = config.cluster.python or sys.executable  # the head and every task run it on the nodes
    launch = launch_record(config, spec, executor=executor, python=python, hold_s=hold_s,
                           exit_codes=exit_codes, start_timeout_s=start_timeout_s, program=program,
                           stop_after=stop_after, verbose=verbose)
    prepare_run_dir(run_dir, config_toml=dump_toml(config), launch=launch, groups=[g.name for g in spec.groups])
    from hpcrl.slurm import executor as adapter  # submitit: only now

    folder = run_dir / SUBMITIT_DIR
    if executor == "slurm":
        slurm = adapter.HetJobExecutor(folder, spec=spec, run_dir=run_dir, python=shlex.quote(python))
        script = run_dir / SCRIPT_FILE
        write_atomic(script, slurm.script_text())
        if dry_run:
            return Submission(run_dir, executor, "", script, note)
        job = slurm.submit(HeadJob(run_dir))
    else:
        if dry_run:
            return Submission(run_dir, executor, "", None, note)
        script = None
        limit = time_limit_seconds(spec)
        job = adapter.local_executor(folder, timeout_min=limit / 60 if limit else 7 * 24 * 60).submit(HeadJob(run_dir))
    write_json(run_dir / JOB_FILE, {"executor": executor, "job_id": str(job.job_id), "layout": spec.layout,
                                    "slurm_conf": config.cluster.slurm_conf, "submitted_at": time.time(),
                                    "groups": [g.name for g in spec.groups],
                                    **_local_process(executor, job.job_id)})
    write_atomic(run_dir / JOB_ID_FILE, f"{job.job_id}\n")
    return Submission(run_dir, executor, str(job.job_id), script, note, job)


def _local_process(executor: str, job_id: str) -> dict:
    """job.json's "process" of a local run: its controller's start time and command line, which
    `hpcrl status` and `cancel` compare before trusting the pid (hpcrl.launch.follow; pids are reused)."""
    if executor != "local":
        return {}
    from hpcrl.launch.follow import process_identity
    return {"process": process_identity(int(job_id))}


def prepare_run_dir(run_dir: Path, *, config_toml: str, launch: LaunchRecord, groups: list[str]) -> None:
    """Create the run directory with its config copy, launch.json and one log folder per group."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for group in groups:
        (run_dir / LOGS_DIR / group).mkdir(parents=True, exist_ok=True)
    (run_dir / SUBMITIT_DIR).mkdir(exist_ok=True)
    write_atomic(run_dir / CONFIG_FILE, config_toml)
    write_launch(run_dir, launch)
    # The per-run bus secret: before submitting, readable by the owner only, never in logs or job.json.
    if not secret_path(run_dir).exists():
        create_secret(run_dir)
    for stale in (EXIT_FILE, JOB_FILE, JOB_ID_FILE):
        (run_dir / stale).unlink(missing_ok=True)
