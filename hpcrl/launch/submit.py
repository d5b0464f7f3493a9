"""Submitting a run: config -> JobSpec -> run directory -> script -> job (Slurm or local).

    submission = submit_run(config)                  # returns once the job is queued
    submission = submit_run(config, dry_run=True)    # writes RUN_DIR/job.sbatch, submits nothing

Order matters: every check (config, JobSpec, partitions known to Slurm) runs before the run
directory is written and before sbatch. Rendering (hpcrl.slurm.render) and submitting
(hpcrl.slurm.executor, the submitit adapter, imported here lazily) stay separate.

The run directory is written under umask 077 (hpcrl.fsio.private_umask), so the run directory,
its files and submitit's pickles are the owner's only, and sbatch passes that umask on to the
job (SLURM_UMASK, which every srun step applies to its tasks). From creating the directory until
job.json names the new job, submit holds the run directory's lock (hpcrl.rundir.RunLock): a second
submit, resume or `hpcrl run` at the same moment is refused naming it, and after it the live job
refuses them (refuse_live_run). A run directory that holds checkpoints is continued only with the
config that made them, but for the keys in CHANGEABLE_KEYS (refuse_changed_config); `hpcrl
resume` continues it with any change.
"""

from __future__ import annotations

import dataclasses
import fnmatch
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
from hpcrl.fsio import private_umask, write_atomic
from hpcrl.launch.head import HeadJob
from hpcrl.rundir import (
    CONFIG_FILE,
    EXIT_FILE,
    JOB_FILE,
    JOB_ID_FILE,
    LOGS_DIR,
    SCRIPT_FILE,
    SUBMITIT_DIR,
    RunLock,
    create_run_dir,
    has_checkpoints,
    write_json,
)
from hpcrl.slurm.record import LaunchRecord, write_launch
from hpcrl.slurm.spec import JobSpec, job_spec, time_limit_seconds

LOCAL_NOTE = "no sbatch found: running with the local executor (each group a process tree on this machine)"

