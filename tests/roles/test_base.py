"""A role's engine thread takes its CUDA device itself, and says which (a fake device table: no CUDA)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from hpcrl.errors import HpcrlError
from hpcrl.roles.base import EngineThread, Role
from hpcrl.roles.trainer import trainer_device


class FakeDevices:
    """torch.cuda's device calls as CUDA behaves: the current device belongs to the calling thread (0
    until that thread sets another)."""

    def __init__(self, count: int, *, settable: bool = True) -> None:
        self.count, self.settable = count, settable
        self._local = threading.local()
        self.set_in: list[str] = []

    def device_count(self) -> int:
        return self.count

    def set_device(self, index: int) -> None:
        self.set_in.append(threading.current_thread().name)
        if self.settable:
            self._local.device = index

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)


class Probe(Role):
    group = "probe"


def test_the_engine_thread_reports_the_device_it_was_given_and_every_engine_call_runs_on_it():
    devices = FakeDevices(2)
    role = Probe(device=1, devices=devices)
    try:
        assert role.engine_thread.device == 1
        seen = asyncio.run(role.on_engine(lambda: (devices.current_device(), threading.current_thread().name)))
        assert seen[0] == 1 and seen[1].startswith("hpcrl-probe")
        assert devices.set_in == [seen[1]]  # set once, in the engine thread itself
        assert devices.current_device() == 0  # the thread that built the role keeps its own device
    finally:
        role.close()


def test_a_role_without_a_device_never_touches_cuda():
    devices = FakeDevices(0)
    role = Probe(devices=devices)
    role.close()
    assert role.engine_thread.device is None and devices.set_in == []


def test_a_device_the_task_does_not_see_is_a_clear_error():
    with pytest.raises(HpcrlError, match="CUDA device 1, but this task sees 1 device"):
        EngineThread("hpcrl-trainer", device=1, devices=FakeDevices(1))


def test_a_device_that_does_not_become_the_engine_threads_current_device_is_a_clear_error():
    with pytest.raises(HpcrlError, match="set CUDA device 1 in the engine thread, but its current device is 0"):
        EngineThread("hpcrl-trainer", device=1, devices=FakeDevices(2, settable=False))


def test_a_trainer_rank_that_sees_only_its_own_gpu_runs_on_device_0_whatever_its_local_rank():
    assert [trainer_device(local_rank, 1) for local_rank in (0, 3, 7)] == [0, 0, 0]
    assert trainer_device(3, 8) == 3  # a launch that left the node's GPUs visible
    with pytest.raises(HpcrlError, match="sees no CUDA device"):
        trainer_device(0, 0)
    with pytest.raises(HpcrlError, match="local rank 4 sees only 2 CUDA devices"):
        trainer_device(4, 2)
