"""The job's entry: the head, in component 0 (the batch step). Starts every group, runs the run's
program, records how the run ended, and requeues it after a lost task.

    python -m hpcrl.launch.head RUN_DIR       (the sbatch/ templates; submitit calls HeadJob(run_dir))

  0. sets umask 077 (and SLURM_UMASK for its srun steps: every file of the run is the owner's
     only) and takes the run directory's lock (hpcrl.rundir.RunLock) for the job's life, waiting
     up to HEAD_LOCK_WAIT_S for a submit that is still writing job.json; another holder (e.g.
     `hpcrl run` in the same directory) fails the job, naming it, before anything is written.
  1. reads RUN_DIR/launch.json (hpcrl.slurm.record), checks that its interpreter (cluster.python, or
     the one that ran hpcrl submit) exists and is executable on this node, and binds the control
     bus (hpcrl.bus.Router, the run's secret): the head's one control port. Program "rl" also
     serves the rendezvous store (hpcrl.rendezvous.store: every request signed with the run's
     secret, like the bus) for the trainer ranks' torch.distributed process group and for the
     weight-transfer group (trainer ranks + inference engines).
  2. starts one step per group (hpcrl.launch.supervisor): `srun --het-group=i` (hetjob), srun on the
     group's node range (split), or local process trees (local executor). Every task registers
     on the bus, says READY when it serves, and its exit code comes back as a BYE.
  3. program "check": waits until every task has registered, holds them for launch.json's hold_s,
     then dismisses each with its exit code (0, or launch.json's exit_codes, to test failures).
     program "rl": the RL loop over the bus (hpcrl.rl.program) while the supervisor watches
     every step; then dismisses every task with 0.
  4. writes exit.json: COMPLETED; FAILED naming group, rank and node; CANCELLED (SIGTERM: scancel,
     hpcrl cancel); REQUEUED (a lost task under Slurm with requeues left, or SIGUSR2 before the time
     limit: `scontrol requeue`, the run resumes from its newest checkpoint); PREEMPTED (SIGUSR2 with
     the local executor: submit the run directory again to resume).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from hpcrl.bus import BusConfig, Router, load_secret
from hpcrl.bus.config import MIN_MESSAGE_BYTES, REFUSED_FILE, message_limit_for
from hpcrl.config.groups import HEAD, INFERENCE, REWARD
from hpcrl.errors import HpcrlError
from hpcrl.fsio import PRIVATE_UMASK
from hpcrl.launch import requeues
from hpcrl.launch.supervisor import GroupFailed, Supervisor, TrainerLost
from hpcrl.logs import setup_logging
from hpcrl.roles.serve import BUS_SETTINGS
from hpcrl.rundir import CONFIG_FILE, EXIT_FILE, RunDirBusy, RunLock, write_json
from hpcrl.slurm import tracking
from hpcrl.slurm.record import read_launch

__all__ = ["GroupFailed", "HeadJob", "InterpreterMissing", "RunCancelled", "check_interpreter", "run_head"]

log = logging.getLogger(__name__)

HEAD_LOCK_WAIT_S = 120.0
"""How long a starting head waits for the run directory's lock: submit holds it until job.json is
written (a second at most), and a requeued head's predecessor on a lost node holds it on NFS until
its lease expires (90 s by default)."""

#: Seconds between two reports of the bus's refused messages (only when they changed).
REFUSALS_EVERY_S = 10.0


class RunCancelled(HpcrlError):
    """The head was told to stop (SIGTERM or SIGINT), e.g. by scancel or hpcrl cancel."""


class InterpreterMissing(HpcrlError):
    """launch.json's interpreter cannot run on the head's node: the run fails, it is not requeued."""


def check_interpreter(python: str, node: str) -> None:
    """Refuse a recorded interpreter that does not exist or is not executable here, on `node`."""
    path = Path(python)
    if not path.is_file():
        problem = "does not exist" if not path.exists() else "is not a file"
    elif not os.access(path, os.X_OK):
        problem = "is not executable"
    else:
        return
    raise InterpreterMissing(
        f"the run's interpreter {python} {problem} on node {node}, and every group task is started with it: "
        "set cluster.python to the run's venv interpreter as the compute nodes see it (in launch/<cluster>.toml "
        "or --set cluster.python=/path/to/venv/bin/python), or install the venv on a filesystem the nodes share")


def _raise_cancelled(signum: int, frame: object) -> None:
    raise RunCancelled(f"received {signal.Signals(signum).name}")


def _late_usr2(signum: int, frame: object) -> None:
    """SIGUSR2 once training is over (the groups are stopping): nothing is left to checkpoint."""
    log.info("SIGUSR2 after the last step: the run is finishing, nothing to checkpoint")


async def _check(sup: Supervisor) -> None:
    """Program "check": release every task once all registered and hold_s passed; wait for the steps.
    A lost inference replica is started again, as in a real run, until the release."""
    sup.revivable = {INFERENCE}
    sup.start()
    started, registered_at = time.monotonic(), None
    while not await sup.poll():
        if registered_at is None and sup.all_registered:
            registered_at = time.monotonic()
            log.info(f"all {len(sup.expected)} tasks registered in {registered_at - started:.1f} s")
        if registered_at is not None and not sup.released and time.monotonic() - registered_at >= sup.launch.hold_s:
            sup.revivable = set()
            sup.release()
        await asyncio.sleep(0.1)


async def _train(sup: Supervisor, advertise: str) -> bool:
    """Program "rl": rendezvous store, the groups, the RL loop while the steps are watched.

    Returns True when the run was preempted (SIGUSR2, Slurm's pre-timeout signal): it checkpointed
    after the step in progress and stopped; False when it trained to the end."""
    from hpcrl.config.load import load_config
    from hpcrl.rendezvous.meet import serve_store
    from hpcrl.rl.checkpointing import refuse_unusable_checkpoints

    launch = sup.launch
    config = load_config(sup.run_dir / CONFIG_FILE)
    refuse_unusable_checkpoints(config)  # none usable: FAILED now, before any group starts, not requeued
    server = serve_store(load_secret(sup.run_dir), bind="tcp://0.0.0.0:0")
    store = f"tcp://{advertise}:{server.address.rpartition(':')[2]}"
    log.info(f"rendezvous store at {store} (requests signed with the run's secret)")
    # Spare nodes: a lost reward task (its calls wait and are made again) starts again inside the job too. The
    # trainer group of a split job starts again inside it from its newest checkpoint: in place when its node
    # lives (a killed rank; no spare needed), on a spare for a lost node (none left: requeued).
    sup.revivable = {INFERENCE, REWARD} if launch.spare_nodes else {INFERENCE}
    sup.trainer_restartable = launch.layout == "split" and launch.executor == "slurm"
    sup.start({"HPCRL_STORE_ADDR": store})
    preempt = asyncio.Event()

    def on_usr2() -> None:
        log.info("SIGUSR2 (the time limit is near): checkpointing after this step, then requeueing")
        preempt.set()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, on_usr2)
    generation = -1  # the weight-transfer group's, carried over a restart of the trainer group
    try:
        while True:
            ports: list = []
            try:
                preempted = await _train_once(sup, config, store, preempt, generation, ports.append)
            except GroupFailed as err:
                lost = err.lost if isinstance(err, TrainerLost) else await sup.settle_trainer_loss()
                if not lost:
                    if err.__cause__ is not None:
                        log.error("the RL loop failed", exc_info=err.__cause__)
                    raise
                log.warning(f"the RL loop stopped: {err}")
                generation = ports[0].generation if ports else generation
                await sup.restart_trainer(lost)  # GroupFailed when it cannot: the job is requeued
                continue
            sup.revivable, sup.trainer_restartable = set(), False
            sup.release()  # every task: exit 0
            await sup.wait_ended()
            return preempted
    finally:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGUSR2)  # leaves SIG_DFL, which would kill us
        signal.signal(signal.SIGUSR2, _late_usr2)
        refused = {k: v for k, v in server.refused().items() if v}
        if refused:
            log.warning(f"the rendezvous store refused requests: {refused}")
        server.close()


async def _train_once(sup: Supervisor, config, store: str, preempt: asyncio.Event, generation: int,
                      on_ports) -> bool:
    """One run of the RL loop while the supervisor watches the steps: True when preempted; GroupFailed (TrainerLost
    for a lost trainer rank the group may start again after) when a step or the loop failed."""
    from hpcrl.rl.program import run_program

    launch = sup.launch

    async def watch() -> None:
        while not await sup.poll():
            await asyncio.sleep(0.2)

    loop_task = asyncio.create_task(run_program(
        config, sup.router, store=store, steps=launch.stop_after, stop_requested=preempt.is_set,
        connect_timeout=launch.start_timeout_s, generation=generation, on_ports=on_ports,
        on_resumed=sup.trainer_running_again))
    watch_task = asyncio.create_task(watch())
    try:
        done, _ = await asyncio.wait({loop_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if watch_task in done:
            watch_task.result()  # raises GroupFailed naming the group and ranks
        try:
            return loop_task.result()
        except GroupFailed:
            raise
        except Exception as err:  # noqa: BLE001 - the loop's error ends the run FAILED, with its message
            # Logged by the caller, with its traceback, unless it was a lost trainer rank's (the group starts again).
            raise GroupFailed(f"the RL loop failed: {type(err).__name__}: {err}") from err
    finally:
        for task in (loop_task, watch_task):
            task.cancel()
        await asyncio.gather(loop_task, watch_task, return_exceptions=True)


def _bus_config(run_dir: Path, program: str) -> BusConfig:
    """The head's bus settings: the tasks' (BUS_SETTINGS), with this run's cluster.heartbeat_timeout_s and
    message limit (its largest message, hpcrl.bus.config.message_limit_for; the floor for program "check",
    which only registers tasks): what a client without the secret can make the head read is bounded by it."""
    if program != "rl":
        return BusConfig(**BUS_SETTINGS, max_message_bytes=MIN_MESSAGE_BYTES)
    from hpcrl.config.load import load_config

    try:
        config = load_config(run_dir / CONFIG_FILE)
    except HpcrlError:  # the program reports it (the run fails naming the key); the bus keeps its defaults
        return BusConfig(**BUS_SETTINGS)
    limit = message_limit_for(sequences=config.trainer.global_batch_size, tokens_per_sequence=config.max_model_len)
    # The head's heartbeat settings reach every task in its welcome (hpcrl.bus.config).
    return BusConfig(**{**BUS_SETTINGS, "heartbeat_timeout": config.cluster.heartbeat_timeout_s},
                     max_message_bytes=limit)


def _report_refusals(router: Router, run_dir: Path, last: dict[str, int], every_s: float) -> dict[str, int]:
    """Log the messages the bus refused since `last` (by reason) and rewrite REFUSED_FILE for
    `hpcrl status`, if any were; returns the counters now."""
    now = router.refused()
    if now == last:
        return last
    new = {reason: n - last.get(reason, 0) for reason, n in now.items() if n != last.get(reason, 0)}
    log.warning(f"bus: refused {sum(new.values())} message(s) in the last {every_s:g} s {new} (since the start: "
                f"{now}); bad_mac / too_large / truncated / version come from clients without the run's secret")
    write_json(run_dir / REFUSED_FILE, {"refused": now, "time": time.time()})
    return now


async def _watch_refusals(router: Router, run_dir: Path, every_s: float = REFUSALS_EVERY_S) -> None:
    """Report refused messages every `every_s` seconds while any come (a flood logs one line per period)."""
    last: dict[str, int] = {}
    while True:
        await asyncio.sleep(every_s)
        last = _report_refusals(router, run_dir, last, every_s)


async def _run(sup: Supervisor, advertise: str) -> bool:
    """Bind the bus, run the program, close the bus; True when the run was preempted."""
    refusals: asyncio.Task | None = None
    try:
        bound = await sup.router.start()
        refusals = asyncio.create_task(_watch_refusals(sup.router, sup.run_dir), name="hpcrl-head-refusals")
        sup.bus_address = f"tcp://{advertise}:{bound.rpartition(':')[2]}"
        log.info(f"run {sup.launch.run_name} ({sup.launch.executor}, layout {sup.launch.layout}): head on "
                     f"{sup.head_identity['node']}, bus at {sup.bus_address}")
        if sup.launch.program == "rl":
            return await _train(sup, advertise)
        await _check(sup)
        return False
    finally:
        if refusals is not None:
            refusals.cancel()
        refused = sup.router.refused()
        if refused:
            log.warning(f"the bus refused {sum(refused.values())} message(s): {refused}")
            write_json(sup.run_dir / REFUSED_FILE, {"refused": refused, "time": time.time()})
        await sup.router.close("the run is over")


def run_head(run_dir: Path | str) -> dict:
    """Start, watch and stop every group of the run in `run_dir`; return how it ended."""
    run_dir = Path(run_dir).absolute()
    # The job's own files (logs, checkpoints, metrics, submitit's result) are the owner's only, and
    # srun applies SLURM_UMASK to every task it starts. Both are restored for a head run in-process.
    mask, slurm_mask = os.umask(PRIVATE_UMASK), os.environ.get("SLURM_UMASK")
    os.environ["SLURM_UMASK"] = f"{PRIVATE_UMASK:04o}"
    try:
        try:
            lock = RunLock(run_dir, "the head of a job").acquire(wait_s=HEAD_LOCK_WAIT_S)
        except RunDirBusy as err:
            print(f"hpcrl head: {err}", file=sys.stderr, flush=True)
            raise GroupFailed(str(err)) from None
        try:
            return _run_head_locked(run_dir)
        finally:
            lock.release()
    finally:
        os.umask(mask)
        if slurm_mask is None:
            os.environ.pop("SLURM_UMASK", None)
        else:
            os.environ["SLURM_UMASK"] = slurm_mask


def _run_head_locked(run_dir: Path) -> dict:
    launch = read_launch(run_dir)
    setup_logging(run_dir, HEAD, 0, launch.verbose)  # logs/head/rank0.log, and stderr
    advertise = os.environ.get("HPCRL_HEAD_HOST") or socket.gethostname()
    router = Router(run_id=launch.run_name, secret=load_secret(run_dir), address="tcp://0.0.0.0:0",
                    config=_bus_config(run_dir, launch.program))
    # The tasks key the rendezvous store with the run's secret (HPCRL_RUN_DIR), never with one inherited
    # from whoever started this head (hpcrl.rendezvous.meet).
    os.environ.pop("HPCRL_STORE_SECRET_DIR", None)
    sup = Supervisor(launch, run_dir, router)
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    if launch.executor == "slurm":
        requeues.note_start(run_dir, restart=restart, node=str(sup.head_identity["node"]))
    previous = {sig: signal.signal(sig, _raise_cancelled) for sig in (signal.SIGTERM, signal.SIGINT)}
    started = time.time()
    state, error = "FAILED", ""
    joined = False  # True once this head joined a requeue Slurm began (nothing left to requeue)
    failures: list[dict] = []
    try:
        check_interpreter(launch.python, str(sup.head_identity["node"]))
        preempted = asyncio.run(_run(sup, advertise))
        state = ("REQUEUED" if launch.executor == "slurm" else "PREEMPTED") if preempted else "COMPLETED"
    except GroupFailed as err:
        failures = err.args[1] if len(err.args) > 1 else []
        error = err.args[0]
        restarts = restart
        if launch.program == "rl" and launch.executor == "slurm" and restarts < launch.max_requeues:
            # A node died or a task was killed: come back from the last checkpoint (a new allocation
            # avoids a dead node once Slurm has marked it down) instead of ending the run.
            state = "REQUEUED"
            log.error(f"run lost a task: {error}; requeueing to resume from the last checkpoint "
                      f"(restart {restarts + 1} of at most {launch.max_requeues})")
        else:
            log.error(f"run FAILED: {error}")
            raise GroupFailed(error) from None
    except InterpreterMissing as err:
        error = str(err)
        log.error(f"run FAILED: {error}")
        raise GroupFailed(error) from None
    except RunCancelled as err:
        state, error = "CANCELLED", str(err)
        if launch.executor == "slurm" and signal.SIGTERM.name in str(err) and _join_slurms_requeue():
            state, joined = "REQUEUED", True
        else:
            log.info(f"run CANCELLED ({err}); stopping every group")
        raise
    except Exception as err:  # a bug or an unreadable run directory: still FAILED, saying why
        error = f"the head failed: {type(err).__name__}: {err}"
        log.exception(error)
        raise
    finally:
        def record_end() -> None:
            write_json(run_dir / EXIT_FILE, {"state": state, "error": error, "failures": failures,
                                             "tasks": sup.identities(), "elapsed_s": round(time.time() - started, 3),
                                             "refused_messages": router.counters().get("dropped", 0),
                                             "refused": router.refused(),
                                             "step_codes": {s.slot.name: s.poll() for s in sup.steps}})
            if state == "REQUEUED":
                why = error
                if not error:
                    why = "the time limit is near (SIGUSR2): checkpointed, then requeued"
                elif signal.SIGTERM.name in error:
                    why = f"Slurm requeued the job (a node failed; the head {error})"
                requeues.note_requeue(run_dir, restart=restart, why=why)

        requeue_first = state == "REQUEUED" and not joined
        if requeue_first:
            # Back in the queue before the groups are stopped (_requeue_this_job says why), its record
            # written first: Slurm's SIGTERM follows, and its SIGKILL KillWait later.
            signal.signal(signal.SIGTERM, _requeue_under_way)
            record_end()
            requeue_error = _requeue_this_job()
            if requeue_error:
                state, error = "FAILED", f"{error}; {requeue_error}" if error else requeue_error
                log.error(f"run FAILED: {requeue_error}")
            else:
                log.info("requeued the job (scontrol requeue); it resumes from its newest checkpoint when it starts "
                         "again; stopping every group")
        sup.stop_steps()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if not requeue_first or state == "FAILED":
            record_end()
        if state == "COMPLETED":
            log.info(f"run COMPLETED in {time.time() - started:.1f} s")
        if state == "PREEMPTED":
            log.info("run stopped at a checkpoint: submit the same run directory again to resume")
    if state == "REQUEUED":
        raise SystemExit(-1)  # requeued: leave without a result, as submitit does after its own requeue
    if state == "FAILED":  # the requeue itself failed
        raise GroupFailed(error)
    return {"state": state, "tasks": sup.identities(), "run_dir": str(run_dir)}


def _join_slurms_requeue() -> bool:
    """On SIGTERM: when it is Slurm requeueing this hetjob (a node failed), requeue it too, at once.

    Slurm 22.05 requeues a hetjob component by component; a component whose tasks end before the
    leader does - they do as soon as this head stops its groups - is recorded COMPLETED instead, and
    the requeued job then waits for it for ever (PENDING, Resources). `scontrol requeue <leader>`
    while that component still runs flags it too (measured: docs/FACTS.md, Slurm). Slurm answers
    "Job is pending execution" for the components it has already requeued: that is expected."""
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if not job_id or not tracking.being_requeued(job_id):
        return False
    done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    log.warning(f"Slurm is requeueing this job (a node failed): requeued every component with it "
                f"(scontrol: {(done.stderr or done.stdout).strip() or 'ok'}); it resumes from its newest checkpoint")
    return True


def _requeue_this_job() -> str:
    """Put this job back in the queue (it keeps its id; Slurm restarts the head, which resumes); "" when it
    is, else why not.

    Called while every group's step still runs, before the head stops them: a component whose tasks
    ended is not requeued with the leader if Slurm is requeueing the job meanwhile (a node failed:
    _join_slurms_requeue), and the job then waits for it for ever. Measured on the local cluster (the
    fault matrix's inference case): Slurm marked the dead node DOWN 0-2 s after this head's own
    decision to requeue, in the seconds it spent stopping its groups. Slurm answers "Job is pending
    execution" when it began first; this requeue still takes the components that run, so that is no
    error."""
    job_id = os.environ.get("SLURM_JOB_ID", "")
    done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    if done.returncode == 0:
        return ""
    if "pending execution" in done.stderr:
        log.warning(f"Slurm was requeueing this job already (a node failed): requeued every component with it "
                    f"(scontrol: {done.stderr.strip()})")
        return ""
    return (f"scontrol requeue {job_id} failed ({done.stderr.strip()}): the run stopped at its checkpoint; "
            "submit the same run directory again to resume")


def _requeue_under_way(signum: int, frame: object) -> None:
    """SIGTERM once this head requeued its job: Slurm ending the job's steps, as a requeue does."""
    log.info("SIGTERM: the job is being requeued; stopping every group")


class HeadJob:
    """What submitit runs in the batch step: picklable, it carries only the run directory."""

    def __init__(self, run_dir: Path | str) -> None:
        self.run_dir = str(run_dir)

    def __call__(self) -> dict:
        os.umask(PRIVATE_UMASK)  # for good, in this job process: submitit's result pickle too
        return run_head(self.run_dir)

    def __repr__(self) -> str:
        return f"HeadJob({self.run_dir!r})"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hpcrl.launch.head RUN_DIR", file=sys.stderr)
        return 2
    os.umask(PRIVATE_UMASK)
    try:
        run_head(args[0])
    except GroupFailed:
        return 1
    except RunCancelled:
        return 143
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
