"""The transfer group: the links between trainer ranks and vLLM workers, apart from every training group.

    group = open_group("gloo", host=..., port=..., rank=r, world_size=w, timeout_s=120)
    group.check_digests(rank=r, digest=plan.digest, describe=...)
    work = group.isend(buf, dst, tag); group.wait(work, timeout)      # execute.py drives these

Transports: "gloo" (a torch ProcessGroup, here) and "ucx" (hpcrl/transfer/ucx.py, optional:
`pip install ucxx-cu12`). Both rendezvous on the same TCP store. The gloo group is formed like
vLLM's `stateless_init_torch_distributed_process_group` (vllm/distributed/utils.py: a TCPStore,
a PrefixStore named after the address, a ProcessGroup with a gloo backend), with torch only, so
trainer processes need not import vLLM. Both ends use
this function, so they agree on the store layout. Under torchrun, TORCHELASTIC_USE_AGENT_STORE
is popped around the store creation, or rank 0 would not host the store (FACTS.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from hpcrl.errors import TransferError

DIGEST_BYTES = 32


@contextmanager
def _without_agent_store():
    saved = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = saved


def host_store(host: str = "127.0.0.1", port: int = 0, *, timeout_s: float = 300.0) -> dist.TCPStore:
    """A rendezvous store served by a launcher (the head, a test); port 0 picks a free port with no race.

    Pass its `.port` to every rank with `external_store=True`; keep the object alive meanwhile.
    """
    with _without_agent_store():
        return dist.TCPStore(host, port, is_master=True, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False, multi_tenant=True)


#: The transports `open_group` knows (NCCL is not built yet: it needs GPUs to be tested).
TRANSPORTS = ("gloo", "ucx")


def open_group(transport: str, *, host: str, port: int, rank: int, world_size: int, timeout_s: float,
               external_store: bool = False, generation: int = 0):
    """Join the transfer group over `transport` ("gloo" or "ucx"); see open_gloo_group for the rest."""
    if transport == "gloo":
        return open_gloo_group(host=host, port=port, rank=rank, world_size=world_size, timeout_s=timeout_s,
                               external_store=external_store, generation=generation)
    if transport == "ucx":
        from hpcrl.transfer.ucx import open_ucx_group
        return open_ucx_group(host=host, port=port, rank=rank, world_size=world_size, timeout_s=timeout_s,
                              external_store=external_store, generation=generation)
    raise TransferError(f"unknown weight transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")


def rendezvous_store(*, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                     external_store: bool, generation: int) -> tuple[dist.TCPStore, dist.PrefixStore]:
    """The TCP store (rank 0 serves it unless `external_store`) and this formation's prefix in it."""
    with _without_agent_store():
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0 and not external_store,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False, multi_tenant=True)
    name = f"hpcrl-transfer/{host}:{port}" + (f"/g{generation}" if generation else "")
    return store, dist.PrefixStore(name, store)


@dataclass(frozen=True)
class TransferGroup:
    """The gloo process group and the store it rendezvoused on (kept alive together)."""

    pg: dist.ProcessGroup
    store: dist.TCPStore
    transport = "gloo"

    def isend(self, buf: torch.Tensor, dst: int, tag: int):
        return self.pg.send([buf], dst, tag)

    def irecv(self, buf: torch.Tensor, src: int, tag: int):
        return self.pg.recv([buf], src, tag)

    def wait(self, work, timeout: timedelta) -> None:
        work.wait(timeout)

    def check_digests(self, *, rank: int, digest: str, describe) -> None:
        check_digests(self.pg, rank=rank, digest=digest, describe=describe)

    def close(self) -> None:
        self.pg.shutdown()


def open_gloo_group(*, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                    external_store: bool = False, generation: int = 0) -> TransferGroup:
    """Join the transfer group (blocks until all `world_size` ranks joined, or `timeout_s`).

    Rank 0 serves the rendezvous store at host:port unless `external_store` (see `host_store`).
    `generation` tells apart groups formed again on the same store (after a replica was replaced).
    """
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    timeout = timedelta(seconds=timeout_s)
    try:
        store, prefix = rendezvous_store(host=host, port=port, rank=rank, world_size=world_size, timeout_s=timeout_s,
                                         external_store=external_store, generation=generation)
        pg = dist.ProcessGroup(prefix, rank, world_size)
        backend = ProcessGroupGloo(prefix, rank, world_size, timeout=timeout)
        backend._set_sequence_number_for_group()
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    except Exception as err:  # noqa: BLE001 - re-raised with the rank and address
        raise TransferError(f"transfer group rank {rank}/{world_size} could not join {host}:{port} within "
                            f"{timeout_s:g} s: {err}") from err
    return TransferGroup(pg=pg, store=store)


def check_digests(pg: dist.ProcessGroup, *, rank: int, digest: str, describe) -> None:
    """All ranks exchange their plan digest; any difference is a TransferError on every rank.

    `describe(rank)` names a group rank (e.g. "trainer rank 3", "replica 0 TP rank 1").
    """
    mine = torch.frombuffer(bytearray(bytes.fromhex(digest)), dtype=torch.uint8)
    gathered = [torch.empty(DIGEST_BYTES, dtype=torch.uint8) for _ in range(pg.size())]
    try:
        pg.allgather([gathered], [mine]).wait()
    except Exception as err:  # noqa: BLE001
        raise TransferError(f"plan digest handshake failed on {describe(rank)}: {err}") from err
    compare_digests(rank=rank, digest=digest, digests={r: bytes(d.tolist()).hex() for r, d in enumerate(gathered)},
                    describe=describe)


def compare_digests(*, rank: int, digest: str, digests: dict[int, str], describe) -> None:
    """TransferError naming the ranks whose plan digest (`digests`: every rank's) is not `digest`."""
    differ = [r for r, d in digests.items() if d != digest]
    if differ:
        names = ", ".join(f"{describe(r)} has {digests[r][:12]}" for r in differ[:4])
        raise TransferError(f"transfer plans differ: {describe(rank)} has {digest[:12]}, {names}; both ends must "
                            "plan from the same trainer/inference layouts, model and wire dtype")
