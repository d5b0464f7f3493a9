"""How long one weight update takes over each transport, predicted from stated bandwidths (pure).

`hpcrl plan --transfer` prints it. Every rank of both groups moves its bytes of the plan at once;
the figures are one way, in bytes per second (Bandwidths):

    nccl          GPU -> NIC -> NIC -> GPU: InfiniBand NDR, one 400 Gbit/s port per GPU = 50 GB/s
    nccl-nvlink   GPU -> GPU inside one node: NVLink 4, 450 GB/s per H100 and direction. Only for
                  a sender and a receiver on one node, which hpcrl's hetjob never has (trainer and
                  inference are components on nodes of their own): shown for scale, never chosen
    gloo          GPU -> pinned host staging over PCIe (Gen5 x16, 50 GB/s; 55 GB/s measured on an
                  H100 node, docs/FACTS.md), TCP on the node's Ethernet (25 Gbit/s, shared by every
                  rank of the node), host -> GPU (50 GB/s)
    ucx           GPU -> host, RDMA from host memory at the InfiniBand rate per rank, host -> GPU
                  (hpcrl's UCX transport moves CPU tensors only)

A CPU rank has no PCIe copy. The host transports' stages are taken to add up, as within one round
of the schedule (hpcrl.plan.transfer.rounds: pack and copy, send, receive, copy in), so

    per trainer rank    its copy to the host + its network time
    per inference rank  its network time + its copy to the GPU
    sync                slowest copy out + slowest network time (either side) + slowest copy in

where a rank's TCP time is its node's bytes over the node's Ethernet. NCCL's sync is its slowest
rank. `host_round_trip_warning` says what a config that chose the host path on GPUs pays for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hpcrl.config.schema import Config
from hpcrl.errors import PlanError

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class Bandwidths:
    """The stated bandwidths of the prediction, bytes per second and one way."""

    infiniband_per_gpu: float = 50 * GB
    """InfiniBand NDR: one 400 Gbit/s port per GPU (H100 nodes with a NIC per GPU); UCX's RDMA per rank too."""
    nvlink_per_gpu: float = 450 * GB
    """NVLink 4 of an H100: 18 links, 450 GB/s each direction (within a node only)."""
    pcie: float = 50 * GB
    """A copy between GPU and pinned host memory over PCIe Gen5 x16 (64 GB/s raw; 55 GB/s measured on an H100).
    execute.py stages host transports in pinned memory."""
    ethernet_per_node: float = 25e9 / 8
    """The node's Ethernet for TCP, 25 Gbit/s, shared by every rank on the node."""


@dataclass(frozen=True, kw_only=True)
class SyncPrediction:
    """One transport's predicted update: each rank's time and the sync's."""

    label: str
    """"nccl" (InfiniBand), "nccl-nvlink", "gloo" or "ucx"."""
    transport: str
    """The inference.weight_transport value that runs it."""
    path: str
    """The way a weight goes, with the bandwidths stated ("GPU -> host 25 GB/s (PCIe ...), TCP ...")."""
    trainer_rank_s: tuple[float, ...]
    """Seconds per trainer rank: its copy to the host (GPU ranks of gloo and ucx) and its sends."""
    inference_rank_s: tuple[float, ...]
    """Seconds per inference rank (replica * tensor_parallel + tp_rank): its receives and its copy in."""
    sync_s: float
    """Seconds of the whole update."""
    same_node_only: bool = False
    """True for NVLink: a layout with trainer and inference on one node, not hpcrl's."""


