"""The NCCL transport of the transfer group: vLLM's PyNcclCommunicator over our rendezvous store.

    group = open_nccl_group(store=address, rank=r, world_size=w, timeout_s=120)   # on this process's GPU
    with group.round(timeout):                       # execute.py: one round of the shared schedule
        work = group.isend(buf, dst, tag)            # ncclSend / ncclRecv between group_start and group_end
    group.wait(work, timeout)                        # polls a CUDA event; past the deadline: abort, raise

Built from vLLM's own pieces for trainers outside vLLM (read in vllm 0.32):
  - vllm/distributed/utils.py StatelessProcessGroup, made directly on a PrefixStore of the transfer
    group's store (rendezvous.py), not with `.create()`, which would make rank 0 host a second store;
  - vllm/distributed/device_communicators/pynccl.py PyNcclCommunicator, created inside
    vllm/utils/nccl.py `unpinned_nccl_env()`, as vllm/distributed/weight_transfer/nccl_common.py
    does: vLLM pins NCCL settings for its own communicators, and a communicator shared with
    processes outside vLLM must be made without those pins, or the two sides disagree and hang.
PyNccl turns itself off when it cannot load libnccl or when VLLM_DISABLE_PYNCCL is set, and then
every send and receive returns at once having moved nothing (`if self.disabled: return`); opening
the group refuses such a communicator.

NCCL matches a peer pair's point-to-point operations in the order they are issued, with no tags:
the round schedule (hpcrl.plan.transfer.rounds) keeps plan order per (sender, receiver) pair, and
both ends issue a round's operations in plan order, so the message number (`tag`) is checked by
the schedule, not by NCCL. Operations run on the calling thread's current CUDA stream, the stream
execute.py packs and unpacks on, so no extra synchronisation is needed between them.

Deadlines: NCCL waits for a dead or stalled peer for ever. `wait` polls the round's CUDA event and
`round` runs a watchdog over `group_end` (which can block while connections are set up); either
past its deadline aborts the communicator (ncclCommAbort, which also frees a blocked call) and
raises. The link is then spent: the run forms the group again (hpcrl/rl/ports.py, a new generation).

`RUNTIME` holds what the transport needs of CUDA and NCCL. The CPU tests swap in a strict fake
backed by gloo (tests/transfer/fake_pynccl.py) and so run everything above on CPU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from hpcrl.errors import TransferError
from hpcrl.rendezvous.meet import rendezvous_store, store_digests


def _cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        raise TransferError("the nccl weight transport needs a CUDA device and this process has none; set "
                            "inference.weight_transport = \"gloo\" for groups on CPUs")
    return torch.device("cuda", torch.cuda.current_device())


def _vllm_communicator(group: Any, device: torch.device) -> Any:
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.utils.nccl import unpinned_nccl_env

    with unpinned_nccl_env():
        return PyNcclCommunicator(group, device=device)


def _cuda_stream(device: torch.device) -> Any:
    return torch.cuda.current_stream(device)


def _cuda_completion(comm: Any, stream: Any) -> Callable[[], bool]:
    event = torch.cuda.Event()
    event.record(stream)
    return event.query


def _stateless_group(*, rank: int, world_size: int, store: Any) -> Any:
    from vllm.distributed.utils import StatelessProcessGroup

    return StatelessProcessGroup(rank=rank, world_size=world_size, store=store)


@dataclass(frozen=True)
class NcclRuntime:
    """What the transport needs of CUDA and NCCL (vLLM's, or the CPU tests' strict fake)."""

    device: Callable[[], torch.device]
    """This process's device (the current CUDA device)."""
    communicator: Callable[[Any, torch.device], Any]
    """(StatelessProcessGroup, device) -> a PyNcclCommunicator."""
    stream: Callable[[torch.device], Any]
    """The stream operations run on (the current CUDA stream)."""
    completion: Callable[[Any, Any], Callable[[], bool]]
    """(communicator, stream) after a group_end -> a poll, true once the operations issued so far are done."""
    stateless_group: Callable[..., Any] = _stateless_group


VLLM_RUNTIME = NcclRuntime(device=_cuda_device, communicator=_vllm_communicator, stream=_cuda_stream,
                           completion=_cuda_completion)
RUNTIME = VLLM_RUNTIME


def check_communicator(comm: Any, *, rank: int) -> Any:
    """`comm` if it will move data; a TransferError if PyNccl turned itself off (sends would be no-ops)."""
    if not getattr(comm, "available", False) or getattr(comm, "disabled", True):
        raise TransferError(f"transfer group rank {rank}: vLLM's PyNcclCommunicator reports itself unavailable or "
                            "disabled (no loadable libnccl, or VLLM_DISABLE_PYNCCL=1), so every send would silently "
                            "move nothing; install the CUDA build of torch/vLLM with NCCL, unset "
                            "VLLM_DISABLE_PYNCCL, or set inference.weight_transport = \"gloo\"")
    return comm


