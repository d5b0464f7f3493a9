"""LoRA in the trainer (hpcrl.trainer.lora): the base frozen, step 0 the base model, the reference the
base with the adapters off, adapter-only checkpoints that resume bitwise and refuse another base."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import torch
from trainer_workers import engine_options, run_ranks, toy_batch

from hpcrl.algorithms import ALGORITHMS, algorithm_options
from hpcrl.algorithms.base import Options
from hpcrl.config.schema import LoraConfig
from hpcrl.errors import TrainerError
from hpcrl.models.lora import LORA_TARGETS, adapter_parameters
from hpcrl.trainer import TrainerEngine
from hpcrl.trainer.checkpoint import BASE_FILE

LORA = LoraConfig(rank=4, alpha=8.0, targets=list(LORA_TARGETS))  # every block linear and the lm_head


def _lora_engine(model_dir, **overrides) -> TrainerEngine:
    return TrainerEngine(engine_options(str(model_dir), **{"lora": LORA, **overrides}))


@pytest.fixture(scope="module")
def base_engine(tiny_model):
    """The tiny model without LoRA (kl_coef 0: no reference copy)."""
    return TrainerEngine(engine_options(str(tiny_model), loss=Options(clip_eps_low=0.2, clip_eps_high=0.28)))


@pytest.mark.timeout(120)
def test_step_zero_is_the_base_model_bitwise_and_only_the_adapters_train(tiny_model, base_engine):
    engine = _lora_engine(tiny_model)
    batch = toy_batch()
    assert torch.equal(engine.logprobs(batch), base_engine.logprobs(batch))
    names = [name for name, _ in adapter_parameters(engine.options.shape, LORA.rank, LORA.targets)]
    assert list(engine.local_shards()) == names  # what the weight transfer sends: the adapters only
    adapters = engine.adapter_state_dict()
    for name, tensor in adapters.items():
        if name.endswith("lora_A.weight"):  # PEFT's kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))
            bound = 1 / math.sqrt(tensor.shape[1])
            assert tensor.abs().max() <= bound and tensor.std() > bound / 3
        else:
            assert not tensor.any()
    trainable = [p for p in engine.model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == sum(t.numel() for t in adapters.values())
    engine.train_step(batch)
    engine.train_step(batch)
    assert sum(len(state) > 0 for state in engine.optimizer.state.values()) == len(names)  # no state for the base
    base = base_engine.full_state_dict_hf()
    assert all(torch.equal(tensor, base[name]) for name, tensor in engine.full_state_dict_hf().items())
    moved = engine.adapter_state_dict()
    assert all(moved[n].any() for n in names if n.endswith("lora_B.weight"))
    assert not torch.equal(engine.logprobs(batch), base_engine.logprobs(batch))


@pytest.mark.timeout(120)
def test_the_reference_is_the_base_model_with_the_adapters_off_and_no_second_copy(tiny_model, base_engine):
    engine = _lora_engine(tiny_model, loss=Options(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.05))
    assert engine.reference is None
    batch = toy_batch()
    first, second = engine.train_step(batch), engine.train_step(batch)
    assert first.kl == 0.0 and second.kl > 0
    assert torch.equal(engine.ref_logprobs(batch), base_engine.logprobs(batch))
    assert not torch.equal(engine.logprobs(batch), base_engine.logprobs(batch))  # the adapters are back on


@pytest.mark.timeout(120)
def test_the_fused_logprob_takes_the_adapted_lm_head_as_the_heads_own_forward_computes_it(tiny_model):
    engine = _lora_engine(tiny_model)
    batch = toy_batch()
    engine.train_step(batch)
    engine.train_step(batch)  # the head's B has moved: its adapter changes the logits
    head = engine.model.get_submodule(engine.adapters.head)
    assert head.lora_B.weight.any()
    with torch.no_grad():
        logits = engine.model(batch.tokens)  # the lm_head's forward: W h + (alpha / rank) B A h (the hook)
    hooked = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, batch.tokens[:, 1:, None])[..., 0]
    fused = engine.logprobs(batch)[:, 1:]  # [h, A h] . [W, (alpha / rank) B]: one matmul
    mask = batch.tokens[:, 1:] != 0
    assert (fused - hooked)[mask].abs().max() < 1e-6
    hidden = torch.ones(3, head.weight.shape[1])
    with engine.adapters.off():  # the reference: the base's own hidden states and weight
        h, w = engine.adapters.head_inputs(engine.model, hidden, head.weight)
        assert h is hidden and w is head.weight


@pytest.mark.timeout(60)
def test_dropout_applies_to_the_steps_forward_only(tiny_model, base_engine):
    engine = _lora_engine(tiny_model, lora=dataclasses.replace(LORA, dropout=0.5))
    batch = toy_batch()
    engine.train_step(batch)  # B moves: the adapters now change the output, and dropout with them
    quiet = engine.logprobs(batch)
    assert torch.equal(engine.logprobs(batch), quiet)  # no dropout outside train_step
    with engine.adapters.training():
        engine.adapters.seed_dropout(seed=0, step=1, rank=0, device=engine.device)
        first = engine.logprobs(batch)
        engine.adapters.seed_dropout(seed=0, step=1, rank=0, device=engine.device)
        assert torch.equal(engine.logprobs(batch), first)  # the step's seed decides the masks
    assert not torch.equal(first, quiet)
    with pytest.raises(TrainerError, match="lora.dropout.*activation_checkpointing"):
        engine_options(str(tiny_model), lora=engine.adapters.config, activation_checkpointing=True)


@pytest.mark.timeout(120)
def test_every_algorithm_trains_the_adapters(tiny_model):
    engine = _lora_engine(tiny_model)
    batch = toy_batch()
    for name in ALGORITHMS:
        before = engine.adapter_state_dict()
        engine.options = dataclasses.replace(engine.options, loss=algorithm_options(name=name, kl_coef=0.05, max_tokens=8))
        metrics = engine.train_step(batch)
        after = engine.adapter_state_dict()
        assert math.isfinite(metrics.loss) and metrics.grad_norm > 0, name
        assert any(not torch.equal(before[n], after[n]) for n in after), name


@pytest.mark.timeout(180)
def test_an_adapter_checkpoint_holds_no_base_weight_and_resumes_bitwise(tiny_model, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    batch = toy_batch()
    engine = _lora_engine(tiny_model, lora=dataclasses.replace(LORA, dropout=0.1))  # its masks too
    engine.train_step(batch)
    engine.save_checkpoint(tmp_path / "ckpt")
    expected = engine.train_step(batch)
    saved = FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    assert not any("wq.weight" in k and "lora" not in k for k in saved)  # no base weight, no state of one
    base = json.loads((tmp_path / "ckpt" / BASE_FILE).read_text())
    assert base["path"] == str(tiny_model.resolve()) and len(base["sha256"]) == 64

    resumed = _lora_engine(tiny_model, lora=dataclasses.replace(LORA, dropout=0.1))
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.step == 1
    again = resumed.train_step(batch)
    for key in ("loss", "grad_norm", "kl", "entropy"):
        assert getattr(again, key) == getattr(expected, key), key
    ours, theirs = resumed.adapter_state_dict(), engine.adapter_state_dict()
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)


@pytest.mark.timeout(180)
def test_a_resume_on_another_base_or_without_lora_is_refused_naming_both(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    engine = _lora_engine(tiny_model)
    engine.save_checkpoint(tmp_path / "ckpt")
    other = tmp_path / "other-base"
    shutil.copytree(tiny_model, other)
    tensors = load_file(str(other / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 2
    save_file(tensors, str(other / "model.safetensors"))
    with pytest.raises(TrainerError, match=f"{tiny_model.resolve()}.*{other.resolve()}.*set model.path"):
        _lora_engine(other).load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(TrainerError, match="holds LoRA adapters.*no \\[lora\\] table"):
        TrainerEngine(engine_options(str(tiny_model))).load_checkpoint(tmp_path / "ckpt")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_lora_on_two_fsdp_gloo_ranks_takes_the_step_of_one_process_and_sends_row_chunks(tiny_model, tmp_path):
    one = _lora_engine(tiny_model)
    batch = toy_batch()
    one.logprobs(batch)
    metrics = one.train_step(batch)
    ranks = run_ranks(2, tmp_path, str(tiny_model), lora=LORA)
    for key in ("loss", "kl", "entropy", "grad_norm"):
        assert ranks[0]["metrics"][key] == pytest.approx(getattr(metrics, key), rel=1e-5, abs=1e-6), key
    full = one.adapter_state_dict()
    for name, tensor in full.items():
        assert (ranks[0]["adapters"][name] - tensor).abs().max() < 1e-5
        # each rank's local shard is its torch.chunk of the rows (FSDP2 Shard(0))
        parts = [r["shards"][name] for r in ranks]
        chunks = torch.chunk(ranks[0]["adapters"][name], 2)
        assert [p[2] for p in parts] == [0, chunks[0].shape[0]] and all(p[1] == tuple(tensor.shape) for p in parts)
        assert all(torch.equal(p[0], c) for p, c in zip(parts, chunks, strict=True))


@pytest.mark.timeout(120)
def test_activation_checkpointing_does_not_change_the_lora_step(tiny_model):
    batch = toy_batch()
    plain, checkpointed = _lora_engine(tiny_model), _lora_engine(tiny_model, activation_checkpointing=True)
    first, second = plain.train_step(batch), checkpointed.train_step(batch)
    assert (first.loss, first.grad_norm) == (second.loss, second.grad_norm)
    ours, theirs = plain.adapter_state_dict(), checkpointed.adapter_state_dict()
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)


@pytest.mark.timeout(120)
def test_a_moe_model_takes_adapters_on_its_attention_and_trains_them():
    from hpcrl.config.model_shapes import PRESETS
    from hpcrl.trainer import EngineOptions

    shape = PRESETS["tiny-qwen3-moe"]
    engine = TrainerEngine(EngineOptions(shape=shape, max_seq_len=64, lora=LORA, loss=Options(kl_coef=0.1)))
    assert list(engine.adapters.names) == [n for n, _ in adapter_parameters(shape, LORA.rank, LORA.targets)]
    assert all(".self_attn." in name or name.startswith("lm_head.") for name in engine.adapters.names)  # no expert
    metrics = engine.train_step(toy_batch())
    assert math.isfinite(metrics.loss) and metrics.grad_norm > 0
    assert any(t.any() for n, t in engine.adapter_state_dict().items() if n.endswith("lora_B.weight"))
