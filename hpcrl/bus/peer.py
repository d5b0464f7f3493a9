"""Who a bus peer is: `PeerInfo`, sent by a worker when it registers, and its name.

A peer's name is "group/replica/rank" (e.g. "inference/3/0"); errors and logs use it. Rank 0
of a replica is the one that route() and fanout() talk to; call_all() talks to
every rank of one replica.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from hpcrl.errors import HpcrlError


@dataclass(frozen=True, kw_only=True)
class PeerInfo:
    run_id: str
    """Run the process belongs to; the head drops registrations for another run."""
    group: str
    """Node group: "trainer", "inference", "reward" (or any service name)."""
    replica: int
    """Index of the replica within its group."""
    rank: int = 0
    """Rank within the replica (TP / FSDP rank); rank 0 answers route/fanout."""
    replica_ranks: int = 1
    """How many ranks this replica has, so the head knows when it is complete."""
    task: int = 0
    """Index of the process's task within its group (the launcher's rank of it), for the launcher."""
    host: str = ""
    """Host name the process runs on."""
    pid: int = 0
    """Process id on that host (for the launcher and for operators)."""
    gpu: str = ""
    """GPU(s) the process holds (e.g. "0" or "0,1"): its CUDA_VISIBLE_DEVICES; empty on CPU."""
    cpus: int = 0
    """CPUs Slurm gave the process's task (or its CPU affinity); 0 = not said."""
    threads: int = 0
    """Its OMP_NUM_THREADS; 0 = not set."""

    def __post_init__(self) -> None:
        if not self.group or "/" in self.group:
            raise HpcrlError(f"peer group {self.group!r} must be a non-empty name without '/'")
        if self.replica < 0 or not 0 <= self.rank < self.replica_ranks:
            raise HpcrlError(f"peer {self.group}: replica {self.replica} rank {self.rank} of "
                             f"{self.replica_ranks} ranks is out of range")

    @property
    def name(self) -> str:
        return f"{self.group}/{self.replica}/{self.rank}"

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: Any) -> PeerInfo:
        """Build from a registration body; raises ValueError on anything malformed."""
        if not isinstance(data, dict):
            raise ValueError("peer info is not a map")
        types = {"run_id": str, "group": str, "replica": int, "rank": int, "replica_ranks": int, "task": int,
                 "host": str, "pid": int, "gpu": str, "cpus": int, "threads": int}
        if set(data) != set(types) or any(type(data[k]) is not t for k, t in types.items()):
            raise ValueError("peer info has missing, extra or mistyped fields")
        try:
            return cls(**data)
        except HpcrlError as exc:
            raise ValueError(str(exc)) from None
