"""What importing hpcrl's worker extension does in a vLLM worker, and what the client side leaves alone.

vLLM's CPU workers stop busy-looping soon after a read once the extension is loaded, and the weight-transfer
engine is registered there; starting or stopping an LLM (the reward model's too) patches nothing.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]


def test_a_cpu_worker_reader_spins_for_milliseconds_not_a_second(tmp_path):
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    import hpcrl.inference.vllm_worker as adapter  # what vLLM's workers import (worker_extension_cls)

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


def test_the_worker_extension_is_what_the_engine_names_and_loading_it_registers_the_transfer_engine():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from hpcrl.inference import vllm_worker
    from hpcrl.inference.vllm_llm import WORKER_EXTENSION
    from hpcrl.transfer.vllm_engine import ENGINE_NAME, HpcrlWeightTransferEngine

    module, _, name = WORKER_EXTENSION.rpartition(".")
    assert module == vllm_worker.__name__ and getattr(vllm_worker, name) is vllm_worker.HpcrlWorkerExtension
    assert WeightTransferEngineFactory._registry[ENGINE_NAME]() is HpcrlWeightTransferEngine  # its loader


@pytest.mark.timeout(120)
def test_the_client_side_and_the_reward_model_leave_vllms_workers_unpatched_and_unregistered():
    """Only a process that loads the worker extension (vLLM's workers) gets the spin patch and the
    engine's registration: the reward model's engine and the inference client import neither."""
    code = ("import hpcrl.inference.engine, hpcrl.reward.model, hpcrl.inference.vllm_llm as glue, sys\n"
            "from vllm.distributed.device_communicators.shm_broadcast import SpinCondition\n"
            "assert not hasattr(SpinCondition.wait, 'hpcrl_spin_s'), 'patched'\n"
            "assert 'hpcrl.transfer.vllm_engine' not in sys.modules, 'transfer engine imported'\n"
            "assert 'hpcrl.inference.vllm_worker' not in sys.modules, 'worker extension imported'\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=110,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
