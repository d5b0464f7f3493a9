"""What a group task exits with, decided from how it left the bus (real Router and Worker)."""

from __future__ import annotations

import asyncio
import os

import pytest

from hpcrl.bus import BusConfig, PeerInfo, Router, Worker, create_secret, load_secret
from hpcrl.roles.serve import HEAD_LOST, _exit_code

pytestmark = pytest.mark.timeout(30)


async def left_the_bus(secret, end) -> int:
    """Serve one worker, let `end(router)` end it, return the exit code the task would take."""
    config = BusConfig(heartbeat_interval=0.1, heartbeat_timeout=1.0, register_timeout=10)
    router = Router(run_id="r", secret=secret, address="tcp://127.0.0.1:0", config=config)
    await router.start()
    worker = Worker(info=PeerInfo(run_id="r", group="reward", replica=0, pid=os.getpid()), secret=secret,
                    address=router.address, config=config)
    serving = asyncio.create_task(worker.serve())
    await router.wait_for_peers("reward", 1, timeout=10)
    await end(router)
    how = await asyncio.wait_for(serving, 10)
    await router.close()
    return _exit_code(worker, how, None)


def test_a_dismissed_task_exits_with_the_code_the_head_gave(tmp_path):
    create_secret(tmp_path)

    async def dismiss(router):
        router.dismiss("reward/0/0", 0, "the run is over")
    assert asyncio.run(left_the_bus(load_secret(tmp_path), dismiss)) == 0


def test_a_task_whose_head_closed_the_bus_without_dismissing_it_exits_head_lost_not_0(tmp_path):
    """Slurm requeueing a hetjob SIGTERMs the head, which closes the bus: a task that then ended 0
    would leave its component COMPLETED, and the requeued hetjob pending for ever."""
    create_secret(tmp_path)

    async def close(router):
        await router.close("received SIGTERM")
    assert asyncio.run(left_the_bus(load_secret(tmp_path), close)) == HEAD_LOST
