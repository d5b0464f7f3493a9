"""Router and workers on real ZeroMQ sockets (tcp on 127.0.0.1 and ipc), in one process:
registration, route / fanout / call_all, deadlines, typed errors, buffers."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
from bus_helpers import RUN_ID, echo_worker, fast_config, run, serving, until

from hpcrl.bus import Payload, PeerInfo, Router, Worker, WorkerExit
from hpcrl.bus.errors import (
    DeadlineExceeded,
    HeadClosedError,
    NoHealthyReplicaError,
    PeerDeadError,
    RemoteError,
    UnknownEndpointError,
    UnknownPeerError,
)
from hpcrl.bus.service import Service

pytestmark = pytest.mark.timeout(30)


def head_at(secret, address, **kw) -> Router:
    return Router(run_id=RUN_ID, secret=secret, address=address, config=fast_config(**kw))


@contextlib.asynccontextmanager
async def echo_group(secret, address, replicas: int):
    """A head, `replicas` echo workers of group "inf" registered with it, and a Service over them."""
    async with head_at(secret, address) as head:
        async with serving(*[echo_worker(secret, head.address, replica=r) for r in range(replicas)]):
            await head.wait_for_peers("inf", replicas, timeout=10)
            yield head, Service(head, "inf")


def test_workers_register_with_their_identity_and_endpoints(secret, address):
    async def go():
        async with head_at(secret, address) as head:
            assert head.address != "tcp://127.0.0.1:0" and head.address.split(":")[0] in ("tcp", "ipc")
            workers = [echo_worker(secret, head.address, replica=r) for r in range(3)]
            async with serving(*workers):
                assert await head.wait_for_peers("inf", 3, timeout=10) == [0, 1, 2]
                info = head.peer("inf/1/0")
                assert (info.run_id, info.group, info.replica, info.rank, info.host) == (RUN_ID, "inf", 1, 0, "localhost")
                assert head.is_idempotent("inf/1/0", "echo") and not head.is_idempotent("inf/1/0", "fail")
            counters = head.counters()
            assert counters["dropped"] == 0 and counters["accepted"] >= 3
    run(go())


def test_route_goes_to_the_replica_with_fewest_outstanding_calls(secret, address):
    async def go():
        async with echo_group(secret, address, 2) as (head, svc):
            busy = asyncio.ensure_future(svc.route("slow", {"s": 1.5}))
            await until(lambda: head.outstanding("inf/0/0") + head.outstanding("inf/1/0") == 1, "the slow call is out")
            busy_peer = "inf/0/0" if head.outstanding("inf/0/0") else "inf/1/0"
            quick = [await svc.route("echo", i) for i in range(5)]
            assert {q["peer"] for q in quick} == {"inf/0/0", "inf/1/0"} - {busy_peer}
            assert (await busy)["peer"] == busy_peer
            both = {(await svc.route("echo", i))["peer"] for i in range(6)}  # idle: both used
            assert both == {"inf/0/0", "inf/1/0"}
    run(go())


def test_fanout_reaches_every_replica_and_returns_results_in_replica_order(secret, address):
    async def go():
        async with echo_group(secret, address, 4) as (head, svc):
            out = await svc.fanout("echo", {"v": 7})
            assert [o["peer"] for o in out] == [f"inf/{r}/0" for r in range(4)]
            assert all(o["args"] == {"v": 7} for o in out)
            with pytest.raises(RemoteError, match=r"peer inf/\d/0: endpoint 'fail' raised ValueError: boom"):
                await svc.fanout("fail")  # the first error to arrive, from any replica
            # the abandoned calls are forgotten on the next loop turn
            await until(lambda: all(head.outstanding(f"inf/{r}/0") == 0 for r in range(4)), "calls left outstanding")
    run(go())


def test_calls_waiting_when_the_head_closes_and_calls_after_it_fail_as_closed_not_as_a_dead_peer(secret, address):
    """A closed head is not a replica's death: nothing may retry such a call on another replica."""
    async def go():
        async with echo_group(secret, address, 2) as (head, svc):
            waiting = asyncio.ensure_future(svc.route("slow", {"s": 5.0}))
            await until(lambda: head.outstanding("inf/0/0") + head.outstanding("inf/1/0") == 1, "the slow call is out")
            await head.close("the run is over")
            with pytest.raises(HeadClosedError, match=r"the call of 'slow' on inf/\d/0 was abandoned: the run is over"):
                await waiting
            assert head.is_healthy("inf/0/0") and head.is_healthy("inf/1/0")  # neither was declared dead
            with pytest.raises(HeadClosedError, match=r"the head's bus is closed \(the run is over\)"):
                await svc.route("echo", 1)
            with pytest.raises(HeadClosedError):
                await svc.fanout("echo", 1)
    run(go())


