"""The run directory: the unit of a run on disk (docs/ARCHITECTURE.md), its file names and JSON files.

    <run_dir>/
      config.toml        resolved configuration (profile + experiment + --set)
      launch.json        what the head needs to start the groups (written before submitting)
      job.sbatch         the exact batch script submitted (or that --dry-run would submit)
      job.json           executor, job id (the hetjob leader id), submit time
      job_id             the job id alone, for shell scripts
      bus.secret         per-run bus secret (hpcrl.bus.secret, mode 0600), created before anything is
                         submitted and kept for the run's life (restarts and resumes reuse it)
      lock               held (flock) by whoever writes the run: submit and resume while they submit,
                         the job's head for the job's life, `hpcrl run`; it names its holder (RunLock)
      logs/<group>/rank<k>.log   one log per task; logs/head/rank0.log is the head's, logs/run/rank0.log
                         hpcrl run's; rank<k>.logging.json beside each: its logging set-up, for vLLM
                         (hpcrl.logs)
      submitit/          submitit's pickles, results and batch-step output
      exit.json          written by the head when the run ends: state, failures, tasks (group, rank, node, pid)
      metrics.jsonl      (later) one JSON line per step

Files other processes read are written to a temporary name, fsynced and renamed (hpcrl.fsio).
The directory is 0700 and every file in it 0600 whatever the user's umask (create_run_dir, and
every process that writes it runs under umask 077): it holds the bus secret and files that run
as its owner (config.toml, launch.json, job.sbatch, submitit's pickles, checkpoints), so write
access for anyone else would be code execution as the owner at the next start.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import stat
import time
from pathlib import Path
from typing import Any

from hpcrl.errors import HpcrlError
from hpcrl.fsio import private_umask, write_atomic

CONFIG_FILE = "config.toml"
LAUNCH_FILE = "launch.json"
SCRIPT_FILE = "job.sbatch"
JOB_FILE = "job.json"
JOB_ID_FILE = "job_id"
SECRET_FILE = "bus.secret"  # hpcrl.bus.secret writes and reads it
EXIT_FILE = "exit.json"
RECOVERIES_FILE = "recoveries.json"  # hpcrl.launch.supervisor: each task started again inside the job
REQUEUES_FILE = "requeues.json"  # hpcrl.launch.requeues: each start of the head, and each requeue it asked for
METRICS_FILE = "metrics.jsonl"
SUBMITIT_DIR = "submitit"
LOGS_DIR = "logs"
LOCK_FILE = "lock"
CHECKPOINTS_DIR = "checkpoints"

log = logging.getLogger(__name__)


def write_json(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def log_path(run_dir: Path, group: str, rank: int) -> Path:
    return Path(run_dir) / LOGS_DIR / group / f"rank{rank}.log"


class RunDirBusy(HpcrlError):
    """Another process writes this run directory (it holds RUN_DIR/lock); the message names it."""


def create_run_dir(run_dir: Path) -> Path:
    """Create `run_dir` (and missing parents) 0700, or make an existing one private again.

    An existing directory is set to 0700; when it already holds a run (config.toml, launch.json,
    logs, checkpoints or metrics, e.g. written by an older hpcrl under a looser umask), every file
    and folder in it owned by us loses its group and others bits too. Refuses a directory another
    user owns."""
    run_dir = Path(run_dir)
    try:
        with private_umask():
            run_dir.mkdir(parents=True, exist_ok=True)
        owner = run_dir.stat().st_uid
    except OSError as err:
        raise HpcrlError(f"cannot create the run directory {run_dir} ({err.strerror}); set run.run_dir to a "
                         "directory you can write") from None
    if owner != os.getuid():
        raise HpcrlError(f"the run directory {run_dir} belongs to uid {owner}, not to you (uid {os.getuid()}): "
                         "it holds the run's secret and scripts that run as its owner; set run.run_dir to a "
                         "directory of yours")
    os.chmod(run_dir, 0o700)
    if any((run_dir / name).exists() for name in (CONFIG_FILE, LAUNCH_FILE, LOGS_DIR, CHECKPOINTS_DIR, METRICS_FILE)):
        _make_private(run_dir)
    return run_dir


def _make_private(root: Path) -> None:
    """Remove group and others bits from everything under `root` that we own (symlinks left alone)."""
    uid = os.getuid()
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            try:
                st = os.lstat(path)
                if not stat.S_ISLNK(st.st_mode) and st.st_uid == uid and st.st_mode & 0o077:
                    os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
            except FileNotFoundError:  # a file renamed meanwhile (no writer holds the lock yet: harmless)
                continue


def has_checkpoints(run_dir: Path) -> bool:
    """Whether the run directory holds a committed checkpoint (checkpoints/step_N), usable or not."""
    folder = Path(run_dir) / CHECKPOINTS_DIR
    return folder.is_dir() and any(re.fullmatch(r"step_\d+", p.name) for p in folder.iterdir())


_UNSUPPORTED = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


class RunLock:
    """One writer per run directory: `hpcrl submit` and `hpcrl resume` while they submit, the job's
    head for the job's life, `hpcrl run` for its whole run. A second one is refused (RunDirBusy)
    with a message naming the holder: what it is, its host, pid and since when.

        with RunLock(run_dir, "hpcrl submit"):                 # refused at once if held
            ...
        lock = RunLock(run_dir, "head").acquire(wait_s=120)    # waits for a submit still writing job.json
        ...
        lock.release()

    flock(2) on RUN_DIR/lock, which the holder then fills with who it is. The kernel drops the
    lock when the holding process ends, however it ends (kill -9, a lost node's NFS lease), so a
    lock is never stale and nothing has to guess whether a holder is still alive; the file's
    content after that is only the last holder's name, read only when the lock is refused. The
    handover from submit to the head: submit holds the lock until job.json is written and lets go;
    a head that starts meanwhile waits for it (the local executor starts the head within a
    second). Between the two, a second submit is refused by the still-live job (refuse_live_run).

    The descriptor is close-on-exec: programs the holder starts do not hold the lock, but
    processes it forks without exec (vLLM's engine under `hpcrl run`) share it until they end.

    File systems: local ones, and NFS, where Linux turns flock into NFS byte-range locks that the
    server arbitrates, so writers on two hosts exclude each other (a dead client's lock goes when
    its lease expires: 90 s by default on NFSv4). Lustre arbitrates flock across nodes only when
    mounted with `-o flock` (with `localflock`, only processes on one node exclude each other).
    Where flock is not supported at all (ENOLCK, ENOSYS, EOPNOTSUPP) the lock logs a warning and
    is a no-op: the run directory is then guarded only by the live-job check.
    """

    def __init__(self, run_dir: Path | str, holder: str) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.holder = holder
        self._fd: int | None = None

    def acquire(self, wait_s: float = 0.0) -> RunLock:
        """Take the lock, waiting up to `wait_s` for its holder to let go; RunDirBusy after that."""
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + wait_s
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise RunDirBusy(self._busy_message(wait_s)) from None
                    time.sleep(0.1)
                except OSError as err:
                    if err.errno not in _UNSUPPORTED:
                        raise
                    log.warning(f"{self.path}: this file system does not support file locks ({err.strerror}); "
                                "another hpcrl writing this run directory at the same time is not refused")
                    break
            me = {"holder": self.holder, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time(),
                  "job_id": os.environ.get("SLURM_JOB_ID", "")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        """Let go (closing the descriptor drops the flock); the file stays, naming the last holder."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _busy_message(self, waited_s: float) -> str:
        holder = read_lock_holder(self.path)
        waited = f" (waited {waited_s:.0f} s)" if waited_s else ""
        run_dir = self.path.parent
        return (f"{run_dir} is in use by {holder}{waited}; {self.holder} refuses to write it at the same time. "
                f"Wait for it to end (`hpcrl status {run_dir}`; `hpcrl cancel {run_dir}` stops a job), or set "
                "run.run_dir to another directory")


def read_lock_holder(path: Path) -> str:
    """The lock file's holder in words: "hpcrl submit (pid 12, host n1, since 2026-11-27 04:10:03 UTC)".

    The holder writes its name right after taking the lock: a few quick reads cover that moment."""
    for _ in range(20):
        try:
            info = json.loads(Path(path).read_text())
            since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(info["since"])))
            job = f", job {info['job_id']}" if info.get("job_id") else ""
            return f"{info['holder']} (pid {info['pid']} on host {info['host']}{job}, since {since})"
        except (OSError, ValueError, KeyError, TypeError):
            time.sleep(0.05)
    return f"another process (its lock file {path} does not say which)"
