"""Model shapes from a preset name or a Hugging Face config.json, without any weights.

Everything the planners need to know about a model (parameter names and shapes, parameter
count, KV-cache bytes per token) comes from a `ModelShape`. Presets cover the shipped configs;
any Llama / Qwen2 / Qwen3 checkpoint directory works through its config.json.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hpcrl.errors import ConfigError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

#: Hugging Face architectures hpcrl knows how to train, serve and reshard.
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    architecture: str
    """Hugging Face architecture name (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    """Qwen2 has biases on q/k/v projections."""
    qk_norm: bool = False
    """Qwen3 normalises q and k per head (q_norm, k_norm of size head_dim)."""
    max_position: int = 8192
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5

    def hf_parameters(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(Hugging Face parameter name, shape) for every parameter, in checkpoint order."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        yield "model.embed_tokens.weight", (self.vocab_size, h)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", (h,)
            yield p + "self_attn.q_proj.weight", (q, h)
            yield p + "self_attn.k_proj.weight", (kv, h)
            yield p + "self_attn.v_proj.weight", (kv, h)
            if self.qkv_bias:
                yield p + "self_attn.q_proj.bias", (q,)
                yield p + "self_attn.k_proj.bias", (kv,)
                yield p + "self_attn.v_proj.bias", (kv,)
            if self.qk_norm:
                yield p + "self_attn.q_norm.weight", (d,)
                yield p + "self_attn.k_norm.weight", (d,)
            yield p + "self_attn.o_proj.weight", (h, q)
            yield p + "post_attention_layernorm.weight", (h,)
            yield p + "mlp.gate_proj.weight", (self.intermediate_size, h)
            yield p + "mlp.up_proj.weight", (self.intermediate_size, h)
            yield p + "mlp.down_proj.weight", (h, self.intermediate_size)
        yield "model.norm.weight", (h,)
        if not self.tie_embeddings:
            yield "lm_head.weight", (self.vocab_size, h)

    @property
    def num_parameters(self) -> int:
        return sum(_numel(shape) for _, shape in self.hf_parameters())

    @property
    def layer_parameters(self) -> int:
        """Parameters of one transformer block (what FSDP gathers at a time)."""
        prefix = "model.layers.0."
        return sum(_numel(s) for n, s in self.hf_parameters() if n.startswith(prefix))

    def kv_bytes_per_token(self, dtype_bytes: int, tensor_parallel: int = 1) -> int:
        """KV-cache bytes one token takes on one tensor-parallel rank (KV heads replicate past TP)."""
        kv_heads_per_rank = max(1, self.num_kv_heads // tensor_parallel)
        return 2 * self.num_layers * kv_heads_per_rank * self.head_dim * dtype_bytes

    def to_hf_config(self) -> dict:
        """A Hugging Face config.json dict for this shape (used by tools/make_tiny_model.py)."""
        config = {
            "architectures": [self.architecture],
            "model_type": {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                           "Qwen3ForCausalLM": "qwen3"}[self.architecture],
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_position, "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps, "hidden_act": "silu",
        }
        if self.architecture == "LlamaForCausalLM":
            config["attention_bias"] = self.qkv_bias
        return config


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _llama(**kw) -> ModelShape:
    return ModelShape(architecture="LlamaForCausalLM", **kw)


def _qwen2(**kw) -> ModelShape:
    return ModelShape(architecture="Qwen2ForCausalLM", qkv_bias=True, rope_theta=1000000.0,
                      rms_norm_eps=1e-6, **kw)


PRESETS: dict[str, ModelShape] = {
    # Made locally by tools/make_tiny_model.py (character-level tokenizer, random weights).
    "tiny-llama": _llama(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=32, vocab_size=128, max_position=1024,
                         rope_theta=10000.0),
    "tiny-qwen2": _qwen2(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=32, vocab_size=100, tie_embeddings=True,
                         max_position=1024),
    "llama3-1b": _llama(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                        num_kv_heads=8, head_dim=64, vocab_size=128256, tie_embeddings=True,
                        max_position=131072),
    "llama3-8b": _llama(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, vocab_size=128256, max_position=131072),
    "llama3-70b": _llama(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                         num_kv_heads=8, head_dim=128, vocab_size=128256, max_position=131072),
    "qwen2.5-0.5b": _qwen2(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                           num_kv_heads=2, head_dim=64, vocab_size=151936, tie_embeddings=True,
                           max_position=32768),
    "qwen2.5-7b": _qwen2(hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                         num_kv_heads=4, head_dim=128, vocab_size=152064, max_position=32768),
    "qwen3-8b": ModelShape(architecture="Qwen3ForCausalLM", hidden_size=4096, intermediate_size=12288,
                           num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                           vocab_size=151936, qk_norm=True, max_position=40960,
                           rope_theta=1000000.0, rms_norm_eps=1e-6),
}


def preset(name: str) -> ModelShape:
    """The preset called `name`; an unknown name is a ConfigError with the closest match."""
    if name in PRESETS:
        return PRESETS[name]
    close = difflib.get_close_matches(name, list(PRESETS), n=1)
    guess = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(key="model.preset", problem=f"unknown model preset {name!r}",
                      fix=f"{guess}known presets: {', '.join(PRESETS)}; or set model.path to a checkpoint")


def from_hf_config(config: dict, *, where: str = "config.json") -> ModelShape:
    """Shape from a Hugging Face config.json dict (Llama, Qwen2, Qwen3)."""
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise ConfigError(key="model.path", problem=f"{where} has architecture {arch!r}, which hpcrl cannot train",
                          fix=f"use a checkpoint of one of: {', '.join(ARCHITECTURES)}")
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return ModelShape(
            architecture=arch, hidden_size=hidden, intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            max_position=int(config.get("max_position_embeddings", 8192)),
            # transformers >= 5 writes rope_parameters.rope_theta; older configs rope_theta.
            rope_theta=float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get(
                "rope_theta", 10000.0)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        )
    except KeyError as err:
        raise ConfigError(key="model.path", problem=f"{where} lacks {err.args[0]!r}",
                          fix="point model.path at a complete Hugging Face checkpoint") from None


def load_shape(*, preset_name: str, path: str) -> ModelShape:
    """The model's shape: the preset when named, else config.json under `path`."""
    if preset_name:
        return preset(preset_name)
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ConfigError(key="model.path", problem=f"{config_file} does not exist",
                          fix="point model.path at a Hugging Face checkpoint directory, or make the tiny "
                              "model with `python tools/make_tiny_model.py`, or set model.preset")
    try:
        return from_hf_config(json.loads(config_file.read_text()), where=str(config_file))
    except json.JSONDecodeError as err:
        raise ConfigError(key="model.path", problem=f"{config_file} is not valid JSON ({err})",
                          fix="restore the checkpoint's config.json") from None
