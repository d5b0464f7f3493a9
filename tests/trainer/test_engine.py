"""The trainer engine in one process: GRPO learns, options come from the config, errors say why."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from trainer_workers import engine_options, toy_batch

from hpcrl.algorithms.base import Options
from hpcrl.config import load_config
from hpcrl.errors import TrainerError
from hpcrl.trainer import EngineOptions, RolloutBatch, TrainerEngine, pad_rows
from hpcrl.trainer.parallel import dp_layout
from hpcrl.trainer.schedule import lr_at


@pytest.mark.timeout(120)
def test_a_few_grpo_steps_raise_the_probability_of_positively_advantaged_tokens(tiny_model):
    engine = TrainerEngine(engine_options(str(tiny_model), micro_batch_size=2, grad_clip=1.0,
                                          loss=Options(clip_eps_low=0.2, clip_eps_high=0.28)))
    batch = toy_batch()
    batch = dataclasses.replace(batch, old_logprobs=engine.logprobs(batch))  # on-policy rollouts
    before = engine.logprobs(batch)
    losses = [engine.train_step(batch).loss for _ in range(4)]
    after = engine.logprobs(batch)
    mask = batch.completion_mask
    advantage = batch.advantages[:, None].expand_as(mask)
    gain = (after - before)[mask]
    assert losses[-1] < losses[0]
    assert (gain[advantage[mask] > 0] > 0).all()
    assert (gain[advantage[mask] < 0] < 0).all()


@pytest.mark.timeout(120)
def test_micro_batching_and_activation_checkpointing_do_not_change_the_step(tiny_model):
    batch = toy_batch()
    results = []
    for micro, checkpointing in ((5, False), (2, True)):
        engine = TrainerEngine(engine_options(str(tiny_model), micro_batch_size=micro,
                                              activation_checkpointing=checkpointing))
        metrics = engine.train_step(batch)
        results.append((metrics, engine.full_state_dict_hf()))
    (m1, w1), (m2, w2) = results
    assert m1.grad_norm == pytest.approx(m2.grad_norm, rel=1e-5)
    assert m1.loss == pytest.approx(m2.loss, rel=1e-5)
    assert max((w1[n] - w2[n]).abs().max().item() for n in w1) < 1e-5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunk_tokens, recompute", [(3, False), (5, True), (1024, False)])
def test_the_steps_entropy_and_mismatch_equal_the_plain_full_logits_computation(tiny_model, chunk_tokens, recompute):
    batch = toy_batch()
    engine = TrainerEngine(engine_options(str(tiny_model), micro_batch_size=2, temperature=0.8,
                                          logprob_chunk_tokens=chunk_tokens, logprob_recompute=recompute))
    with torch.no_grad():  # the reference: full logits of the model as it is before the step
        logits = engine.model(batch.tokens)[:, :-1].double() / 0.8
    logp = torch.nn.functional.pad(
        torch.log_softmax(logits, -1).gather(-1, batch.tokens[:, 1:, None]).squeeze(-1), (1, 0))
    entropy = torch.nn.functional.pad(-(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1), (1, 0))
    mask = batch.completion_mask
    torch.testing.assert_close(engine.logprobs(batch)[mask].double(), logp[mask], rtol=0, atol=1e-6)
    metrics = engine.train_step(batch)
    assert metrics.entropy == pytest.approx(float(entropy[mask].mean()), rel=1e-5)
    assert metrics.sampling_logprob_diff == pytest.approx(float((logp - batch.old_logprobs)[mask].abs().mean()), rel=1e-5)


@pytest.mark.timeout(60)
def test_kl_to_the_frozen_reference_starts_at_zero_and_grows_as_the_policy_moves(tiny_model):
    engine = TrainerEngine(engine_options(str(tiny_model), loss=Options(kl_coef=0.05)))
    batch = toy_batch()
    first = engine.train_step(batch)
    second = engine.train_step(batch)
    assert first.kl == 0.0 and second.kl > 0
    assert torch.equal(engine.ref_logprobs(batch), TrainerEngine(engine_options(str(tiny_model))).logprobs(batch))


@pytest.mark.timeout(60)
def test_engine_options_come_from_the_embedded_default_config(repo, tiny_model):
    config = load_config(repo / "configs" / "tiny_grpo.toml",
                         overrides=["trainer.warmup_steps=2", "trainer.micro_batch_size=16"])
    options = EngineOptions.from_config(config)
    assert options.device == "cpu" and options.dtype == "float32"
    assert (options.lr, options.betas, options.warmup_steps, options.micro_batch_size) == (1e-3, (0.9, 0.99), 2, 16)
    assert options.loss.clip_eps_high == 0.28 and options.loss.loss_aggregation == "token_mean"
    assert options.weights_path.endswith("models/tiny-llama")
    assert options.max_seq_len == config.max_model_len + 1  # the role and hpcrl run no longer pass it
    engine = TrainerEngine.from_config(config, max_seq_len=64)
    assert engine.reference is None and engine.lr(0) == pytest.approx(5e-4)


def test_learning_rate_warms_up_then_follows_the_schedule():
    kw = dict(peak=1.0, total_steps=12, warmup_steps=2, min_lr_ratio=0.1)
    assert [lr_at(s, **kw) for s in (0, 1, 2, 11)] == [0.5, 1.0, 1.0, 1.0]
    assert [lr_at(s, schedule="linear", **kw) for s in (2, 11)] == [1.0, pytest.approx(0.1)]
    assert lr_at(2 + 9 / 2, schedule="cosine", **kw) == pytest.approx(0.55)
    assert lr_at(11, schedule="cosine", **kw) == pytest.approx(0.1)


def test_a_mesh_that_does_not_cover_the_trainer_ranks_is_an_error_that_says_how_to_fix_it():
    assert dp_layout(dp_replicate=2, dp_shard=-1, world_size=8) == (2, 4)
    with pytest.raises(TrainerError, match="dp_shard = -1"):
        dp_layout(dp_replicate=2, dp_shard=3, world_size=8)


def test_batches_with_misaligned_tensors_or_a_completion_at_position_zero_are_rejected():
    good = toy_batch()
    with pytest.raises(TrainerError, match="old_logprobs has shape"):
        dataclasses.replace(good, old_logprobs=good.old_logprobs[:, :-1])
    with pytest.raises(TrainerError, match="advantages"):
        dataclasses.replace(good, advantages=torch.zeros(3))
    mask = good.completion_mask.clone()
    mask[0, 0] = True
    with pytest.raises(TrainerError, match="position 0"):
        dataclasses.replace(good, completion_mask=mask)
    with pytest.raises(TrainerError, match="row 0"):
        pad_rows([[1, 2, 3]], [2], [[-1.0, -1.0]], [1.0])


def test_shards_of_a_batch_split_rows_like_torch_chunk_and_trim_padding():
    batch = toy_batch()
    parts = [batch.shard(r, 2) for r in range(2)]
    assert [p.size for p in parts] == [3, 2]
    assert parts[1].tokens.shape == (2, 4)  # rows 3-4 end at position 4: the padding is cut
    assert torch.equal(parts[0].tokens, batch.tokens[:3])
    assert batch.shard(5, 6).size == 0 and isinstance(batch.shard(5, 6), RolloutBatch)


@pytest.mark.timeout(60)
def test_a_checkpoint_missing_a_parameter_names_it(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(tiny_model / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_model / "config.json").read_text())
    with pytest.raises(TrainerError, match=r"rank 0: .* lacks 1 parameters.*layers\.1\.mlp\.up_proj"):
        TrainerEngine(engine_options(str(tmp_path)))


@pytest.mark.timeout(120)
def test_a_resumed_engine_takes_the_same_next_step_as_one_that_never_stopped(tiny_model, tmp_path):
    batch = toy_batch()
    running = TrainerEngine(engine_options(str(tiny_model)))
    running.train_step(batch)
    running.save_checkpoint(tmp_path / "step_1")
    running.train_step(batch)
    resumed = TrainerEngine(engine_options(str(tiny_model)))
    resumed.load_checkpoint(tmp_path / "step_1")
    assert resumed.step == 1
    resumed.train_step(batch)  # needs AdamW's moments and the step count back, not just the weights
    a, b = running.full_state_dict_hf(), resumed.full_state_dict_hf()
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_an_incomplete_checkpoint_directory_is_refused(tiny_model, tmp_path):
    engine = TrainerEngine(engine_options(str(tiny_model)))
    with pytest.raises(TrainerError, match="not a complete trainer checkpoint"):
        engine.load_checkpoint(tmp_path)


def test_the_chunked_logprobs_are_compiled_by_default_on_cuda_only():
    """Measured on an H200: compiled, the step matches a plain cross-entropy loop; eager it is 1.10x.
    On CPU inductor's build outweighs what it saves."""
    from hpcrl.config.model_shapes import preset
    from hpcrl.trainer.engine import EngineOptions

    assert EngineOptions(shape=preset("tiny-llama"), device="cpu").compile_logprobs is False
    assert EngineOptions(shape=preset("tiny-llama"), device="cuda").compile_logprobs is True
    assert EngineOptions(shape=preset("tiny-llama"), device="cuda", compile_logprobs=False).compile_logprobs is False
