"""Failures with real processes: kill -9 of a replica mid-request, relaunch and re-admission,
a stalled peer told to leave, and workers leaving when the head dies."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
from bus_helpers import REPO, RUN_ID, fast_config, run, spawn_worker, until

from hpcrl.bus import Router
from hpcrl.bus.errors import PeerDeadError
from hpcrl.bus.service import Service

HB, TIMEOUT = 0.2, 1.0  # generous: this 2-core machine is shared and stalls


def head_for(secret, address: str = "tcp://127.0.0.1:0", **kw) -> Router:
    return Router(run_id=RUN_ID, secret=secret, address=address,
                config=fast_config(heartbeat_interval=HB, heartbeat_timeout=TIMEOUT), **kw)


@pytest.mark.timeout(60)
def test_request_completes_on_another_replica_after_kill_9(secret, address, run_dir, procs):
    dead_at: dict[str, float] = {}

    async def go():
        loop = asyncio.get_running_loop()
        async with head_for(secret, address, on_unhealthy=lambda p: dead_at.setdefault(p.name, loop.time())) as head:
            procs.extend(spawn_worker(head.address, run_dir, replica=r, heartbeat=HB, timeout=TIMEOUT) for r in range(2))
            await head.wait_for_peers("inf", 2, timeout=30)
            svc = Service(head, "inf")
            calls = [asyncio.ensure_future(svc.route("slow", {"s": 0.8, "i": i}, timeout=20)) for i in range(20)]
            await until(lambda: head.outstanding("inf/0/0") + head.outstanding("inf/1/0") == 20, "20 calls in flight")
            assert head.outstanding("inf/0/0") == head.outstanding("inf/1/0") == 10  # spread over both replicas
            victim = head.peer("inf/0/0")
            os.kill(victim.pid, signal.SIGKILL)
            killed_at = loop.time()
            results = await asyncio.gather(*calls)
            assert sorted(r["args"]["i"] for r in results) == list(range(20))  # nothing lost
            assert {r["peer"] for r in results} == {"inf/1/0"}  # the victim answered nothing
            assert dead_at["inf/0/0"] - killed_at <= 2 * TIMEOUT
            assert not head.is_healthy("inf/0/0") and head.is_healthy("inf/1/0")
            with pytest.raises(PeerDeadError, match="peer inf/0/0: silent for"):
                await head.request("inf/0/0", "echo")
    run(go(), timeout=50)
    assert procs[0].wait(timeout=5) == -signal.SIGKILL


@pytest.mark.timeout(60)
def test_replica_relaunched_by_the_unhealthy_hook_is_readmitted(secret, run_dir, procs):
    async def go():
        relaunched = asyncio.Event()

        def relaunch(peer):  # what the launcher does: start the same replica again
            procs.append(spawn_worker(head.address, run_dir, replica=peer.replica, heartbeat=HB, timeout=TIMEOUT))
            relaunched.set()

        head = head_for(secret, on_unhealthy=relaunch)
        async with head:
            procs.append(spawn_worker(head.address, run_dir, replica=0, heartbeat=HB, timeout=TIMEOUT))
            await head.wait_for_peers("inf", 1, timeout=30)
            first_pid = head.peer("inf/0/0").pid
            procs[0].kill()
            await asyncio.wait_for(relaunched.wait(), 2 * TIMEOUT + 1)
            await head.wait_for_peers("inf", 1, timeout=30)
            assert head.peer("inf/0/0").pid != first_pid
            assert (await Service(head, "inf").route("echo", "back"))["args"] == "back"
    run(go(), timeout=50)


@pytest.mark.timeout(60)
def test_stalled_peer_declared_dead_is_told_to_leave_when_it_wakes(secret, run_dir, procs):
    async def go():
        loop = asyncio.get_running_loop()
        async with head_for(secret) as head:
            procs.append(spawn_worker(head.address, run_dir, replica=0, heartbeat=HB, timeout=TIMEOUT))
            await head.wait_for_peers("inf", 1, timeout=30)
            os.kill(procs[0].pid, signal.SIGSTOP)
            deadline = loop.time() + 2 * TIMEOUT
            while head.is_healthy("inf/0/0"):
                assert loop.time() < deadline, "a stopped peer was not declared unhealthy in time"
                await asyncio.sleep(0.02)
            os.kill(procs[0].pid, signal.SIGCONT)
            while procs[0].poll() is None:  # told BYE, or noticing the silence itself: it leaves
                await asyncio.sleep(0.02)
            assert procs[0].returncode == 0
            assert not head.is_healthy("inf/0/0")
    run(go(), timeout=50)
    assert procs[0].stdout.read().strip().splitlines()[-1] in ("SHUTDOWN", "HEAD_LOST")


@pytest.mark.timeout(60)
def test_workers_exit_cleanly_within_two_heartbeat_timeouts_after_the_head_is_killed(run_dir, procs):
    hb, timeout = 0.2, 1.0
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    head = subprocess.Popen([sys.executable, str(REPO / "tests/bus/head_proc.py"), str(run_dir), "--replicas", "3",
                             "--heartbeat", str(hb), "--timeout", str(timeout)],
                            env=env, stdout=subprocess.PIPE, text=True)
    procs.append(head)
    line = head.stdout.readline().split()
    assert line[0] == "address", line
    workers = [spawn_worker(line[1], run_dir, replica=r, heartbeat=hb, timeout=timeout) for r in range(3)]
    procs.extend(workers)
    assert head.stdout.readline().strip() == "ready"  # the head registered every worker ...
    for w in workers:  # ... and each has its WELCOME (else it would still be registering)
        assert w.stdout.readline().strip() == "welcomed"
    head.kill()
    killed = time.monotonic()
    exited = {}
    while len(exited) < len(workers) and time.monotonic() - killed < 10:
        for w in workers:
            if w.pid not in exited and w.poll() is not None:
                exited[w.pid] = time.monotonic() - killed
        time.sleep(0.01)
    assert len(exited) == 3, "a worker outlived its head"
    assert max(exited.values()) <= 2 * timeout, exited
    for w in workers:
        out, err = w.communicate(timeout=5)
        assert w.returncode == 0 and out.strip().splitlines()[-1] == "HEAD_LOST", err
