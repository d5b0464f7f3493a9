"""The weight-transfer plan of a run, as every part of it and `hpcrl plan --transfer` compute it from the config.

    plan = plan_for_config(config)      # trainer ranks, the head, every inference replica, the CLI
    log.info(describe_plan(plan))       # "weight transfer plan 3f2a...: trainer 1 x 2 (FSDP2 Shard(0)) -> ..."

The trainer is sharded over its whole world (FSDP dp_shard = world size, or HSDP when the config
says dp_replicate > 1), parameters named as in HF checkpoints (the trainer engine's local_shards;
a MoE's experts as grouped stacks, FSDP-sharded by whole experts); inference runs
`inference.replicas` engines of `inference.tensor_parallel` ranks (a MoE's experts split by TP, or
whole experts per rank with `inference.expert_parallel`); with [lora], only the LoRA adapters, into
vLLM's LoRA slots (hpcrl/plan/transfer/lora.py); the wire dtype is
what vLLM serves (float32 on CPU); messages are BUCKET_BYTES; rounds `inference.transfer_round_mib`.
The plan's digest, exchanged when the transfer group forms, catches any difference between the
ends; the run logs describe_plan's line and the CLI prints the same, so the plan a user sizes a
cluster with is the one the run executes (tests/cli/test_plan_transfer.py).
"""

from __future__ import annotations

import dataclasses

from hpcrl.config.model_shapes import ModelShape
from hpcrl.config.schema import Config
from hpcrl.plan.transfer.plan import TransferPlan

#: Bytes per transfer message (the planner buckets runs up to this size).
BUCKET_BYTES = 16 << 20


def wire_dtype_for(config: Config) -> str:
    """fp32 on CPU (vLLM-CPU serves fp32 there), else the model's dtype."""
    return "float32" if config.inference.gpus_per_node == 0 else config.model.dtype


def plan_for_config(config: Config, shape: ModelShape | None = None) -> TransferPlan:
    """The run's transfer plan. `shape` is the config's model (shape_of [model]), read here when
    not given; a caller that already read it passes it so the model files are read once."""
    from hpcrl.config.model_shapes import shape_of
    from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
    from hpcrl.plan.transfer.planner import plan as plan_transfer

    world = config.trainer.world_size
    replicate = max(1, config.trainer.dp_replicate)
    if shape is None:
        shape = shape_of(config.model)
    moe = shape.experts() is not None
    # A MoE trainer holds each layer's experts as torchtitan's grouped stacks (hpcrl.trainer.weights
    # names them as HF without the expert index); vLLM's expert parallel only matters for a MoE.
    # With [lora] only the adapters move (hpcrl/plan/transfer/lora.py), named in the family's order of targets.
    lora = config.lora
    targets = tuple(t for t in shape.family.lora_targets if t in lora.targets) if lora else ()
    plan = plan_transfer(TrainerLayout(dp_replicate=replicate, dp_shard=world // replicate,
                                       grouped_experts=moe),
                         InferenceLayout(replicas=config.inference.replicas,
                                         tensor_parallel=config.inference.tensor_parallel,
                                         expert_parallel=moe and config.inference.expert_parallel,
                                         lora_rank=lora.rank if lora else 0, lora_targets=targets),
                         shape, wire_dtype=wire_dtype_for(config), bucket_bytes=BUCKET_BYTES)
    return dataclasses.replace(plan, round_bytes=config.inference.transfer_round_mib << 20)


def describe_plan(plan: TransferPlan) -> str:
    """One line naming a plan by its digest's first 16 hex digits, with its layouts and wire dtype:
    the first line of `hpcrl plan --transfer` and a line of every run's log."""
    t, inf = plan.trainer, plan.inference
    return (f"weight transfer plan {plan.digest[:16]}: trainer {t.dp_replicate} x {t.dp_shard} (FSDP2 Shard(0)) "
            f"-> {inf.replicas} replicas x TP {inf.tensor_parallel}{' (experts: EP)' if inf.expert_parallel else ''}, "
            f"wire {plan.wire_dtype}{lora_note(plan)}")


def lora_note(plan: TransferPlan) -> str:
    """', LoRA rank R adapters of q_proj, ...' for a plan that moves LoRA adapters only, else ''."""
    inf = plan.inference
    return f", LoRA rank {inf.lora_rank} adapters of {', '.join(inf.lora_targets)}" if inf.lora_rank else ""
