"""The run directory: the unit of a run on disk (docs/ARCHITECTURE.md), its file names and JSON files.

    <run_dir>/
      config.toml        resolved configuration (profile + experiment + --set)
      launch.json        what the head needs to start the groups (written before submitting)
      job.sbatch         the exact batch script submitted (or that --dry-run would submit)
      job.json           executor, job id (the hetjob leader id), submit time
      job_id             the job id alone, for shell scripts
      secret             per-run bus secret (hpcrl.bus.secret, mode 0600), created before anything is
                         submitted and kept for the run's life (restarts and resumes reuse it)
      logs/<group>/rank<k>.log   one log per task; logs/head/rank0.log is the head's, logs/run/rank0.log
                         hpcrl run's; rank<k>.logging.json beside each: its logging set-up, for vLLM
                         (hpcrl.logs)
      submitit/          submitit's pickles, results and batch-step output
      exit.json          written by the head when the run ends: state, failures, tasks (group, rank, node, pid)
      metrics.jsonl      (later) one JSON line per step

Files other processes read are written to a temporary name, fsynced and renamed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpcrl.fsio import write_atomic

CONFIG_FILE = "config.toml"
LAUNCH_FILE = "launch.json"
SCRIPT_FILE = "job.sbatch"
JOB_FILE = "job.json"
JOB_ID_FILE = "job_id"
SECRET_FILE = "secret"
EXIT_FILE = "exit.json"
METRICS_FILE = "metrics.jsonl"
SUBMITIT_DIR = "submitit"
LOGS_DIR = "logs"


def write_json(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def log_path(run_dir: Path, group: str, rank: int) -> Path:
    return Path(run_dir) / LOGS_DIR / group / f"rank{rank}.log"
