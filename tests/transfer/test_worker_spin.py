"""vLLM's CPU workers stop busy-looping soon after a read once hpcrl's worker extension is loaded."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")


def test_a_cpu_worker_reader_spins_for_milliseconds_not_a_second(tmp_path):
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    import hpcrl.transfer.vllm_adapter as adapter  # what vLLM's workers import (worker_extension_cls)

    adapter.quiet_idle_workers()  # idempotent: the import already did it
    context = zmq.Context()
    address = f"ipc://{tmp_path}/notify"
    writer = SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = SpinCondition(is_reader=True, context=context, notify_address=address)
    try:
        assert reader.busy_loop_s == 1  # vLLM's own default
        reader.record_read()
        reader.wait(timeout_ms=0)
        assert reader.busy_loop_s == adapter.CPU_WORKER_SPIN_S
        time.sleep(2 * adapter.CPU_WORKER_SPIN_S)
        start = time.monotonic()
        reader.wait(timeout_ms=200)  # past the spin: it sleeps on its notify socket until the timeout
        assert time.monotonic() - start >= 0.15
    finally:
        for sock in (writer.local_notify_socket, reader.local_notify_socket, reader.read_cancel_socket,
                     reader.write_cancel_socket):
            sock.close(linger=0)
        context.term()
