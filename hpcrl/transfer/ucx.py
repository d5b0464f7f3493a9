"""The UCX transport of the transfer group (optional): the one hpcrl module that imports ucxx.

    group = open_ucx_group(store=address, rank=r, world_size=w, timeout_s=120)

Install with `pip install ucxx-cu12` (RAPIDS' UCX bindings; on a machine without GPUs it moves
host memory over shared memory or TCP). Every rank makes one UCX worker and publishes its worker
address in the transfer group's rendezvous store; a sender makes an endpoint to a receiver from that
address the first time it sends to it (`create_from_worker_address`: no listener, no port).
Receives are posted on the worker (not on an endpoint) with a tag that carries both the sender's
group rank and the message number, `(src << 32) | tag`, so every receive matches exactly one
message of one sender, in any order of arrival.

Requests are driven by this thread (`worker.progress_once()` until done or the deadline), with no
progress thread and no event loop, so the caller's thread (a trainer rank, a vLLM worker inside
collective_rpc) sees a plain blocking call with a timeout. Endpoints are made with UCX's error
handling on: a peer that dies fails the sender's request with an error instead of killing the
process; a receiver waiting for a dead sender runs into its timeout. Only host memory is moved:
with tensors on a GPU, execute.py stages them in pinned host buffers (GPU buffers through ucxx's
CUDA support are not built: untested here; NCCL is the GPU transport).
"""

from __future__ import annotations

import os
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.errors import TransferError
from hpcrl.rendezvous.meet import rendezvous_store, store_digests
from hpcrl.rendezvous.store import BusStore

_TAG_BITS = 32
_IDLE_SPINS = 64  # progress() calls without progress before the thread sleeps a little
_IDLE_SLEEP_S = 20e-6


def _ucxx():
    # ucxx sets UCX_MEMTYPE_CACHE, which UCX builds without CUDA warn about on every process.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        import ucxx._lib.libucxx as libucxx
        from ucxx._lib.arr import Array
        from ucxx.types import Tag
    except ImportError as err:
        raise TransferError(f"the UCX weight transport needs ucxx ({err}): pip install ucxx-cu12, or use "
                            "inference.weight_transport = \"gloo\"") from None
    return libucxx, Array, Tag


@dataclass(eq=False)
class _Request:
    request: Any
    keep: tuple
    """The tensor and its UCX array view: alive until the request completes."""
    what: str


@dataclass(eq=False)
class UcxGroup:
    """One rank's UCX worker, its endpoints to the ranks it sends to, and the rendezvous store."""

    rank: int
    world_size: int
    store: BusStore
    prefix: dist.PrefixStore
    timeout_s: float
    transport = "ucx"
    device = torch.device("cpu")
    """Where staging buffers live: host memory (pinned when the tensors are on a GPU)."""

    def round(self, timeout: timedelta) -> AbstractContextManager[None]:
        """One round of the schedule: nothing to group (operations are posted as issued)."""
        return nullcontext()

    _endpoints: dict[int, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._lib, self._array, self._tag = _ucxx()
        self._context = self._lib.UCXContext({})
        self._worker = self._lib.UCXWorker(self._context, enable_delayed_submission=False,
                                           enable_python_future=False)
        self.prefix.set(f"ucx/address/{self.rank}", self._worker.address.tobytes())

    def _tag_of(self, src: int, tag: int):
        if not 0 <= tag < (1 << _TAG_BITS):
            raise TransferError(f"message tag {tag} does not fit in {_TAG_BITS} bits")
        return self._tag((src << _TAG_BITS) | tag)

    def _bytes(self, buf: torch.Tensor):
        if buf.device.type != "cpu":
            raise TransferError(f"the UCX weight transport moves CPU tensors; this buffer is on {buf.device} "
                                "(execute.py stages GPU tensors in host memory for it; NCCL is the GPU transport)")
        if not buf.is_contiguous():
            raise TransferError("the UCX weight transport needs contiguous buffers")
        flat = buf.reshape(-1).view(torch.uint8)  # any dtype (bfloat16 has no numpy type)
        return flat, self._array(flat.numpy())

    def _endpoint(self, dst: int):
        ep = self._endpoints.get(dst)
        if ep is None:
            try:
                raw = self.prefix.get(f"ucx/address/{dst}")
            except Exception as err:  # noqa: BLE001 - the store's timeout, re-raised naming the rank
                raise TransferError(f"rank {dst} never published its UCX address ({err})") from err
            address = self._lib.UCXAddress.create_from_buffer(raw)
            ep = self._endpoints[dst] = self._lib.UCXEndpoint.create_from_worker_address(self._worker, address, True)
        return ep

    def isend(self, buf: torch.Tensor, dst: int, tag: int) -> _Request:
        flat, array = self._bytes(buf)
        request = self._endpoint(dst).tag_send(array, self._tag_of(self.rank, tag))
        return _Request(request=request, keep=(flat, array), what=f"send of tag {tag} to rank {dst}")

    def irecv(self, buf: torch.Tensor, src: int, tag: int) -> _Request:
        flat, array = self._bytes(buf)
        request = self._worker.tag_recv(array, self._tag_of(src, tag))
        return _Request(request=request, keep=(flat, array), what=f"receive of tag {tag} from rank {src}")

    def wait(self, handle: _Request, timeout: timedelta) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        request, progress, idle = handle.request, self._worker.progress_once, 0
        while not request.completed:
            if progress():
                idle = 0
                continue
            idle += 1
            if idle >= _IDLE_SPINS:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"UCX {handle.what} not complete after {timeout.total_seconds():g} s")
                time.sleep(_IDLE_SLEEP_S)
        request.check_error()  # raises ucxx's error (a peer gone, a truncated message)

    def check_digests(self, *, rank: int, digest: str, describe) -> None:
        store_digests(self.prefix, rank=rank, world_size=self.world_size, digest=digest, describe=describe,
                      timeout_s=self.timeout_s, transport="UCX")

    def close(self) -> None:
        self._endpoints.clear()
        self._worker = self._context = None
        self.store.close()


def open_ucx_group(*, store: str, rank: int, world_size: int, timeout_s: float,
                   generation: int = 0) -> UcxGroup:
    """Make this rank's UCX worker and publish its address (see the module docstring)."""
    try:
        client, prefix = rendezvous_store(store=store, rank=rank, world_size=world_size,
                                          timeout_s=timeout_s, generation=generation)
    except Exception as err:  # noqa: BLE001 - re-raised with the rank and address
        raise TransferError(f"transfer group rank {rank}/{world_size} could not reach the store at {store} "
                            f"within {timeout_s:g} s: {err}") from err
    return UcxGroup(rank=rank, world_size=world_size, store=client, prefix=prefix, timeout_s=timeout_s)
