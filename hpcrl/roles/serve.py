"""A group task's life in a run: register on the bus, build the role, serve the head, exit as told.

    python -m hpcrl.roles trainer|inference|reward [--exit-code N]     (what the head's steps start)

  1. fork a supervisor (hpcrl.roles.reaper) that outlives the task: it ends whatever the task
     leaves running and sends the head the task's exit code, whatever ended it (hpcrl.bus.farewell)
  2. work out the task's identity (group, replica, rank, node) from its environment, and narrow the
     GPUs of its step to its own (hpcrl.plan.placement): from here on they are cuda:0..
  3. register on the bus (HPCRL_BUS_ADDR, the run's secret): the head now knows the task started
  4. program "check": wait to be dismissed. Program "rl": build the role (load engines, join the
     trainer's process group: the slow part), add its endpoints, say READY, serve the head
  5. exit with the code the head's BYE carried (check: or --exit-code N), HEAD_LOST when the head
     fell silent, or 1 when building the role failed (the error is in this task's log)
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from pathlib import Path

from hpcrl.bus import BusConfig, PeerInfo, Worker, WorkerExit, load_secret
from hpcrl.bus.farewell import FarewellLink, send_farewell
from hpcrl.config.groups import INFERENCE, REWARD, TASK_GROUPS, TRAINER
from hpcrl.contract.calls import serve_endpoints
from hpcrl.errors import HpcrlError
from hpcrl.logs import setup_logging
from hpcrl.plan.placement import place_gpus
from hpcrl.roles.reaper import supervise
from hpcrl.rundir import CONFIG_FILE
from hpcrl.slurm.identity import TaskIdentity, identify_task
from hpcrl.slurm.record import LaunchRecord, read_launch

#: Bus settings of a run: CPU steps can hold the GIL for a while, so peers get 30 s before they count as dead.
BUS_SETTINGS = {"heartbeat_interval": 1.0, "heartbeat_timeout": 30.0, "default_deadline": 600.0}
#: Exit code of a task whose head went away before telling it how to exit.
HEAD_LOST = 75

log = logging.getLogger(__name__)


def peer_info(identity: TaskIdentity, run_id: str) -> PeerInfo:
    """The task on the bus: the trainer is one replica of group_size ranks; every inference or
    reward task is a replica of one rank."""
    if identity.group == TRAINER:
        place = {"replica": 0, "rank": identity.rank, "replica_ranks": identity.group_size}
    else:
        place = {"replica": identity.rank, "rank": 0, "replica_ranks": 1}
    return PeerInfo(run_id=run_id, group=identity.group, task=identity.rank, host=identity.node,
                    pid=os.getpid(), gpu=os.environ.get("CUDA_VISIBLE_DEVICES", ""), cpus=task_cpus(os.environ),
                    threads=int(os.environ.get("OMP_NUM_THREADS", "0") or 0), **place)


def task_cpus(env: dict[str, str] | os._Environ[str]) -> int:
    """CPUs Slurm gave this task (SLURM_CPUS_PER_TASK), else those it may run on (its affinity)."""
    given = env.get("SLURM_CPUS_PER_TASK", "")
    return int(given) if given.isdigit() else len(os.sched_getaffinity(0))


def take_gpus(launch: LaunchRecord, identity: TaskIdentity) -> None:
    """Narrow CUDA_VISIBLE_DEVICES to this task's own GPUs (hpcrl.plan.placement), before anything
    imports torch; a GPU inference task also has vLLM spawn its workers (this process has threads)."""
    component = launch.group(identity.group).component
    if not component.gpus_per_task:
        return
    placement = place_gpus(os.environ, gpus_per_task=component.gpus_per_task, local_rank=identity.local_rank,
                           tasks_on_node=component.tasks_per_node, what=f"{identity.group} rank {identity.rank}")
    os.environ["CUDA_VISIBLE_DEVICES"] = placement.cuda_visible_devices
    if identity.group == INFERENCE:
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    log.info(f"{identity.group} rank {identity.rank}: GPUs {placement.cuda_visible_devices} "
             f"(local rank {identity.local_rank} of {placement.source}={','.join(placement.visible)})")


def own_address() -> str:
    """The address this host's name resolves to here: where its process groups are reached."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as err:
        return f"its name does not resolve: {err}"


def build_role(name: str, config, identity: TaskIdentity, env: dict[str, str]):
    if name == TRAINER:
        from hpcrl.roles.trainer import TrainerRole
        return TrainerRole(config, identity, env)
    if name == INFERENCE:
        from hpcrl.roles.inference import InferenceRole
        return InferenceRole(config, identity, env)
    if name == REWARD:
        from hpcrl.roles.reward import RewardRole
        return RewardRole(config, identity, env)
    raise HpcrlError(f"no role named {name!r}: groups are {', '.join(TASK_GROUPS)}")


