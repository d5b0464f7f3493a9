"""The config of the controller tests that run the real loop over in-memory groups (fake_ports.py):
the embedded default's shape, small, with the knobs those tests turn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpcrl.algorithms import algorithm_options
from hpcrl.config.schema import (
    Config,
    DataConfig,
    InferenceConfig,
    ModelConfig,
    RewardConfig,
    RunConfig,
    TrainerConfig,
)


def fake_config(run_dir: Path, *, run_name: str, seed: int, steps: int, prompts_per_step: int, group_size: int,
                interval: int = 0, replicas: int = 1, trainer_nodes: int = 1, **algorithm: Any) -> Config:
    """A run of `steps` steps of `prompts_per_step` x `group_size` rollouts; `algorithm` are [algorithm] keys."""
    return Config(
        run=RunConfig(name=run_name, run_dir=str(run_dir), seed=seed),
        model=ModelConfig(preset="tiny-llama", dtype="float32"),
        data=DataConfig(source="builtin:echo", max_prompt_tokens=16),
        trainer=TrainerConfig(nodes=trainer_nodes, gpus_per_node=0, ranks_per_node=1, steps=steps, lr=1e-3,
                              checkpoint_interval=interval, global_batch_size=prompts_per_step * group_size,
                              micro_batch_size=4),
        inference=InferenceConfig(gpus_per_node=0, replicas=replicas, max_tokens=1),
        reward=RewardConfig(function="hpcrl.reward.builtin:exact_match", tasks=1),
        algorithm=algorithm_options(group_size=group_size, **algorithm))
