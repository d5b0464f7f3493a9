"""A run's transfer plan for a Mixture-of-Experts config: the trainer's experts as grouped stacks,
vLLM's expert parallel from `inference.expert_parallel`, 1.00x the minimum bytes; a dense config
is planned as before whatever that key says."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.config.load import load_config_and_shape
from hpcrl.plan.for_config import describe_plan, plan_for_config
from hpcrl.plan.transfer.check import check_plan

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_grpo.toml"
# Inference on GPUs (planning only): expert parallel is refused on CPU inference, where vLLM cannot run it.
MOE = ["model.preset=tiny-qwen3-moe", "model.path=models/tiny-qwen3-moe", "trainer.ranks_per_node=2",
       "inference.tensor_parallel=2", "inference.gpus_per_node=2"]


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_a_moe_config_plans_grouped_experts_and_vllm_expert_parallel_as_configured(expert_parallel):
    config, shape = load_config_and_shape(TINY, overrides=[*MOE, f"inference.expert_parallel={str(expert_parallel).lower()}"])
    plan = plan_for_config(config, shape)
    assert plan.trainer.grouped_experts
    assert plan.inference.expert_parallel is expert_parallel
    check_plan(plan)
    assert plan.stats().ratio() == 1.0
    assert ("(experts: EP)" in describe_plan(plan)) is expert_parallel
    stacks = {s.name: s.shard_rows for s in plan.sources if ".experts." in s.name}
    assert stacks["model.layers.0.mlp.experts.down_proj.weight"] == shape.hidden_size  # whole experts per FSDP rank


def test_expert_parallel_is_refused_on_cpu_inference_and_on_a_dense_model_with_the_fix():
    from hpcrl.config import load_config
    from hpcrl.errors import ConfigError

    with pytest.raises(ConfigError, match="inference.expert_parallel.*CPU MoE kernel crashes.*Fix: set inference"):
        load_config(REPO / "configs" / "tiny_moe_grpo.toml", overrides=["inference.expert_parallel=true"])
    with pytest.raises(ConfigError, match="inference.expert_parallel.*has no experts"):
        load_config(REPO / "configs" / "tiny_grpo.toml",
                    overrides=["inference.expert_parallel=true", "inference.gpus_per_node=1"])