def _exit_code(worker: Worker, how: WorkerExit, given: int | None) -> int:
    """Dismissed (the head's BYE carried a code): that code. Anything else - the head closed the bus
    without dismissing this task (it was cancelled, or Slurm is requeueing the job), fell silent, or
    was never reached - is HEAD_LOST: a task must not end 0 then, or Slurm records its component
    COMPLETED and a requeued hetjob waits for it for ever (docs/FACTS.md, Slurm)."""
    if given is not None:
        return given
    if how is WorkerExit.SHUTDOWN and worker.exit_code is not None:
        return worker.exit_code
    return HEAD_LOST


async def _serve(name: str, identity: TaskIdentity, run_dir: Path, launch: LaunchRecord, link: FarewellLink,
                 given: int | None) -> int:
    info = peer_info(identity, launch.run_name)
    rl = launch.program == "rl" and given is None
    worker = Worker(info=info, secret=load_secret(run_dir), address=os.environ["HPCRL_BUS_ADDR"],
                    config=BusConfig(**BUS_SETTINGS), ready=not rl, incarnation=link.incarnation)
    serving = asyncio.create_task(worker.serve())
    welcomed = asyncio.create_task(worker.welcomed())
    await asyncio.wait({serving, welcomed}, return_when=asyncio.FIRST_COMPLETED)
    if not welcomed.done():
        welcomed.cancel()
        how = serving.result()
        log.error(f"{name} rank {identity.rank}: not admitted by the head at {worker.address}: {how.value}")
        return _exit_code(worker, how, given)
    link.welcomed(worker.head_incarnation)
    log.info(f"{name} rank {identity.rank}: registered with the head as {info.name}")
    if not rl:  # program check (or a task told its exit code): wait to be dismissed
        return _exit_code(worker, await serving, given)
    from hpcrl.config.load import load_config

    config = load_config(run_dir / CONFIG_FILE)
    building = asyncio.get_running_loop().run_in_executor(None, build_role, name, config, identity, dict(os.environ))
    done, _ = await asyncio.wait({building, serving}, return_when=asyncio.FIRST_COMPLETED)
    if building not in done:  # dismissed (or the head died) while loading
        role = await building
        role.close()
        return _exit_code(worker, serving.result(), None)
    role = building.result()
    try:
        serve_endpoints(worker, role.group, role.handlers())
        worker.mark_ready()
        log.info(f"{name} rank {identity.rank}: serving the head as {info.name}")
        how = await serving
        log.info(f"{name} rank {identity.rank}: left the bus: {how.value} {worker.exit_detail}")
        return _exit_code(worker, how, None)
    finally:
        role.close()


def task_main(name: str, argv: list[str] | None = None) -> int:
    """A task of group `name`: see the module docstring. Returns the exit code (or never returns, rl)."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m hpcrl.roles {name}",
                                     description=f"A task of the {name} group (started by the head).")
    parser.add_argument("--exit-code", type=int, default=None,
                        help="exit with this code whatever the head says (after registering)")
    args = parser.parse_args(argv)
    try:
        run_dir = Path(os.environ.get("HPCRL_RUN_DIR", "."))
        address = os.environ.get("HPCRL_BUS_ADDR")
        if not address:
            raise HpcrlError("HPCRL_BUS_ADDR is not set: group tasks are started by the head (hpcrl submit)")
        launch = read_launch(run_dir)
        secret = load_secret(run_dir)
        identity = identify_task(os.environ)
    except HpcrlError as err:
        log.error(f"hpcrl.roles {name}: error: {err}")  # logging is not set up: Python prints it as it is
        return 2
    # The task's stdout and stderr already are logs/<group>/rank<k>.log (srun --output, or the local
    # executor): everything goes there, vLLM's processes included; the supervisor logs there too.
    setup_logging(run_dir, name, identity.rank, launch.verbose)
    link = FarewellLink()

    def tell_head(code: int, how: str) -> None:
        send_farewell(link, address=address, secret=secret, code=code, reason=f"the task {how}")

    supervise(f"hpcrl.roles {name}", on_exit=tell_head)  # nothing the task starts may outlive it
    try:
        if identity.group != name:
            raise HpcrlError(f"hpcrl.roles {name} was started as a task of group {identity.group!r}; "
                             f"the head starts `hpcrl.roles {identity.group}` for that group")
        take_gpus(launch, identity)
        log.info(f"{name} rank {identity.rank}/{identity.group_size} replica {identity.replica} "
                 f"on {identity.node} ({own_address()}, node {identity.node_index}): registering at {address}")
        code = asyncio.run(_serve(name, identity, run_dir, launch, link, args.exit_code))
    except HpcrlError as err:
        log.error(f"hpcrl.roles {name}: error: {err}")
        return 2
    except Exception as err:  # noqa: BLE001 - any failure ends the task with 1, reported by name
        log.exception(f"hpcrl.roles {name}: error: {err}")
        code = 1
    log.info(f"{name} rank {identity.rank}: exiting with code {code}")
    if launch.program == "rl":
        logging.shutdown()  # flush every handler: os._exit below does not
        # The role has closed its engines; skip interpreter teardown, where threads left by native
        # libraries (vLLM's, gloo's) can abort the process after its work is done.
        os._exit(code)
    return code
