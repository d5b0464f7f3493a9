"""A peer's life as the router sees it, on real sockets: registered but not ready (no calls),
READY (serves), dismissed with an exit code, and the exit code sent afterwards by another
process on a connection of its own (a task's supervisor, hpcrl.bus.farewell) - accepted once."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import zmq
from bus_helpers import RUN_ID, fast_config, run, until

from hpcrl.bus import PeerInfo, Router, Worker, WorkerExit, zap
from hpcrl.bus.errors import UnknownEndpointError
from hpcrl.bus.farewell import FarewellLink, send_farewell

pytestmark = pytest.mark.timeout(30)


def info(replica: int = 0, task: int = 0) -> PeerInfo:
    return PeerInfo(run_id=RUN_ID, group="inf", replica=replica, task=task, host="localhost", pid=os.getpid())


def test_a_peer_that_is_not_ready_is_registered_but_takes_no_calls_until_it_says_ready(secret, address):
    async def go():
        events = []
        async with Router(run_id=RUN_ID, secret=secret, address=address, config=fast_config()) as router:
            router.watch(events.append)
            worker = Worker(info=info(), secret=secret, address=router.address, config=fast_config(), ready=False)
            serving = asyncio.create_task(worker.serve())
            await worker.welcomed()
            await until(lambda: [e.kind for e in events] == ["registered"], "no registered event")
            assert router.peers("inf") == [] and router.complete_replicas("inf") == []
            with pytest.raises(UnknownEndpointError, match="not ready yet"):
                await router.request("inf/0/0", "echo", 1, timeout=1)
            worker.add_endpoint("echo", lambda call: call.args, idempotent=True)  # after serve(): allowed until ready
            worker.mark_ready()
            assert await router.wait_for_peers("inf", 1, timeout=5) == [0]
            assert [e.kind for e in events] == ["registered", "ready"]
            assert await router.request("inf/0/0", "echo", "hi", timeout=5) == "hi"
            worker.stop("test over")
            await serving
    run(go())


def test_a_dismissed_peer_exits_with_the_code_the_head_gave_and_its_exit_code_is_one_event(secret, address):
    async def go():
        events = []
        async with Router(run_id=RUN_ID, secret=secret, address=address, config=fast_config()) as router:
            router.watch(events.append)
            worker = Worker(info=info(), secret=secret, address=router.address, config=fast_config())
            serving = asyncio.create_task(worker.serve())
            await router.wait_for_peers("inf", 1, timeout=5)
            assert router.dismiss("inf/0/0", code=3, reason="test over")
            assert await serving is WorkerExit.SHUTDOWN and worker.exit_code == 3
            assert not router.is_healthy("inf/0/0") and router.peers("inf") == []
            assert "dead" not in [e.kind for e in events]  # a dismissal is no death: no hooks, no event
            worker.stop("and once more", code=3)  # already gone: nothing to send, nothing counted
            assert router.counters()["dropped"] == 0
    run(go())


def test_the_exit_code_sent_by_a_supervisor_process_is_accepted_once_and_replays_are_refused(secret, address, run_dir):
    async def go():
        events = []
        async with Router(run_id=RUN_ID, secret=secret, address=address, config=fast_config()) as router:
            router.watch(events.append)
            link = FarewellLink()
            worker = Worker(info=info(), secret=secret, address=router.address, config=fast_config(),
                            incarnation=link.incarnation)
            serving = asyncio.create_task(worker.serve())
            await worker.welcomed()
            link.welcomed(worker.head_incarnation)
            # The supervisor is another process: it sends from a connection of its own, blocking.
            code = ("import sys, types\nfrom hpcrl.bus import load_secret\nfrom hpcrl.bus.farewell import send_farewell\n"
                    "link = types.SimpleNamespace(incarnation=bytes.fromhex(sys.argv[1]),"
                    " head_incarnation=bytes.fromhex(sys.argv[2]))\n"
                    "sys.exit(0 if send_farewell(link, address=sys.argv[3], secret=load_secret(sys.argv[4]),"
                    " code=137, reason='the task killed by SIGKILL') else 1)\n")
            sent = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", code, link.incarnation.hex(),
                                                            link.head_incarnation.hex(), router.address, str(run_dir)],
                                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=20)
            assert sent.returncode == 0
            await until(lambda: any(e.kind == "exited" for e in events), "the supervisor's exit code never came")
            exited = [e for e in events if e.kind == "exited"]
            assert [(e.info.name, e.code, e.reason) for e in exited] == [("inf/0/0", 137, "the task killed by SIGKILL")]
            assert not router.is_healthy("inf/0/0")
            before = router.counters()["dropped"]
            assert await asyncio.to_thread(send_farewell, link, address=router.address, secret=secret, code=0,
                                           reason="a second farewell")
            await until(lambda: router.counters()["dropped"] > before, "a second exit code was not refused")
            assert len([e for e in events if e.kind == "exited"]) == 1
            worker.stop("test over")
            await serving
    run(go())


def test_a_message_send_once_called_sent_arrives_even_when_its_process_exits_at_once(address, run_dir, secret):
    # A task's supervisor sends its farewell and then leaves with os._exit; ZeroMQ writes a queued
    # message from its I/O thread, which dies with the process. 64 MiB cannot leave in the moment
    # between the send and the exit, so only a send_once that waits for the message to be out of
    # the process passes this every time (a 300-byte farewell was lost in about 1 run of 10).
    router = zmq.Context.instance().socket(zmq.ROUTER)
    gate = zap.guard(router, secret)  # the head's handshake, as send_once's farewell meets it
    try:
        router.bind(address)
        payload = os.urandom(64 << 20)
        code = ("import os, sys\nfrom pathlib import Path\nfrom hpcrl.bus import load_secret\n"
                "from hpcrl.bus.channel import send_once\n"
                "sent = send_once(sys.argv[1], [sys.stdin.buffer.read()], secret=load_secret(Path(sys.argv[2])), "
                "timeout=20)\nos._exit(0 if sent else 1)\n")
        sent = subprocess.run([sys.executable, "-c", code, router.getsockopt_string(zmq.LAST_ENDPOINT), str(run_dir)],
                              input=payload, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=25)
        assert sent.returncode == 0, "send_once said the message could not leave"
        assert router.poll(5000), "the message send_once called sent never arrived"
        assert router.recv_multipart()[1] == payload
    finally:
        router.close(linger=0)
        gate.release()


def test_a_task_never_welcomed_sends_no_farewell(secret):
    assert not send_farewell(FarewellLink(), address="tcp://127.0.0.1:9", secret=secret, code=1, reason="x")

