"""The gloo transport of the transfer group: a torch ProcessGroup spanning trainer ranks and vLLM workers.

    group = open_gloo_group(store=address, rank=r, world_size=w, timeout_s=120)
    group.check_digests(rank=r, digest=plan.digest, describe=...)
    work = group.isend(buf, dst, tag); group.wait(work, timeout)      # execute.py drives these

Formed like vLLM's `stateless_init_torch_distributed_process_group` (vllm/distributed/utils.py: a
store, a PrefixStore, a ProcessGroup with a gloo backend), with torch only, so trainer processes
need not import vLLM. The store is the run's authenticated one (rendezvous.py), which every
transport shares. The group's gloo listener is on the loopback address when all its ranks share
this machine, else on the node's, and is sealed once the group has formed: it refuses every
connection from then on (listen.py).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hpcrl.errors import TransferError
from hpcrl.rendezvous.listen import gloo_options, one_machine, sealing
from hpcrl.rendezvous.meet import compare_digests, rendezvous_store
from hpcrl.rendezvous.store import BusStore

DIGEST_BYTES = 32


@dataclass(frozen=True)
class GlooGroup:
    """The gloo process group and the store it rendezvoused on (kept alive together)."""

    pg: dist.ProcessGroup
    store: BusStore
    transport = "gloo"
    device = torch.device("cpu")
    """Where staging buffers live: host memory (pinned when the tensors are on a GPU)."""

    def round(self, timeout: timedelta) -> AbstractContextManager[None]:
        """One round of the schedule: nothing to group (operations are posted as issued)."""
        return nullcontext()


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
        self.store.close()


def open_gloo_group(*, store: str, rank: int, world_size: int, timeout_s: float,
                    generation: int = 0) -> GlooGroup:
    """Join the transfer group (blocks until all `world_size` ranks joined, or `timeout_s`).

    Every rank meets on the rendezvous store at `store` (rendezvous.serve_store). `generation`
    tells apart groups formed again on the same store.
    """
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    timeout = timedelta(seconds=timeout_s)
    try:
        client, prefix = rendezvous_store(store=store, rank=rank, world_size=world_size, timeout_s=timeout_s,
                                          generation=generation)
        pg = dist.ProcessGroup(prefix, rank, world_size)
        loopback = one_machine(dist.PrefixStore("hpcrl-listen", prefix), rank=rank, world=world_size)
        with sealing():  # its ranks are connected once it is made: nobody needs its listener any more
            backend = ProcessGroupGloo(prefix, rank, world_size, gloo_options(loopback=loopback, timeout=timeout))
        backend._set_sequence_number_for_group()
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    except Exception as err:  # noqa: BLE001 - re-raised with the rank and address
        raise TransferError(f"transfer group rank {rank}/{world_size} could not join through {store} within "
                            f"{timeout_s:g} s: {err}") from err
    return GlooGroup(pg=pg, store=client)


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
