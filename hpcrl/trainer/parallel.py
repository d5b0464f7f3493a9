"""FSDP2 over the trainer ranks: the data-parallel mesh and `fully_shard` of a decoder.

Mesh: (dp_replicate, dp_shard). dp_replicate = 1 is plain FSDP over all ranks; dp_replicate > 1
is HSDP (parameters sharded within each replica of dp_shard ranks, gradients all-reduced across
replicas). Every transformer block is one FSDP unit, the root holds embeddings, final norm and
lm_head (tied embeddings stay in one unit).

Gradient reduction is a plain sum: the loss is already normalised by the step's global
token or sequence count (hpcrl.algorithms.terms), so FSDP's default average over ranks would shrink the
gradient by the world size. `set_gradient_divide_factor(1.0)` turns the division off, and
`set_force_sum_reduction_for_comms(True)` keeps the collectives to ReduceOp.SUM (gloo has no
PREMUL_SUM). Force-sum alone still divides, only in a separate kernel: a 2-rank step then has
half the gradient norm of one process (tests/trainer/test_fsdp.py checks it). Mixed precision: bf16 (or fp16)
compute with fp32 master weights and fp32 reduction on GPUs; fp32 throughout on CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hpcrl.errors import TrainerError


def dp_layout(*, dp_replicate: int, dp_shard: int, world_size: int) -> tuple[int, int]:
    """(replicate, shard) with dp_shard = -1 resolved; their product must be the world size."""
    shard = world_size // dp_replicate if dp_shard == -1 else dp_shard
    if dp_replicate * shard != world_size:
        raise TrainerError(f"trainer.dp_replicate ({dp_replicate}) x trainer.dp_shard ({dp_shard}) must equal "
                           f"the {world_size} trainer ranks; set dp_shard = -1 to use all of them")
    return dp_replicate, shard


def make_dp_mesh(*, dp_replicate: int, dp_shard: int, device_type: str):
    """The data-parallel device mesh over the default process group (1-D unless HSDP). torch makes a
    group per mesh dimension: their gloo listeners are sealed once made (hpcrl.rendezvous.listen)."""
    from torch.distributed.device_mesh import init_device_mesh

    from hpcrl.rendezvous.listen import sealing

    replicate, shard = dp_layout(dp_replicate=dp_replicate, dp_shard=dp_shard, world_size=dist.get_world_size())
    with sealing():
        mesh = init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("dp_replicate", "dp_shard"))
    return mesh if replicate > 1 else mesh["dp_shard"]


def shard_decoder(model: nn.Module, blocks: list[nn.Module], mesh, *, param_dtype: torch.dtype | None) -> None:
    """`fully_shard` each block, then the root; gradients summed over ranks (see the module docstring)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs = {"mesh": mesh, **({"mp_policy": mp} if mp else {})}
    for block in blocks:
        fully_shard(block, reshard_after_forward=True, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def reshard(model: nn.Module) -> None:
    """Free gathered parameters, so the module's parameters are its sharded DTensors again.

    The root unit keeps its parameters gathered after forward (reshard_after_forward=False,
    since backward needs them next); after a no-grad forward nothing reshards it, and
    `named_parameters()` would then give full tensors instead of this rank's shards.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
