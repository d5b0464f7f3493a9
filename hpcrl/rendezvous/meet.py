"""Where the groups meet: the authenticated rendezvous store every transport forms on, and the plan-digest check.

    server = serve_store(secret, bind="tcp://0.0.0.0:0")   # the launcher (the head, `hpcrl run`, a test)
    store, prefix = rendezvous_store(store=address, rank=r, world_size=w, timeout_s=120, generation=0)
    compare_digests(rank=r, digest=plan.digest, digests={rank: digest, ...}, describe=...)

The store is hpcrl.rendezvous.store: a torch.distributed.Store whose table the launcher keeps and
whose every request is signed with the run's secret, so no port of the run accepts a peer without
it (torch's TCPStore, used before, let anyone on the network join or disturb a formation, and the
groups read pickled objects from it). Every transport (gloo.py, ucx.py, nccl.py) and the trainer
ranks' own process group join through it, so all agree on its layout.

A client finds the secret in HPCRL_STORE_SECRET_DIR (set by `serve_store` when it made a secret of
its own: `hpcrl run`, tests, tools; processes started afterwards inherit it), else in the run
directory HPCRL_RUN_DIR (a job's tasks, and the vLLM workers they start), as `bus.secret` (0600).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch.distributed as dist

from hpcrl.bus.secret import Secret, SecretError, create_secret, load_secret
from hpcrl.errors import TransferError
from hpcrl.rendezvous.store import BusStore, StoreServer

SECRET_DIR_ENV = "HPCRL_STORE_SECRET_DIR"


class ServedStore(StoreServer):
    """A StoreServer that may own the directory of its secret (removed at close)."""

    own_dir: str | None = None

    def close(self) -> None:
        super().close()
        if self.own_dir is not None:
            shutil.rmtree(self.own_dir, ignore_errors=True)
            if os.environ.get(SECRET_DIR_ENV) == self.own_dir:
                del os.environ[SECRET_DIR_ENV]
            self.own_dir = None


def serve_store(secret: Secret | None = None, *, bind: str = "tcp://127.0.0.1:0") -> ServedStore:
    """Serve a rendezvous store on `bind` (a ZeroMQ address: port 0 picks a free one; ipc:// has none).

    Without `secret` (a process with no run directory: `hpcrl run`, tests, tools) it uses the one in
    HPCRL_STORE_SECRET_DIR, or makes one in a new private (0700) directory and points
    HPCRL_STORE_SECRET_DIR at it, for its clients here and in processes started from now on.
    Pass `.address` to every rank; close() it once the run is over.
    """
    own_dir = None
    if secret is None:
        try:
            secret = load_secret(os.environ[SECRET_DIR_ENV])
        except (KeyError, SecretError):
            own_dir = tempfile.mkdtemp(prefix="hpcrl-store-")
            secret = create_secret(own_dir)
            os.environ[SECRET_DIR_ENV] = own_dir
    server = ServedStore(secret, bind=bind)
    server.own_dir = own_dir
    return server


def serve_private_store() -> ServedStore:
    """A store with no TCP port, for a run on one machine (`hpcrl run`): an ipc:// socket in a new
    private (0700) directory that also holds a fresh secret, pointed at by HPCRL_STORE_SECRET_DIR
    for the processes started from now on (vLLM's). Only this user can reach the socket's file, and
    a request still needs the secret. close() removes the directory."""
    own_dir = tempfile.mkdtemp(prefix="hpcrl-store-")
    try:
        secret = create_secret(own_dir)
        server = ServedStore(secret, bind=f"ipc://{own_dir}/store")
    except BaseException:
        shutil.rmtree(own_dir, ignore_errors=True)
        raise
    server.own_dir = own_dir
    os.environ[SECRET_DIR_ENV] = own_dir
    return server


def store_secret() -> Secret:
    """The key of the run's rendezvous store, as a client finds it (see the module docstring)."""
    where = os.environ.get(SECRET_DIR_ENV) or os.environ.get("HPCRL_RUN_DIR")
    if not where:
        raise TransferError(f"this process has no key for the rendezvous store: neither {SECRET_DIR_ENV} nor "
                            "HPCRL_RUN_DIR is set (a job's head sets HPCRL_RUN_DIR for its tasks; serve_store sets "
                            f"{SECRET_DIR_ENV} for processes started after it)")
    return load_secret(where)


def client_store(store: str, *, timeout_s: float) -> BusStore:
    """A client of the rendezvous store at `store` (a ZeroMQ address), keyed with store_secret()."""
    return BusStore(store, store_secret(), timeout_s=timeout_s)


def rendezvous_store(*, store: str, rank: int, world_size: int, timeout_s: float,
                     generation: int) -> tuple[BusStore, dist.PrefixStore]:
    """A client of the store at `store` and this formation's prefix in it.

    `generation` tells apart groups formed again on the same store (after a replica was replaced).
    """
    client = client_store(store, timeout_s=timeout_s)
    return client, dist.PrefixStore(f"hpcrl-transfer/g{generation}", client)


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
