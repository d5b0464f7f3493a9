"""The transports of the transfer group, by name: `open_group("gloo" | "ucx" | "nccl", ...)`.

    group = open_group(config.weight_transport, store=address, rank=r, world_size=w, timeout_s=120)
    group.check_digests(rank=r, digest=plan.digest, describe=...)      # then execute.py drives it

One module per transport (gloo.py; ucx.py, optional: `pip install ucxx-cu12`; nccl.py, GPUs:
vLLM's PyNccl), each with an opener taking the same keywords and returning a `TransferLink`; this
table names them, as vLLM's weight-transfer factory names its engines
(vllm/distributed/weight_transfer/factory.py). Adding a transport is one module and one line here;
the transports meet on the same store (rendezvous.py) and run the same round schedule
(execute.py). The modules are cheap to import: ucxx and vLLM are imported only when a group of
theirs is opened.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Protocol

import torch

from hpcrl.errors import TransferError
from hpcrl.transfer.gloo import open_gloo_group
from hpcrl.transfer.nccl import open_nccl_group
from hpcrl.transfer.ucx import open_ucx_group


class TransferLink(Protocol):
    """What execute.py needs of an open transfer group (ranks numbered as in execute.inference_group_rank)."""

    transport: str

    @property
    def device(self) -> torch.device:
        """Where the transport reads and writes buffers (staging lives there)."""

    def round(self, timeout: timedelta) -> AbstractContextManager[None]:
        """The operations of one round of the schedule are issued inside it (NCCL: one group)."""

    def isend(self, buf: torch.Tensor, dst: int, tag: int) -> Any: ...

    def irecv(self, buf: torch.Tensor, src: int, tag: int) -> Any: ...

    def wait(self, handle: Any, timeout: timedelta) -> None: ...

    def check_digests(self, *, rank: int, digest: str, describe: Callable[[int], str]) -> None: ...

    def close(self) -> None: ...


#: name -> opener(store=, rank=, world_size=, timeout_s=, generation=).
TRANSPORTS: dict[str, Callable[..., TransferLink]] = {
    "gloo": open_gloo_group,
    "ucx": open_ucx_group,
    "nccl": open_nccl_group,
}


def open_group(transport: str, *, store: str, rank: int, world_size: int, timeout_s: float,
               generation: int = 0) -> TransferLink:
    """Join the transfer group over `transport` (blocks until all `world_size` ranks joined, or `timeout_s`).

    Every rank meets on the rendezvous store at `store` (rendezvous.serve_store);
    `generation` tells apart groups formed again on the same store (after a replica was replaced).
    """
    opener = TRANSPORTS.get(transport)
    if opener is None:
        raise TransferError(f"unknown weight transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
    return opener(store=store, rank=rank, world_size=world_size, timeout_s=timeout_s, generation=generation)
