"""`hpcrl run`'s trainer: a bfloat16 run is one rank in a torch.distributed group of one, so it trains through
FSDP2's mixed precision as on a job's ranks (here on CPU, gloo), and the group is gone at the end; a float32 run
forms no group and stays unsharded (fast)."""

from __future__ import annotations

import math

import pytest

from hpcrl.config import load_config
from hpcrl.launch.inprocess import OneProcessTrainer
from hpcrl.trainer import pad_rows


def rows():
    return pad_rows(sequences=[[1, 40, 41, 42, 43], [1, 40, 50], [1, 60, 61, 62, 63, 64]],
                    prompt_lengths=[2, 2, 3], old_logprobs=[[-4.8, -4.9, -5.0], [-4.6], [-4.9, -4.8, -4.7]],
                    advantages=[1.0, -1.0, 0.5])


@pytest.mark.timeout(120)
def test_hpcrl_runs_trainer_trains_a_tiny_model_in_bfloat16_mixed_precision_and_leaves_its_group(repo, tiny_model):
    import torch
    import torch.distributed as dist

    config = load_config(repo / "configs" / "tiny_grpo.toml", overrides=[f'model.path="{tiny_model}"'])
    trainer = OneProcessTrainer(config, dtype="bfloat16")
    try:
        engine = trainer.engine
        assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        assert engine.options.dtype == "bfloat16"
        compute: set[tuple[torch.dtype, torch.dtype]] = set()
        for module in engine.model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(lambda m, args, out: compute.add((m.weight.dtype, out.dtype)))
        before = engine.full_state_dict_hf()
        losses = [trainer.thread.call(engine.train_step, rows()).loss for _ in range(2)]
        after = engine.full_state_dict_hf()
        assert compute == {(torch.bfloat16, torch.bfloat16)}  # every matmul ran in bf16 ...
        assert {p.dtype for p in engine.model.parameters()} == {torch.float32}  # ... from fp32 master weights
        assert all(math.isfinite(loss) for loss in losses)
        assert all(not torch.equal(before[name], after[name]) for name in before), "some weights did not move"
    finally:
        trainer.close()
    assert not dist.is_initialized()


@pytest.mark.timeout(120)
def test_a_float32_run_stays_unsharded_and_forms_no_group(repo, tiny_model):
    import torch.distributed as dist

    config = load_config(repo / "configs" / "tiny_grpo.toml", overrides=[f'model.path="{tiny_model}"'])
    trainer = OneProcessTrainer(config)
    try:
        assert not dist.is_initialized() and not trainer.engine.distributed  # no FSDP2 wrappers on a world of 1
        assert math.isfinite(trainer.thread.call(trainer.engine.train_step, rows()).loss)
    finally:
        trainer.close()