def _node_bytes(per_rank: Sequence[int], ranks_per_node: int) -> list[int]:
    """Each rank's node's total bytes (ranks are packed onto nodes in rank order)."""
    totals: dict[int, int] = {}
    for rank, n in enumerate(per_rank):
        totals[rank // ranks_per_node] = totals.get(rank // ranks_per_node, 0) + n
    return [totals[rank // ranks_per_node] for rank in range(len(per_rank))]


def _host_path(label: str, network: str, sent: Sequence[int], received: Sequence[int], trainer_net: list[float],
               inference_net: list[float], copy_out: float, copy_in: float) -> SyncPrediction:
    """A transport that stages in host memory: `copy_out` / `copy_in` bytes per second (0: a CPU side, no copy)."""
    out = [n / copy_out if copy_out else 0.0 for n in sent]
    back = [n / copy_in if copy_in else 0.0 for n in received]
    sync = max(out) + max(max(trainer_net), max(inference_net)) + max(back)
    path = ", ".join(([f"GPU -> host {copy_out / GB:g} GB/s (PCIe Gen5 x16, pinned)"] if copy_out else [])
                     + [network] + ([f"host -> GPU {copy_in / GB:g} GB/s"] if copy_in else []))
    return SyncPrediction(label=label, transport=label, path=path, sync_s=sync,
                          trainer_rank_s=tuple(a + b for a, b in zip(out, trainer_net, strict=True)),
                          inference_rank_s=tuple(a + b for a, b in zip(inference_net, back, strict=True)))


def predict_sync(*, sent_per_trainer_rank: Sequence[int], received_per_inference_rank: Sequence[int],
                 trainer_ranks_per_node: int, inference_ranks_per_node: int, trainer_on_gpus: bool,
                 inference_on_gpus: bool, bandwidths: Bandwidths = Bandwidths()) -> list[SyncPrediction]:
    """The update's predicted time over every transport the layout can use (NCCL only with GPUs on both ends)."""
    sent, received, bw = list(sent_per_trainer_rank), list(received_per_inference_rank), bandwidths
    if not sent or not received or min(trainer_ranks_per_node, inference_ranks_per_node) < 1:
        raise PlanError("predict_sync needs at least one rank on each side and one rank per node")
    ib, eth = bw.infiniband_per_gpu, bw.ethernet_per_node
    out: list[SyncPrediction] = []
    if trainer_on_gpus and inference_on_gpus:
        for label, rate, path in (
                ("nccl", ib, f"NCCL over InfiniBand NDR, {ib / GB:g} GB/s per GPU ({ib * 8 / GB:g} Gbit/s, a port "
                             "per GPU)"),
                ("nccl-nvlink", bw.nvlink_per_gpu, f"NCCL over NVLink, {bw.nvlink_per_gpu / GB:g} GB/s per H100 "
                                                   "and direction (within a node only)")):
            t, i = tuple(n / rate for n in sent), tuple(n / rate for n in received)
            out.append(SyncPrediction(label=label, transport="nccl", path=path, trainer_rank_s=t, inference_rank_s=i,
                                      sync_s=max(max(t), max(i)), same_node_only=label == "nccl-nvlink"))
    copy_out, copy_in = (bw.pcie if trainer_on_gpus else 0.0), (bw.pcie if inference_on_gpus else 0.0)
    tcp_out = [n / eth for n in _node_bytes(sent, trainer_ranks_per_node)]
    tcp_in = [n / eth for n in _node_bytes(received, inference_ranks_per_node)]
    out.append(_host_path("gloo", f"TCP {eth * 8 / GB:g} Gbit/s per node shared by its ranks", sent, received,
                          tcp_out, tcp_in, copy_out, copy_in))
    out.append(_host_path("ucx", f"RDMA from host memory {ib / GB:g} GB/s per rank", sent, received,
                          [n / ib for n in sent], [n / ib for n in received], copy_out, copy_in))
    return out


def host_round_trip_warning(config: Config) -> str:
    """Why a config that chose gloo or ucx with GPUs in both groups pays a host round trip; "" otherwise."""
    chosen = config.weight_transport
    if chosen == "nccl" or not (config.trainer.gpus_per_node > 0 and config.inference.gpus_per_node > 0):
        return ""
    path = "TCP" if chosen == "gloo" else "UCX (it moves CPU tensors only)"
    return (f'inference.weight_transport = "{chosen}" with GPUs in the trainer and inference groups: every weight '
            f"goes GPU -> host -> {path} -> host -> GPU, staged in pinned host memory on both ends, each "
            'update (`hpcrl plan --transfer` predicts the time); set weight_transport = "nccl", or remove it '
            '("auto" picks nccl when both groups have GPUs)')