CHANGEABLE_KEYS = (
    # how long, how often and how many checkpoints: the run's path is the same, only its end or its saves move
    "trainer.steps", "trainer.checkpoint_interval", "trainer.keep_last", "checkpoint.*",
    # how long to wait for things; the Slurm time limit of each group
    "run.start_timeout_s", "run.rejoin_timeout_s", "groups.*.time",
    # where and how the job is placed and started: the cluster profile, partitions, accounts, the venv
    "run.cluster", "cluster.*", "groups.*.partition", "groups.*.account", "groups.*.qos", "groups.*.constraint",
    "groups.*.sbatch_extra",
    # memory and speed settings that leave every step's numbers as they were
    "inference.gpu_memory_utilization", "inference.kv_cache_gib", "inference.enforce_eager",
    "inference.transfer_round_mib", "inference.weight_transport", "trainer.activation_checkpointing",
    "reward.workers",
    # evaluation on the held-out prompts: it changes no training step (hpcrl.rl.controller); data.eval_fraction,
    # which takes prompts from training, is not among them
    "eval.*", "data.eval_source", "data.eval_split", "data.eval_size",
    # where the run is recorded
    "run.run_dir", "run.wandb_project", "run.wandb_entity", "run.wandb_mode", "run.ignore_memory_plan",
)
"""The keys (fnmatch patterns over dotted keys) a new `hpcrl submit` or `hpcrl run` may change in a run
directory that holds checkpoints: none changes what a step computes (the one place that list is kept;
docs/ARCHITECTURE.md and README point here). Any other change (the model,
data, algorithm, learning rate, batch sizes, seed, world sizes...) would continue the checkpoints
as a different run, so it is refused with the keys listed; `hpcrl resume RUN_DIR --set KEY=VALUE`
makes such a change on purpose (e.g. trainer.nodes: a checkpoint resumes on another world size)."""


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
        from hpcrl.config.model_shapes import shape_of
        from hpcrl.plan.timeouts import run_timeouts
        shape = shape_of(config.model)
        start_timeout_s = run_timeouts(config, shape).start_s
    return LaunchRecord(program=program, stop_after=stop_after, run_name=config.run.name,
                        run_dir=str(Path(config.run_dir).absolute()), executor=executor, layout=spec.layout,
                        cluster=spec.cluster, python=python, groups=spec.groups, hold_s=hold_s,
                        exit_codes=dict(exit_codes or {}), start_timeout_s=start_timeout_s,
                        slurm_conf=config.cluster.slurm_conf, env=dict(config.cluster.env),
                        max_requeues=config.cluster.max_requeues, spare_nodes=spec.spare_nodes,
                        verbose=verbose)


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


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(old: Config, new: Config) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every key that differs and is not in CHANGEABLE_KEYS."""
    before, after = _flat(dataclasses.asdict(old)), _flat(dataclasses.asdict(new))
    return [(key, before.get(key), after.get(key)) for key in sorted(before.keys() | after.keys())
            if before.get(key) != after.get(key) and not any(fnmatch.fnmatchcase(key, p) for p in CHANGEABLE_KEYS)]


def refuse_changed_config(run_dir: Path, config: Config, *, command: str = "hpcrl submit") -> None:
    """Refuse to continue a run directory's checkpoints with a config that differs from the one that
    made them, beyond CHANGEABLE_KEYS; the message lists each key with its old and new value."""
    old_file = run_dir / CONFIG_FILE
    if not old_file.is_file() or not has_checkpoints(run_dir):
        return  # nothing to continue: a dry run, a run that failed before its first checkpoint
    from hpcrl.config.load import load_config
    try:
        old = load_config(old_file)
    except ConfigError as err:
        raise ConfigError(file=str(old_file), key="", problem=f"the config of the checkpoints in {run_dir} no "
                          f"longer loads ({err})", fix="`hpcrl resume RUN_DIR --set KEY=VALUE` to continue them "
                          "with the keys changed, or set run.run_dir to a new directory") from None
    changes = config_changes(old, config)
    if changes:
        listed = "; ".join(f"{key}: {before!r} -> {after!r}" for key, before, after in changes)
        raise ConfigError(file=str(old_file), key="", problem=f"{run_dir} holds checkpoints made with another "
                          f"config; {command} would continue them with {len(changes)} key(s) changed: {listed}",
                          fix=f"continue them on purpose with `hpcrl resume {run_dir} --set KEY=VALUE` for each key "
                          "(hpcrl run: add --resume), or set run.run_dir to a new directory to start afresh. Steps, "
                          "checkpointing, evaluation, time limits, placement and memory settings may change freely")


def submit_run(config: Config, *, dry_run: bool = False, hold_s: float = 0.0,
               exit_codes: dict[str, int] | None = None, start_timeout_s: float | None = None,
               program: str = "rl", stop_after: int | None = None, verbose: bool = False,
               resume: bool = False) -> Submission:
    """Check, write the run directory, render, and (unless dry_run) submit; see the module docstring.

    program "rl" trains (the head runs the RL loop over the bus); "check" only starts every
    task, has it register, and ends it (with `exit_codes`, after `hold_s`): the allocation's smoke test.
    resume: `hpcrl resume`, which continues the run directory's checkpoints whatever changed."""
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
    python = config.cluster.python or sys.executable  # the head and every task run it on the nodes
    launch = launch_record(config, spec, executor=executor, python=python, hold_s=hold_s,
                           exit_codes=exit_codes, start_timeout_s=start_timeout_s, program=program,
                           stop_after=stop_after, verbose=verbose)
    command = "hpcrl resume" if resume else "hpcrl submit"
    saved_mask = os.environ.get("SLURM_UMASK")
    with private_umask():
        # sbatch records its umask for the job unless SLURM_UMASK is set already: make it ours.
        os.environ["SLURM_UMASK"] = "0077"
        try:
            with RunLock(create_run_dir(run_dir), command):
                refuse_live_run(run_dir)
                if not resume:
                    refuse_changed_config(run_dir, config, command=command)
                return _write_and_submit(config, spec, run_dir, launch, executor=executor, note=note,
                                         python=python, dry_run=dry_run)
        finally:
            if saved_mask is None:
                os.environ.pop("SLURM_UMASK", None)
            else:
                os.environ["SLURM_UMASK"] = saved_mask


def _write_and_submit(config: Config, spec: JobSpec, run_dir: Path, launch: LaunchRecord, *, executor: str,
                      note: str, python: str, dry_run: bool) -> Submission:
    """Under the run directory's lock: its files, the script, sbatch (or the local controller), job.json."""
    prepare_run_dir(run_dir, config_toml=dump_toml(config), launch=launch, groups=[g.name for g in spec.groups],
                    dry_run=dry_run)
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


def prepare_run_dir(run_dir: Path, *, config_toml: str, launch: LaunchRecord, groups: list[str],
                    dry_run: bool = False) -> None:
    """Create the run directory (0700) with its config copy, launch.json and one log folder per group.

    A real submission forgets the previous job's exit.json and job.json; a dry run submits nothing, so
    they keep describing the run directory's last job."""
    with private_umask():
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for group in groups:
            (run_dir / LOGS_DIR / group).mkdir(parents=True, exist_ok=True)
        (run_dir / SUBMITIT_DIR).mkdir(exist_ok=True)
    write_atomic(run_dir / CONFIG_FILE, config_toml)
    write_launch(run_dir, launch)
    # The per-run bus secret: before submitting, readable by the owner only, never in logs or job.json.
    if not secret_path(run_dir).exists():
        create_secret(run_dir)
    if not dry_run:
        for stale in (EXIT_FILE, JOB_FILE, JOB_ID_FILE):
            (run_dir / stale).unlink(missing_ok=True)
