"""The trainer role on CPU: a single rank forms a process group of one and trains through FSDP2."""

from __future__ import annotations

import asyncio
import math

import pytest

from hpcrl.config import load_config
from hpcrl.contract.endpoints import TrainStepCall
from hpcrl.roles.trainer import TrainerRole
from hpcrl.slurm.identity import TaskIdentity
from hpcrl.trainer.types import TrainBatch


def one_rank() -> TaskIdentity:
    return TaskIdentity(group="trainer", component=1, rank=0, group_size=1, replica=0, local_rank=0, node="n0",
                        node_index=0)


def batch() -> TrainBatch:
    return TrainBatch(prompt_ids=["a", "a", "b"], input_ids=[[1, 40, 41, 42], [1, 40, 50], [1, 60, 61, 62, 63]],
                      policy_mask=[[0, 0, 1, 1], [0, 0, 1], [0, 0, 0, 1, 1]],
                      logprobs=[[0.0, 0.0, -4.9, -5.0], [0.0, 0.0, -4.8], [0.0, 0.0, 0.0, -4.7, -5.1]],
                      advantages=[1.0, -1.0, 0.5], rewards=[1.0, 0.0, 0.5])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("micro_batch_tokens", [0, 64])  # padded rows; packed micro-batches (issue 39)
def test_a_single_trainer_rank_trains_through_fsdp_in_a_group_of_one_and_leaves_it_when_closed(repo, tiny_model,
                                                                                             micro_batch_tokens):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    config = load_config(repo / "configs" / "tiny_grpo.toml", overrides=[
        f'model.path="{tiny_model}"', f"trainer.micro_batch_tokens={micro_batch_tokens}"])
    role = TrainerRole(config, one_rank(), {})
    try:
        assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        assert role.engine_thread.device is None  # gpus_per_node = 0: no CUDA device taken
        assert all(isinstance(p, DTensor) for p in role.engine.model.parameters())
        metrics = asyncio.run(role.train_step(TrainStepCall(batch=batch(), step=1)))
        assert metrics is not None and math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    finally:
        role.close()
    assert not dist.is_initialized()
