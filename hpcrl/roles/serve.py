"""A group task's life in a run: report, build the role, serve the head over the bus, exit as told.

    1. hello to the head (report protocol; the head names a rank that never reports)
    2. build the role (load engines, join the trainer process group) - the slow part
    3. register on the bus (HPCRL_BUS_ADDR, the run's secret) and serve the role's endpoints
    4. end when the head says exit (its word carries the exit code), or when the head is gone
       (HEAD_LOST), or when building the role failed (1: the error is in this task's log)
    5. bye with the code, then exit with it
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import traceback
from pathlib import Path

from hpcrl.errors import HpcrlError
from hpcrl.launch.report import HEAD_LOST, ReportClient
from hpcrl.slurm.identity import TaskIdentity

#: Bus settings of a run: CPU steps can hold the GIL for a while, so peers get 30 s before they count as dead.
BUS_SETTINGS = {"heartbeat_interval": 1.0, "heartbeat_timeout": 30.0, "default_deadline": 600.0}


def build_role(name: str, config, identity: TaskIdentity, env: dict[str, str]):
    if name == "trainer":
        from hpcrl.roles.trainer import TrainerRole
        return TrainerRole(config, identity, env)
    if name == "inference":
        from hpcrl.roles.inference import InferenceRole
        return InferenceRole(config, identity, env)
    if name == "reward":
        from hpcrl.roles.reward import RewardRole
        return RewardRole(config, identity, env)
    raise HpcrlError(f"no role named {name!r}: groups are trainer, inference and reward")


def _watch_exit(client: ReportClient, loop: asyncio.AbstractEventLoop, said: asyncio.Future) -> None:
    """Thread: wait for the head's exit word (or its loss) and hand it to the loop."""
    try:
        code = client.wait_exit()
    except HpcrlError:
        code = None

    def hand_over() -> None:
        if not said.done():
            said.set_result(code)
    try:
        loop.call_soon_threadsafe(hand_over)
    except RuntimeError:  # the loop has already ended
        pass


async def _serve(name: str, identity: TaskIdentity, run_dir: Path, launch: dict, client: ReportClient) -> int:
    from hpcrl.bus import BusConfig, PeerInfo, Worker, load_secret
    from hpcrl.config.load import load_config
    from hpcrl.launch.rundir import CONFIG_FILE

    loop = asyncio.get_running_loop()
    said: asyncio.Future = loop.create_future()
    threading.Thread(target=_watch_exit, args=(client, loop, said), daemon=True, name="hpcrl-report").start()
    config = load_config(run_dir / CONFIG_FILE)
    env = dict(os.environ)
    building = loop.run_in_executor(None, build_role, name, config, identity, env)
    done, _ = await asyncio.wait({building, said}, return_when=asyncio.FIRST_COMPLETED)
    if building not in done:  # told to exit (or the head died) while loading
        code = said.result()
        role = await building
        role.close()
        return HEAD_LOST if code is None else code
    role = building.result()
    try:
        address = os.environ.get("HPCRL_BUS_ADDR")
        if not address:
            raise HpcrlError("HPCRL_BUS_ADDR is not set: the head sets it when it runs the RL program")
        info = PeerInfo(run_id=launch["run_name"], group=name, host=identity.node, pid=os.getpid(), **role.peer())
        worker = Worker(info=info, secret=load_secret(run_dir), address=address, config=BusConfig(**BUS_SETTINGS))
        for endpoint, (fn, idempotent) in role.endpoints().items():
            worker.add_endpoint(endpoint, fn, idempotent=idempotent)
        print(f"{name} rank {identity.rank}: serving the head as {info.name} on {address}", flush=True)
        serving = asyncio.create_task(worker.serve())
        done, _ = await asyncio.wait({serving, said}, return_when=asyncio.FIRST_COMPLETED)
        if said in done:
            worker.stop("the head said exit")
            await serving
            code = said.result()
            return HEAD_LOST if code is None else code
        how = serving.result()
        print(f"{name} rank {identity.rank}: left the bus: {how.value} {worker.exit_detail}", flush=True)
        try:  # the head closes the bus after telling everyone to exit: the word may still come
            code = await asyncio.wait_for(said, 30.0)
        except TimeoutError:
            code = None
        return HEAD_LOST if code is None else code
    finally:
        role.close()


def serve_role(name: str, identity: TaskIdentity, run_dir: Path, launch: dict, report_address: str) -> int:
    """Run this task's role until the head says exit; returns the exit code (see the module docstring)."""
    client = ReportClient(report_address, identity.to_dict(), pid=os.getpid())
    try:
        code = asyncio.run(_serve(name, identity, run_dir, launch, client))
    except Exception as err:  # noqa: BLE001 - any failure ends the task with 1, reported by name
        traceback.print_exc()
        print(f"hpcrl.{name} rank {identity.rank}: error: {err}", file=sys.stderr, flush=True)
        code = 1
    client.bye(code)
    client.close()
    return code
