"""The weight-transfer plan as data: strided blocks per (trainer rank -> replica, TP rank).

A plan is a table with one row per *block*: `count` runs of `length` elements, run i read from
the sending rank's local FSDP shard of `source` at src_offset + i*src_stride and written to the
receiving rank's local vLLM parameter `dest` at dst_offset + i*dst_stride (flat, row-major,
in elements). A block with count 1 is one contiguous run. Blocks are ordered by route
(src_rank, replica, tp_rank), then destination, and grouped into numbered messages of at most
`bucket_bytes` plus one row. Runs of one route are packed into its messages in table order.

The table is columns of int64 (numpy), so a 70B plan (about a million blocks) is built, hashed
and checked in well under a second. `digest` is the sha256 of a canonical encoding (a JSON
header with layouts, tensors and wire dtype, then every column's little-endian bytes); both ends
of a transfer compute the plan themselves and compare digests at the handshake.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

import numpy as np

from hpcrl.plan.transfer.layout import DestTensor, InferenceLayout, TrainerLayout
from hpcrl.plan.transfer.names import SourceTensor

PLAN_VERSION = 1
COLUMNS = ("src_rank", "replica", "tp_rank", "source", "dest", "src_offset", "src_stride",
           "dst_offset", "dst_stride", "length", "count", "message")
WIRE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Staging bytes per rank and round of the transfer schedule (hpcrl.plan.transfer.rounds), about 256 MB.
DEFAULT_ROUND_BYTES = 256 << 20


#: Layout fields added after PLAN_VERSION 1 with their defaults: left out of the digest's header at
#: their default, so every plan without experts keeps its digest.
_LATER_TRAINER: dict[str, object] = {"grouped_experts": False}
_LATER_INFERENCE: dict[str, object] = {"expert_parallel": False, "expert_placement": "linear", "lora_rank": 0,
                                       "lora_targets": ()}


def _non_default(layout: TrainerLayout | InferenceLayout, later: dict[str, object]) -> dict:
    return {k: v for k, v in asdict(layout).items() if k not in later or later[k] != v}


@dataclass(frozen=True, kw_only=True)
class TransferPlan:
    """Every block each trainer rank sends to each inference rank (see module docstring)."""

    trainer: TrainerLayout
    inference: InferenceLayout
    model: str
    """Architecture and shape summary the plan was made for (part of the digest)."""
    wire_dtype: str
    bucket_bytes: int
    sources: tuple[SourceTensor, ...]
    dests: tuple[DestTensor, ...]
    blocks: dict[str, np.ndarray] = field(repr=False)
    """Column name (COLUMNS) -> int64 array, one entry per block."""
    round_bytes: int = DEFAULT_ROUND_BYTES
    """Staging bytes per rank and round when the plan is executed (hpcrl.plan.transfer.rounds); part of the
    digest, so both ends run the same rounds."""

    @property
    def itemsize(self) -> int:
        return WIRE_DTYPE_BYTES[self.wire_dtype]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks["src_rank"])

    def header(self) -> dict:
        return {"version": PLAN_VERSION, "model": self.model, "wire_dtype": self.wire_dtype,
                "bucket_bytes": self.bucket_bytes, "round_bytes": self.round_bytes,
                "trainer": _non_default(self.trainer, _LATER_TRAINER),
                "inference": _non_default(self.inference, _LATER_INFERENCE),
                "sources": [[s.name, list(s.shape)] + ([s.shard_rows] if s.shard_rows != 1 else [])
                            for s in self.sources],
                "dests": [[d.name, list(d.local_shape), list(d.real_rows)] for d in self.dests]}

    @property
    def digest(self) -> str:
        h = hashlib.sha256(json.dumps(self.header(), sort_keys=True, separators=(",", ":")).encode())
        for name in COLUMNS:
            h.update(np.ascontiguousarray(self.blocks[name], dtype="<i8").tobytes())
        return h.hexdigest()

    def elements(self) -> np.ndarray:
        return self.blocks["length"] * self.blocks["count"]

    def route(self, src_rank: int, replica: int, tp_rank: int) -> dict[str, np.ndarray]:
        """The blocks src_rank sends to (replica, tp_rank), in order."""
        b = self.blocks
        mask = (b["src_rank"] == src_rank) & (b["replica"] == replica) & (b["tp_rank"] == tp_rank)
        return {k: v[mask] for k, v in b.items()}

    def stats(self) -> TransferStats:
        t, inf = self.trainer, self.inference
        nbytes = self.elements() * self.itemsize
        sent = np.bincount(self.blocks["src_rank"], weights=nbytes, minlength=t.world_size)
        recv_index = self.blocks["replica"] * inf.tensor_parallel + self.blocks["tp_rank"]
        received = np.bincount(recv_index, weights=nbytes, minlength=inf.replicas * inf.tensor_parallel)
        minimum = [sum(d.real_rows[r] * d.local_shape[1] for d in self.dests) * self.itemsize
                   for r in range(inf.tensor_parallel)]
        messages = int(self.blocks["message"].max()) + 1 if self.num_blocks else 0
        return TransferStats(sent_per_trainer_rank=[int(x) for x in sent],
                             received_per_inference_rank=[int(x) for x in received],
                             minimum_per_tp_rank=minimum, blocks=self.num_blocks, messages=messages)

    def describe(self, limit: int = 20) -> str:
        """Printable form: header, digest, then the first `limit` blocks of the table."""
        lines = [f"transfer plan {self.digest[:16]}: {self.model}, trainer {self.trainer.dp_replicate} x "
                 f"{self.trainer.dp_shard}, {self.inference.replicas} replicas x TP "
                 f"{self.inference.tensor_parallel}, {self.num_blocks} blocks, wire {self.wire_dtype}",
                 "  src -> (rep,tp)  message  source -> dest  src_off/stride  dst_off/stride  length x count"]
        b = self.blocks
        for i in range(min(limit, self.num_blocks)):
            lines.append(
                f"  {b['src_rank'][i]:>3} -> ({b['replica'][i]},{b['tp_rank'][i]})  {b['message'][i]:>5}  "
                f"{self.sources[b['source'][i]].name} -> {self.dests[b['dest'][i]].name}  "
                f"{b['src_offset'][i]}/{b['src_stride'][i]}  {b['dst_offset'][i]}/{b['dst_stride'][i]}  "
                f"{b['length'][i]} x {b['count'][i]}")
        if self.num_blocks > limit:
            lines.append(f"  ... {self.num_blocks - limit} more")
        return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class TransferStats:
    """Bytes each rank sends or receives in one update, and what the minimum would be."""

    sent_per_trainer_rank: list[int]
    received_per_inference_rank: list[int]
    """Index replica * tensor_parallel + tp_rank."""
    minimum_per_tp_rank: list[int]
    """Bytes of the elements a TP rank's parameters hold (padding excluded): no plan moves less."""
    blocks: int
    messages: int

    def ratio(self) -> float:
        """Largest received / minimum over all inference ranks (1.00 is byte-minimal)."""
        tp = len(self.minimum_per_tp_rank)
        return max(r / self.minimum_per_tp_rank[i % tp] for i, r in enumerate(self.received_per_inference_rank))

    def sync_seconds(self, link_bytes_per_s: float) -> float:
        """Predicted update time when every GPU sends and receives at `link_bytes_per_s` at once."""
        busiest = max(max(self.sent_per_trainer_rank), max(self.received_per_inference_rank))
        return busiest / link_bytes_per_s