def test_call_past_its_deadline_raises_deadline_exceeded_naming_the_peer(secret, address):
    async def go():
        async with echo_group(secret, address, 1) as (head, svc):
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(DeadlineExceeded, match=r"peer inf/0/0: call to 'slow' did not complete within 0.2 s"):
                await svc.route("slow", {"s": 5}, timeout=0.2)
            assert loop.time() - start < 1.0
            assert head.outstanding("inf/0/0") == 0
            assert (await svc.route("echo", 1, timeout=2))["args"] == 1  # the peer is fine
    run(go())


def test_typed_errors_name_the_peer_for_unknown_peers_endpoints_and_empty_groups(secret, address):
    async def go():
        async with echo_group(secret, address, 1) as (head, svc):
            with pytest.raises(UnknownPeerError, match="peer inf/5/0"):
                await head.request("inf/5/0", "echo")
            with pytest.raises(UnknownEndpointError, match=r"peer inf/0/0: has no endpoint 'nope' .*echo"):
                await head.request("inf/0/0", "nope")
            with pytest.raises(NoHealthyReplicaError, match="group reward"):
                await Service(head, "reward").route("echo")
    run(go())


def test_buffers_travel_raw_both_ways(secret, address):
    async def go():
        async with head_at(secret, address) as head:
            worker = Worker(info=PeerInfo(run_id=RUN_ID, group="inf", replica=0), secret=secret,
                            address=head.address, config=fast_config())

            @worker.endpoint()
            async def reverse(call):
                return Payload(value={"n": len(call.buffers)}, buffers=[bytes(b)[::-1] for b in call.buffers])

            async with serving(worker):
                await head.wait_for_peers("inf", 1, timeout=10)
                blob = bytes(range(256)) * 1000  # above zmq's copy threshold: sent zero-copy
                out = await head.request("inf/0/0", "reverse", buffers=[blob, bytearray(b"ab")])
                assert isinstance(out, Payload) and out.value == {"n": 2}
                assert bytes(out.buffers[0]) == blob[::-1] and bytes(out.buffers[1]) == b"ba"
    run(go())


def test_call_all_reaches_every_rank_of_one_replica_in_rank_order(secret, address):
    async def go():
        async with head_at(secret, address) as head:
            workers = [echo_worker(secret, head.address, group="trainer", rank=k, ranks=3) for k in range(3)]
            async with serving(*workers[:2]):
                await until(lambda: len(head.peers("trainer")) == 2, "two ranks did not register")
                assert head.complete_replicas("trainer") == []
                with pytest.raises(NoHealthyReplicaError, match=r"lacks ranks \[2\]"):
                    await Service(head, "trainer").call_all(0, "echo")
                async with serving(workers[2]):
                    await head.wait_for_peers("trainer", 1, timeout=10)
                    out = await Service(head, "trainer").call_all(0, "echo", "x")
                    assert [o["peer"] for o in out] == ["trainer/0/0", "trainer/0/1", "trainer/0/2"]
    run(go())


def test_worker_with_a_wrong_secret_is_never_admitted(secret, address, tmp_path):
    from hpcrl.bus import create_secret

    async def go():
        async with head_at(secret, address) as head:
            other = create_secret(tmp_path / "other")
            intruder = echo_worker(other, head.address, config=fast_config(register_timeout=0.5))
            assert await intruder.serve() == WorkerExit.UNREACHABLE
            # Its token (derived from its secret) is refused at the handshake: nothing reaches the MAC check.
            assert head.peers() == [] and head.counters()["handshake"] >= 1
            assert head.counters()["accepted"] == head.counters()["dropped"] == 0
    run(go())


def test_worker_leaves_when_the_head_closes_and_the_head_logs_no_secret(secret, address, caplog):
    caplog.set_level(logging.DEBUG, logger="hpcrl.bus")

    async def go():
        head = head_at(secret, address)
        await head.start()
        worker = echo_worker(secret, head.address)
        task = asyncio.create_task(worker.serve())
        await head.wait_for_peers("inf", 1, timeout=10)
        await Service(head, "inf").route("echo", 1)
        await head.close()
        assert await asyncio.wait_for(task, 5) == WorkerExit.SHUTDOWN
    run(go())
    assert "registered" in caplog.text
    assert secret.key.hex() not in caplog.text and repr(secret.key) not in caplog.text


