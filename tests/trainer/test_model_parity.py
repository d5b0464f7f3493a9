"""The torchtitan model built from a ModelShape computes what Hugging Face transformers computes."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from trainer_workers import toy_batch

from hpcrl.config.model_shapes import PRESETS, ModelShape
from hpcrl.trainer import EngineOptions, TrainerEngine


def _hf_model(shape: ModelShape, out: Path, **extra):
    """A random HF model of `shape`, saved to `out` (safetensors + config.json)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = {**shape.to_hf_config(), **extra}
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf.pop("model_type"), **hf), dtype=torch.float32)
    with torch.no_grad():  # norms start at 1: make them random so a swapped norm would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out, safe_serialization=True)
    return model.eval()


#: Llama 3.1's RoPE scaling, with an original context short enough to change the tiny model's frequencies.
LLAMA3_ROPE = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}

SHAPES = {
    "llama": PRESETS["tiny-llama"],
    "llama (llama3 rope scaling)": PRESETS["tiny-llama"],
    "qwen2 (q/k/v biases, tied embeddings)": PRESETS["tiny-qwen2"],
    "qwen3 (q/k norms)": dataclasses.replace(
        PRESETS["tiny-llama"], architecture="Qwen3ForCausalLM", qk_norm=True, rope_theta=1e6, rms_norm_eps=1e-6),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", list(SHAPES))
def test_titan_logits_and_logprobs_equal_hugging_face_in_fp32(family, tmp_path):
    shape = SHAPES[family]
    hf = _hf_model(shape, tmp_path, **(LLAMA3_ROPE if "llama3 rope" in family else {}))
    engine = TrainerEngine(EngineOptions(shape=shape, weights_path=str(tmp_path), max_seq_len=64))
    assert (engine.options.rope_scaling is not None) == ("llama3 rope" in family)
    torch.manual_seed(0)
    tokens = torch.randint(0, shape.vocab_size, (3, 24))
    with torch.no_grad():
        ours, theirs = engine.model(tokens), hf(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-5

    batch = toy_batch()
    with torch.no_grad():
        hf_logp = hf(batch.tokens).logits[:, :-1].log_softmax(-1).gather(-1, batch.tokens[:, 1:, None])[..., 0]
    ours_logp = engine.logprobs(batch)
    mask = batch.completion_mask
    assert (ours_logp[mask] - hf_logp[mask[:, 1:]]).abs().max().item() < 1e-5


@pytest.mark.timeout(60)
def test_tiny_checkpoint_loads_with_the_shape_of_its_preset(tiny_model):
    engine = TrainerEngine(EngineOptions(shape=PRESETS["tiny-llama"], weights_path=str(tiny_model), max_seq_len=32))
    full = engine.full_state_dict_hf()
    from safetensors.torch import load_file
    saved = load_file(str(tiny_model / "model.safetensors"))
    assert set(full) == set(saved)
    assert all(torch.equal(full[name], saved[name]) for name in saved)


@pytest.mark.parametrize("scaling, says", [
    ('{"rope_type": "linear", "factor": 4.0}', "rope scaling 'linear' is not supported"),
    # YaRN without DeepSeek's mscale = mscale_all_dim scales cos/sin by 0.1 ln 4 + 1 (Qwen's YaRN): not built
    ('{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}',
     "YaRN with an attention factor of 1.13863 on cos/sin is not built"),
    ('{"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0}',
     "YaRN scaling lacks 'original_max_position_embeddings'"),
])
def test_rope_scaling_the_trainer_does_not_build_is_refused_with_the_file_named(tmp_path, scaling, says):
    from hpcrl.errors import TrainerError
    from hpcrl.trainer.weights import read_rope_scaling
    (tmp_path / "config.json").write_text(f'{{"rope_scaling": {scaling}}}')
    with pytest.raises(TrainerError, match=r"config.json: " + re.escape(says)):
        read_rope_scaling(tmp_path)
