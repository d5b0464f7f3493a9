"""Where the transfer group meets: the TCP store every transport rendezvouses on, and the plan-digest check.

    store = host_store(host, 0, timeout_s=600)       # the launcher (the head, a test) serves it; pass store.port
    store, prefix = rendezvous_store(host=..., port=store.port, rank=r, world_size=w, timeout_s=120,
                                     external_store=True, generation=0)          # every rank, any transport
    compare_digests(rank=r, digest=plan.digest, digests={rank: digest, ...}, describe=...)

Every transport (gloo.py, ucx.py, nccl.py) joins through `rendezvous_store`, so all agree on the store's
layout. Under torchrun, TORCHELASTIC_USE_AGENT_STORE is popped around the store creation, or rank 0
would not host the store (docs/FACTS.md).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from hpcrl.errors import TransferError


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


def rendezvous_store(*, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                     external_store: bool, generation: int) -> tuple[dist.TCPStore, dist.PrefixStore]:
    """The TCP store (rank 0 serves it unless `external_store`) and this formation's prefix in it.

    `generation` tells apart groups formed again on the same store (after a replica was replaced).
    """
    with _without_agent_store():
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0 and not external_store,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False, multi_tenant=True)
    name = f"hpcrl-transfer/{host}:{port}" + (f"/g{generation}" if generation else "")
    return store, dist.PrefixStore(name, store)


def store_digests(prefix: dist.Store, *, rank: int, world_size: int, digest: str, describe, timeout_s: float,
                  transport: str) -> None:
    """Publish this rank's plan digest in the formation's store prefix, read every rank's, compare.

    Also the group's barrier: it returns once every rank published (a TransferError naming the rank
    that did not join within the store's timeout). For transports with no collective of their own
    to exchange digests on (UCX, NCCL before its first round).
    """
    prefix.set(f"digest/{rank}", digest)
    digests = {}
    for r in range(world_size):
        try:
            digests[r] = prefix.get(f"digest/{r}").decode()
        except Exception as err:  # noqa: BLE001 - the store's timeout, re-raised naming the rank
            raise TransferError(f"plan digest handshake failed on {describe(rank)}: {describe(r)} did not join the "
                                f"{transport} transfer group within {timeout_s:g} s ({err})") from err
    compare_digests(rank=rank, digest=digest, digests=digests, describe=describe)


def compare_digests(*, rank: int, digest: str, digests: dict[int, str], describe) -> None:
    """TransferError naming the ranks whose plan digest (`digests`: every rank's) is not `digest`.

    `describe(rank)` names a group rank (e.g. "trainer rank 3", "replica 0 TP rank 1").
    """
    differ = [r for r, d in digests.items() if d != digest]
    if differ:
        names = ", ".join(f"{describe(r)} has {digests[r][:12]}" for r in differ[:4])
        raise TransferError(f"transfer plans differ: {describe(rank)} has {digest[:12]}, {names}; both ends must "
                            "plan from the same trainer/inference layouts, model and wire dtype")