def test_non_idempotent_call_on_a_replica_that_leaves_raises_peer_dead(secret, address):
    async def go():
        async with head_at(secret, address) as head:
            a, b = (echo_worker(secret, head.address, replica=r) for r in range(2))

            @a.endpoint()
            async def once(call):
                await asyncio.sleep(5)

            @b.endpoint()
            async def once(call):  # noqa: F811 (same endpoint on the other replica)
                await asyncio.sleep(5)

            async with serving(a, b):
                await head.wait_for_peers("inf", 2, timeout=10)
                call = asyncio.ensure_future(head.request("inf/0/0", "once", timeout=10))
                await until(lambda: head.outstanding("inf/0/0") == 1, "the call is not out")
                a.stop("leaving for the test")
                with pytest.raises(PeerDeadError, match="peer inf/0/0: left: leaving for the test"):
                    await call
                assert not head.is_healthy("inf/0/0") and head.is_healthy("inf/1/0")
    run(go())


def test_plain_function_endpoints_are_answered_and_their_errors_come_back_typed(secret, address):
    async def go():
        async with head_at(secret, address) as head:
            worker = Worker(info=PeerInfo(run_id=RUN_ID, group="inf", replica=0), secret=secret,
                            address=head.address, config=fast_config())
            worker.add_endpoint("double", lambda call: call.args * 2, idempotent=True)
            worker.add_endpoint("divide", lambda call: 1 / call.args)
            worker.add_endpoint("opaque", lambda call: object())
            async with serving(worker):
                await head.wait_for_peers("inf", 1, timeout=10)
                assert await head.request("inf/0/0", "double", 21) == 42
                with pytest.raises(RemoteError, match="ZeroDivisionError"):
                    await head.request("inf/0/0", "divide", 0)
                with pytest.raises(RemoteError, match="cannot be sent"):
                    await head.request("inf/0/0", "opaque")
    run(go())


def test_second_registration_of_a_peer_replaces_the_first_without_calling_the_hook(secret, address):
    hooked = []

    async def go():
        head = Router(run_id=RUN_ID, secret=secret, address=address, config=fast_config(), on_unhealthy=hooked.append)
        async with head:
            old, new = echo_worker(secret, head.address), echo_worker(secret, head.address)
            async with serving(old) as (old_task,):
                await head.wait_for_peers("inf", 1, timeout=10)
                async with serving(new):
                    assert await asyncio.wait_for(old_task, 5) == WorkerExit.SHUTDOWN
                    assert "replaced" in old.exit_detail
                    assert head.is_healthy("inf/0/0")
                    assert (await head.request("inf/0/0", "echo", 1))["args"] == 1
            await until(lambda: hooked, "the hook did not run when the peer left")
    run(go())
    assert [p.name for p in hooked] == ["inf/0/0"]  # only when `new` left at the end, not on replacement


def test_fanout_past_its_deadline_raises_naming_a_peer_and_forgets_every_call(secret, address):
    async def go():
        async with echo_group(secret, address, 3) as (head, svc):
            with pytest.raises(DeadlineExceeded, match=r"peer inf/0/0: call to 'slow' did not complete within 0.2 s"):
                await svc.fanout("slow", {"s": 5}, timeout=0.2)
            await until(lambda: [head.outstanding(f"inf/{r}/0") for r in range(3)] == [0, 0, 0], "calls left outstanding")
            assert len(await svc.fanout("echo", 1, timeout=5)) == 3
    run(go())


def test_a_head_awaiting_a_slow_reply_polls_only_for_reply_spin_then_sleeps(secret, address):
    """The busy-poll after a request is bounded: waiting a second for a reply, or idling after
    quick calls, costs the head's process a small part of a CPU second (unbounded: about all)."""
    import time

    async def go():
        async with head_at(secret, address, reply_spin=0.05) as head:
            async with serving(echo_worker(secret, head.address)):
                await head.wait_for_peers("inf", 1, timeout=10)
                svc = Service(head, "inf")
                cpu = time.process_time()
                assert (await svc.route("slow", {"s": 1.0}))["args"] == {"s": 1.0}
                waiting = time.process_time() - cpu
                for i in range(20):  # quick calls: the spin ends with the last reply
                    assert (await svc.route("echo", i))["args"] == i
                cpu = time.process_time()
                await asyncio.sleep(1.0)
                idle = time.process_time() - cpu
        assert waiting < 0.3, f"the head used {waiting:.2f} s of CPU awaiting a 1 s reply (reply_spin 0.05 s)"
        assert idle < 0.15, f"the head used {idle:.2f} s of CPU in 1 s with no call outstanding"
    run(go())
