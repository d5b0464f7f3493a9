"""The NCCL link's own rules, in one process with a scripted communicator: operations only inside a
round, and a deadline that aborts the communicator whether the round's event never completes or
its group_end never returns (a peer that stopped). The two-sided behaviour over the strict fake
is in test_execute.py."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from hpcrl.errors import TransferError
from hpcrl.transfer.nccl import NcclGroup, NcclRuntime


class ScriptedComm:
    """Records calls; group_end blocks while `block` is set, until destroy (ncclCommAbort frees it)."""

    def __init__(self, *, block: bool = False) -> None:
        self.device, self.calls, self.aborted = torch.device("cpu"), [], threading.Event()
        self.block = block

    def group_start(self) -> None:
        self.calls.append("group_start")

    def group_end(self) -> None:
        self.calls.append("group_end")
        if self.block:
            self.aborted.wait(30)

    def send(self, tensor, dst, stream=None) -> None:
        self.calls.append(("send", dst, tensor.numel()))

    def recv(self, tensor, src, stream=None) -> None:
        self.calls.append(("recv", src, tensor.numel()))

    def destroy(self) -> None:
        self.calls.append("destroy")
        self.aborted.set()


def link(comm: ScriptedComm, *, done: bool) -> NcclGroup:
    runtime = NcclRuntime(device=lambda: torch.device("cpu"), communicator=lambda g, d: comm,
                          stream=lambda d: None, completion=lambda c, s: (lambda: done))
    return NcclGroup(rank=0, world_size=2, comm=comm, store=None, prefix=None, timeout_s=5, runtime=runtime)


@pytest.mark.timeout(30)
def test_a_round_is_one_nccl_group_and_its_operations_complete_together():
    comm = ScriptedComm()
    group = link(comm, done=True)
    with group.round(timedelta(seconds=5)):
        a = group.isend(torch.zeros(3), 1, 0)
        b = group.irecv(torch.zeros(4), 1, 1)
    assert a is b
    group.wait(a, timedelta(seconds=5))
    assert comm.calls == ["group_start", ("send", 1, 3), ("recv", 1, 4), "group_end"]


def test_an_operation_outside_a_round_is_refused():
    group = link(ScriptedComm(), done=True)
    with pytest.raises(TransferError, match="outside a round"):
        group.isend(torch.zeros(1), 1, 0)


@pytest.mark.timeout(30)
def test_a_round_that_never_completes_aborts_the_communicator_at_the_deadline():
    comm = ScriptedComm()
    group = link(comm, done=False)
    with group.round(timedelta(seconds=5)):
        work = group.irecv(torch.zeros(2), 1, 0)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="communicator was aborted"):
        group.wait(work, timedelta(seconds=0.5))
    assert 0.5 <= time.monotonic() - started < 3
    assert comm.calls[-1] == "destroy"
    with pytest.raises(TransferError, match="aborted"):  # the link is spent: the run forms the group again
        group.round(timedelta(seconds=1)).__enter__()


@pytest.mark.timeout(30)
def test_a_group_end_blocked_on_a_stopped_peer_is_freed_by_an_abort_at_the_deadline():
    comm = ScriptedComm(block=True)
    group = link(comm, done=True)
    started = time.monotonic()
    with pytest.raises(TransferError, match="group_end blocked for 0.5 s"):
        with group.round(timedelta(seconds=0.5)):
            group.isend(torch.zeros(2), 1, 0)
    assert time.monotonic() - started < 3
    assert "destroy" in comm.calls