@dataclass(eq=False)
class _Round:
    """The operations of one round; `done` is set when the round's group_end returned."""

    done: Callable[[], bool] | None = None


@dataclass(eq=False)
class NcclGroup:
    """One rank's NCCL communicator for the transfer group, and the store it met on."""

    rank: int
    world_size: int
    comm: Any
    store: Any
    prefix: Any
    timeout_s: float
    runtime: NcclRuntime
    transport = "nccl"
    _round: _Round | None = None
    _aborted: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def device(self) -> torch.device:
        return self.comm.device

    def _live(self) -> None:
        if self._aborted:
            raise TransferError(f"the NCCL transfer group was aborted ({self._aborted}); form it again")

    @contextmanager
    def round(self, timeout: timedelta) -> Iterator[None]:
        """Issue one round's sends and receives as one NCCL group (group_start ... group_end)."""
        self._live()
        current = self._round = _Round()
        self.comm.group_start()
        try:
            yield
        finally:
            self._round = None
            with self._watchdog(timeout.total_seconds(), "group_end"):
                self.comm.group_end()
        self._live()
        current.done = self.runtime.completion(self.comm, self._stream())

    def _stream(self) -> Any:
        return self.runtime.stream(self.comm.device)

    def _op(self) -> _Round:
        self._live()
        if self._round is None:
            raise TransferError("an NCCL send or receive outside a round (execute.py issues them inside round())")
        return self._round

    def isend(self, buf: torch.Tensor, dst: int, tag: int) -> _Round:
        current = self._op()
        self.comm.send(buf, dst, stream=self._stream())
        return current

    def irecv(self, buf: torch.Tensor, src: int, tag: int) -> _Round:
        current = self._op()
        self.comm.recv(buf, src, stream=self._stream())
        return current

    def wait(self, handle: _Round, timeout: timedelta) -> None:
        self._live()
        if handle.done is None:
            raise TransferError("waiting on an NCCL operation before its round was issued")
        deadline, pause = time.monotonic() + timeout.total_seconds(), 20e-6
        while not handle.done():
            if time.monotonic() > deadline:
                self.abort(f"a round was not done after {timeout.total_seconds():g} s")
                raise TimeoutError(f"NCCL operations not complete after {timeout.total_seconds():g} s; the "
                                   "communicator was aborted")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    @contextmanager
    def _watchdog(self, seconds: float, what: str) -> Iterator[None]:
        timer = threading.Timer(seconds, self.abort, args=(f"{what} blocked for {seconds:g} s",))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    def abort(self, why: str) -> None:
        """ncclCommAbort (vLLM's `destroy`): frees operations blocked on a dead peer; the link is spent."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = why
        self.comm.destroy()

    def check_digests(self, *, rank: int, digest: str, describe) -> None:
        store_digests(self.prefix, rank=rank, world_size=self.world_size, digest=digest, describe=describe,
                      timeout_s=self.timeout_s, transport="NCCL")

    def close(self) -> None:
        self.abort("closed")
        self.store.close()


def open_nccl_group(*, store: str, rank: int, world_size: int, timeout_s: float,
                    generation: int = 0) -> NcclGroup:
    """Join the transfer group over NCCL on this process's device (see the module docstring)."""
    runtime = RUNTIME
    device = runtime.device()
    try:
        client, prefix = rendezvous_store(store=store, rank=rank, world_size=world_size, timeout_s=timeout_s,
                                          generation=generation)
    except Exception as err:  # noqa: BLE001 - re-raised with the rank and address
        raise TransferError(f"transfer group rank {rank}/{world_size} could not reach the store at {store} "
                            f"within {timeout_s:g} s: {err}") from err
    group = runtime.stateless_group(rank=rank, world_size=world_size, store=prefix)
    holder: dict[str, Any] = {}

    def make() -> None:
        try:
            holder["comm"] = runtime.communicator(group, device)
        except BaseException as err:  # noqa: BLE001 - reported on the opening thread
            holder["error"] = err

    # ncclCommInitRank waits for every rank with no timeout of its own: bound it.
    maker = threading.Thread(target=make, name="hpcrl-nccl-init", daemon=True)
    maker.start()
    maker.join(timeout_s)
    if maker.is_alive():
        raise TransferError(f"transfer group rank {rank}/{world_size}: the NCCL communicator did not form within "
                            f"{timeout_s:g} s (a rank missing, or NCCL cannot reach a peer: check NCCL_SOCKET_IFNAME "
                            "and NCCL_DEBUG=INFO)")
    if "error" in holder:
        failure = holder["error"]
        raise TransferError(f"transfer group rank {rank}/{world_size}: the NCCL communicator failed to form: "
                            f"{failure}") from failure
    comm = check_communicator(holder["comm"], rank=rank)
    return NcclGroup(rank=rank, world_size=world_size, comm=comm, store=client, prefix=prefix, timeout_s=timeout_s,
                     runtime=runtime)
