"""A strict fake of vLLM's PyNcclCommunicator for CPU tests, backed by gloo point to point.

    from hpcrl.transfer import nccl
    nccl.RUNTIME = fake_pynccl.RUNTIME     # in every process of the test, before opening "nccl"

It keeps the surface hpcrl/transfer/nccl.py uses (send, recv, group_start, group_end, destroy,
available, disabled, device, rank, world_size) and NCCL's matching rule: a pair's operations match
in the order each side issues them, with no tags. It is stricter than NCCL where NCCL would hang
or silently corrupt:
  - a send or receive outside group_start ... group_end fails at once (execute.py issues every
    operation inside a round's group);
  - every operation carries a header (element count, dtype) ahead of its data; a receive matched
    with a send of another size or dtype fails, naming both ranks and the operation's place in the
    pair's order (NCCL would truncate, or hang). A broken per-pair order shows up as such a
    mismatch, or as wrong bytes in the exact-equality tests;
  - a tensor not on the communicator's device, or not contiguous, fails (NCCL reads raw pointers);
  - any use after destroy (ncclCommAbort) fails; destroy stops the operations in flight;
  - it must be given vLLM's StatelessProcessGroup on a PrefixStore (not `.create()`'s own store),
    and it draws its "unique id" through `broadcast_obj` as PyNccl does.
Operations run in a background thread per group (a stream); `completion` is the poll execute.py's
link waits on, and raises the first error the group met. gloo finishes an operation only inside a
blocking wait, so an aborted group's thread lingers until OP_TIMEOUT (a daemon; harmless).
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hpcrl.transfer.nccl import NcclRuntime

OP_TIMEOUT = timedelta(seconds=30)
"""How long the fake's stream thread waits on one gloo operation (an aborted group's thread ends by then)."""
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64]


class FakeNcclError(RuntimeError):
    pass


@dataclass
class _Op:
    kind: str
    tensor: torch.Tensor
    peer: int
    seq: int
    """Its place among this rank's operations of this kind with `peer` (NCCL's matching order)."""


class _Stream:
    """The operations of one group_end, run in order in a thread; `error` is the first failure."""

    def __init__(self, comm: StrictFakePyNccl, ops: list[_Op]) -> None:
        self.comm, self.ops, self.error = comm, ops, None
        self.thread = threading.Thread(target=self._run, daemon=True, name="fake-nccl-stream")
        self.thread.start()

    def _poll(self, work) -> None:
        # gloo completes a send or receive only inside wait(): block (bounded by the group's timeout).
        if self.comm.aborted:
            raise FakeNcclError("communicator aborted with operations in flight")
        work.wait(self.comm.op_timeout)
        if self.comm.aborted:
            raise FakeNcclError("communicator aborted with operations in flight")

    def _run(self) -> None:
        pg, keep, works, headers = self.comm.pg, [], [], []
        try:
            for op in self.ops:
                if op.kind == "send":
                    head = torch.tensor([op.tensor.numel(), _DTYPES.index(op.tensor.dtype)], dtype=torch.int64)
                    keep.append(head)
                    works.append(pg.send([head], op.peer, 2 * op.seq))
                    works.append(pg.send([op.tensor], op.peer, 2 * op.seq + 1))
                else:
                    head = torch.empty(2, dtype=torch.int64)
                    headers.append((op, head, pg.recv([head], op.peer, 2 * op.seq)))
            for op, head, work in headers:
                self._poll(work)
                numel, dtype = head.tolist()
                if numel != op.tensor.numel() or _DTYPES[dtype] != op.tensor.dtype:
                    raise FakeNcclError(
                        f"rank {self.comm.rank} receives {op.tensor.numel()} x {op.tensor.dtype} as its receive "
                        f"#{op.seq} from rank {op.peer}, which sent {numel} x {_DTYPES[dtype]} as its send "
                        f"#{op.seq} to it: the two sides issue this pair's operations in different orders or sizes")
                works.append(pg.recv([op.tensor], op.peer, 2 * op.seq + 1))
            for work in works:
                self._poll(work)
        except BaseException as err:  # noqa: BLE001 - raised by completion()
            self.error = err

    def done(self) -> bool:
        if self.thread.is_alive():
            return False
        if self.error is not None:
            raise FakeNcclError(f"fake NCCL group failed: {self.error}") from self.error
        return True


class StrictFakePyNccl:
    """PyNcclCommunicator's surface on CPU (see the module docstring)."""

    def __init__(self, group, device: torch.device, *, op_timeout: timedelta = OP_TIMEOUT) -> None:
        from vllm.distributed.utils import StatelessProcessGroup

        if not isinstance(group, StatelessProcessGroup) or not isinstance(group.store, dist.PrefixStore):
            raise FakeNcclError("PyNccl must be given vLLM's StatelessProcessGroup on a PrefixStore of the transfer "
                                f"store, got {type(group).__name__} on {type(getattr(group, 'store', None)).__name__}")
        if device != torch.device("cpu"):
            raise FakeNcclError(f"the fake runs on CPU, asked for {device}")
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        self.rank, self.world_size, self.device = group.rank, group.world_size, device
        unique_id = group.broadcast_obj(os.urandom(16).hex() if group.rank == 0 else None, src=0)
        self.pg = ProcessGroupGloo(dist.PrefixStore(f"fake-nccl/{unique_id}", group.store), self.rank,
                                   self.world_size, OP_TIMEOUT)
        self.op_timeout = op_timeout
        self.available, self.disabled, self.aborted = True, False, False
        self._depth, self._ops = 0, []
        self._sends: dict[int, int] = defaultdict(int)
        self._recvs: dict[int, int] = defaultdict(int)
        self._stream: _Stream | None = None

    def _check(self, tensor: torch.Tensor, peer: int, what: str) -> None:
        if self.aborted or self.disabled:
            raise FakeNcclError(f"{what} on a destroyed communicator")
        if self._depth == 0:
            raise FakeNcclError(f"{what} to/from rank {peer} outside group_start ... group_end")
        if tensor.device != self.device:
            raise FakeNcclError(f"{what}: tensor on {tensor.device}, the communicator on {self.device}")
        if not tensor.is_contiguous():
            raise FakeNcclError(f"{what}: tensor not contiguous")
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise FakeNcclError(f"{what}: peer {peer} is not another rank of {self.world_size}")

    def send(self, tensor: torch.Tensor, dst: int, stream=None) -> None:
        self._check(tensor, dst, "send")
        self._ops.append(_Op("send", tensor, dst, self._sends[dst]))
        self._sends[dst] += 1

    def recv(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        self._check(tensor, src, "recv")
        self._ops.append(_Op("recv", tensor, src, self._recvs[src]))
        self._recvs[src] += 1

    def group_start(self) -> None:
        if self.aborted:
            raise FakeNcclError("group_start on a destroyed communicator")
        self._depth += 1

    def group_end(self) -> None:
        if self._depth == 0:
            raise FakeNcclError("group_end without group_start")
        self._depth -= 1
        if self._depth == 0 and self._ops:
            if self._stream is not None:  # one stream: a group starts after the previous one finished
                self._stream.thread.join()
            ops, self._ops = self._ops, []
            self._stream = _Stream(self, ops)

    def completion(self):
        stream = self._stream
        return stream.done if stream is not None else (lambda: True)

    def destroy(self) -> None:
        self.aborted, self.available, self.disabled = True, False, True

    def join(self) -> None:
        """Wait until the group in flight ended (an aborted one's gloo waits end within op_timeout)."""
        if self._stream is not None:
            self._stream.thread.join()


class DisabledPyNccl:
    """What PyNccl looks like where libnccl cannot be loaded (or VLLM_DISABLE_PYNCCL=1)."""

    def __init__(self, group, device) -> None:
        self.rank, self.world_size, self.device = group.rank, group.world_size, device
        self.available, self.disabled = False, True

    def destroy(self) -> None:
        pass


RUNTIME = NcclRuntime(device=lambda: torch.device("cpu"), communicator=StrictFakePyNccl, stream=lambda device: None,
                      completion=lambda comm, stream: comm.completion())
DISABLED_RUNTIME = NcclRuntime(device=lambda: torch.device("cpu"), communicator=DisabledPyNccl,
                               stream=lambda device: None, completion=lambda comm, stream: comm.completion())
