"""The weight-transfer plan of a run, as both ends compute it from the run's config.

    plan = plan_for_config(config)      # trainer ranks, the head and every inference replica agree

The trainer is sharded over its whole world (FSDP dp_shard = world size, or HSDP when the config
says dp_replicate > 1), parameters named as in HF checkpoints (the trainer engine's local_shards);
inference runs `inference.replicas` engines of `inference.tensor_parallel` ranks. The plan's digest,
exchanged when the transfer group forms, catches any difference between the two ends.
"""

from __future__ import annotations

import dataclasses

from hpcrl.config.schema import Config
from hpcrl.plan.transfer_plan import TransferPlan

#: Bytes per transfer message (the planner buckets runs up to this size).
BUCKET_BYTES = 16 << 20


def wire_dtype_for(config: Config) -> str:
    """fp32 on CPU (vLLM-CPU serves fp32 there), else the model's dtype."""
    return "float32" if config.inference.gpus_per_node == 0 else config.model.dtype


def plan_for_config(config: Config) -> TransferPlan:
    from hpcrl.config.model_shapes import load_shape
    from hpcrl.plan.transfer_layout import InferenceLayout, TrainerLayout
    from hpcrl.plan.transfer_planner import plan as plan_transfer

    world = config.trainer.world_size
    replicate = max(1, config.trainer.dp_replicate)
    shape = load_shape(preset_name=config.model.preset, path=config.model.path)
    plan = plan_transfer(TrainerLayout(dp_replicate=replicate, dp_shard=world // replicate, naming="hf"),
                         InferenceLayout(replicas=config.inference.replicas,
                                         tensor_parallel=config.inference.tensor_parallel),
                         shape, wire_dtype=wire_dtype_for(config), bucket_bytes=BUCKET_BYTES)
    return dataclasses.replace(plan, round_bytes=config.inference.transfer_round_mib << 20)
