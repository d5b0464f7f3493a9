"""The one adapter to torchtitan: model definitions from a `ModelShape`, and HF <-> torchtitan names.

Everything here imports torchtitan lazily (inside functions), so `import hpcrl.trainer` stays cheap.

Choices that differ from torchtitan's own recipes, and why:

- Attention is `ScaledDotProductAttention` (causal) for right-padded rows; for packed rows (several
  rollouts end to end, trainer.micro_batch_tokens) `DocumentCausalAttention` runs it once per rollout,
  causal within it, over the rollout's slice of q, k and v: exact, on any device, and each rollout costs
  its own length squared, not the packed row's. torchtitan's own ways need what CPU lacks: FlexAttention's
  document mask (compiled; no backward on CPU) and VarlenAttention (flash-attention kernels, CUDA only,
  bf16 only).
- Q/K/V are separate linears (`fuse_qkv=False`): torchtitan's fused `wqkv` breaks
  `get_model_state_dict` and has no HF row order.
- RoPE is `CosSinRoPE` (rotate-half, as Hugging Face computes it) for every family, Llama
  included. torchtitan's Llama recipe uses complex RoPE and permutes q/k rows on load
  (`Llama3StateDictAdapter._reverse_permute`); with rotate-half no permutation is needed, so every
  trainer parameter *is* the HF tensor of the same name, row for row. That is what lets the weight
  transfer send FSDP dim-0 shards as HF row ranges (see `hpcrl.trainer.weights.local_shards`).
  The names still come from torchtitan's adapters (`from_hf_map`).

Model families (hpcrl.models) name their torchtitan classes by dotted path (`Family.titan`),
imported here: Llama 3 (`Llama3Model`), Qwen3 (`Qwen3Model`, q/k norms), and Qwen2 built from
Qwen3's blocks with q/k/v biases and no q/k norm (torchtitan 0.3.0 has no Qwen2 model). What each
block holds the family says with generic layer kinds (`Family.blocks`, hpcrl/models/blocks.py);
each kind has one builder here: `_attention_config` (grouped-query attention, q/k/v biases and
q/k norms as the kind says), `_mlp_config` (a dense SwiGLU, or routed experts) and
`_router_config` (softmax top-k; DeepSeek-V3's grouped sigmoid top-k with its bias, `_biased_moe_class`);
multi-head latent attention is torchtitan's DeepSeek-V3 `Attention` with interleaved RoPE on its rope part
(`_latent_attention_config`). A new kind is one more branch in one of them. Llama 3.1+ "llama3" RoPE frequency
scaling (`RopeScaling`, read from config.json) is applied to the rotate-half cache the way
transformers computes it (torchtitan's CosSinRoPE refuses it).

Mixture-of-Experts (`blocks.RoutedExperts`, e.g. Qwen3-MoE): the block's MLP is torchtitan's `MoE`
(its router from the router kind: `SoftmaxTopK` renormalised or not; no shared expert; no
auxiliary-loss-free expert bias, which the Hugging Face Qwen3-MoE lacks). Its
experts are `GroupedExperts`' 3-D stacks w1_EFD / w3_EFD (E, I, H: every expert's gate_proj /
up_proj) and w2_EDF (E, H, I: down_proj), expert e at dim-0 index e (`hf_expert_slots`). torchtitan's
GroupedExperts always multiplies in bfloat16; `_ExactGroupedExperts` multiplies in the compute
dtype instead (the same `torch._grouped_mm`), so fp32 on CPU matches transformers. FSDP2 shards the
stacks on dim 0 like any parameter (a rank holds whole experts); expert parallelism is not used:
with FSDP every rank still computes every expert for its own tokens, which needs no all-to-all
and no dispatcher state to checkpoint.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from typing import Any, Protocol, cast

import torch
from torch import nn

from hpcrl.errors import TrainerError
from hpcrl.models import ModelShape, blocks

#: Inserted into parameter names by torch's activation-checkpoint wrapper.
_AC_PREFIX = "_checkpoint_wrapped_module."


def supply_missing_torch_names() -> None:
    """Give torch what torchtitan 0.3.0 imports from it and an older torch lacks, before torchtitan loads.

    torchtitan 0.3.0's model packages import `torch.distributed.fsdp.DataParallelMeshDims` (torch
    2.13 has it; torch 2.11, which pyproject.toml allows and GPU nodes ship, does not), only to
    annotate functions of models hpcrl never builds (DeepSeek-V3's MTP, Flux): a stand-in with the
    same fields lets torchtitan import, and hpcrl never constructs one. Where torch has the class,
    nothing changes. Called by the functions below that import torchtitan (never at import time).
    """
    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "DataParallelMeshDims"):
        return

    @dataclass(frozen=True)
    class DataParallelMeshDims:
        """Stand-in set by hpcrl.trainer.titan for a torch without it (see supply_missing_torch_names)."""

        shard: str | tuple[str, ...] | None = None
        replicate: str | tuple[str, ...] | None = None

    DataParallelMeshDims.__module__, DataParallelMeshDims.__qualname__ = "torch.distributed.fsdp", "DataParallelMeshDims"
    setattr(fsdp, "DataParallelMeshDims", DataParallelMeshDims)  # noqa: B010 - mypy: torch declares no such name


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3.1+ RoPE frequency scaling (config.json rope_scaling / rope_parameters, type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, kw_only=True)
class YarnRopeScaling:
    """YaRN RoPE scaling as DeepSeek-V3 and Kimi-K2 use it (config.json rope_scaling, type "yarn"): the
    frequencies interpolated by parts (transformers' `_compute_yarn_parameters`), and the softmax scale times
    (0.1 mscale_all_dim ln(factor) + 1)^2 (transformers' `yarn_apply_mscale`). Its attention factor on
    cos/sin must be 1 (weights.read_rope_scaling refuses others)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True


def llama3_inv_freq(*, head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse RoPE frequencies, scaled as transformers' `_compute_llama3_parameters` does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / scaling.low_freq_factor, old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


@cache
def _scaled_rope_class():
    """CosSinRoPE whose cache uses Llama 3 scaled frequencies (made once, on first use)."""
    from torchtitan.models.common.rope import CosSinRoPE

    class Llama3ScaledCosSinRoPE(CosSinRoPE):
        @dataclass(kw_only=True, slots=True)
        class Config(CosSinRoPE.Config):
            pass

        def _precompute_cache(self) -> torch.Tensor:
            cfg = self.config
            inv_freq = llama3_inv_freq(head_dim=cfg.dim, theta=cfg.theta, scaling=RopeScaling(
                factor=cfg.scaling_factor, low_freq_factor=cfg.low_freq_factor,
                high_freq_factor=cfg.high_freq_factor,
                original_max_position_embeddings=cfg.original_max_position_embeddings))
            freqs = torch.outer(torch.arange(cfg.max_seq_len, dtype=inv_freq.dtype), inv_freq).float()
            angles = torch.cat([freqs, freqs], dim=-1)
            return torch.cat([angles.cos(), angles.sin()], dim=-1)

    return Llama3ScaledCosSinRoPE


@cache
def _exact_grouped_experts_class():
    """torchtitan's GroupedExperts multiplying in the compute dtype, not always bfloat16 (made once)."""
    from torchtitan.models.common.moe import GroupedExperts

    class ExactGroupedExperts(GroupedExperts):
        @dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            pass

        def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
            w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w
                          for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
            dtype = w1.dtype
            x = x_RD.to(dtype)
            offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            h = nn.functional.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
            h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets).type_as(x_RD)

    return ExactGroupedExperts


@cache
def _biased_moe_class():
    """torchtitan's MoE whose router bias `expert_bias_E` is a parameter that takes no gradient (made once).

    DeepSeek-V3's router adds a per-expert bias to its scores when it chooses experts
    (`e_score_correction_bias`, the auxiliary-loss-free balancing's state). torchtitan keeps it as a
    buffer, which exists only with a load-balance coefficient (the coefficient's value is read only by
    torchtitan's own bias update, which hpcrl does not run). As a parameter (requires_grad False: no
    gradient, no optimizer state) it is an HF tensor like the others: loaded from the checkpoint, sharded
    by FSDP2, sent by the weight transfer, saved by the checkpoint."""
    from torchtitan.models.common.moe import MoE

    class BiasedMoE(MoE):
        @dataclass(kw_only=True, slots=True)
        class Config(MoE.Config):
            pass

        def __init__(self, config: Config) -> None:
            super().__init__(config)
            self.expert_bias_E = nn.Parameter(self._buffers.pop("expert_bias_E"), requires_grad=False)

        def reset_parameters(self) -> None:  # torchtitan's init of a module's own parameters
            with torch.no_grad():
                self.expert_bias_E.zero_()

        def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
            bias, coeff = self._parameters.pop("expert_bias_E"), getattr(self, "load_balance_coeff")  # noqa: B009
            self.load_balance_coeff = None  # the parent then remakes its counters, not the bias
            try:
                super()._init_self_buffers(buffer_device=buffer_device)
            finally:
                self.load_balance_coeff = coeff
                self.register_parameter("expert_bias_E", bias)

    return BiasedMoE


@dataclass(frozen=True)
class Documents:
    """A packed row's rollouts for the attention: rollout i is positions bounds[i]:bounds[i + 1] of the row."""

    bounds: tuple[int, ...]


@cache
def _document_attention_class():
    """torchtitan's ScaledDotProductAttention, causal within each rollout when given `Documents` (made once)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    class DocumentCausalAttention(ScaledDotProductAttention):
        @dataclass(kw_only=True, slots=True)
        class Config(ScaledDotProductAttention.Config):
            pass

        def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,
                    attention_masks: Any = None, **kwargs) -> torch.Tensor:
            if attention_masks is None:  # right-padded rows: the parent's causal attention, unchanged
                return super().forward(q_BLNH, k_BLNH, v_BLNH, **kwargs)
            if not isinstance(attention_masks, Documents) or q_BLNH.shape[0] != 1:
                raise TrainerError(f"packed attention takes one row and its Documents, got {type(attention_masks)} "
                                   f"over {q_BLNH.shape[0]} rows")
            bounds = attention_masks.bounds
            return torch.cat([super(DocumentCausalAttention, self).forward(
                q_BLNH[:, start:stop], k_BLNH[:, start:stop], v_BLNH[:, start:stop], is_causal=True,
                **{k: v for k, v in kwargs.items() if k != "is_causal"})
                for start, stop in zip(bounds, bounds[1:])], dim=1)

    return DocumentCausalAttention


def _router_config(router: blocks.Router, *, dim: int, num_experts: int, top_k: int, linear: dict):
    """torchtitan's router config of a router kind."""
    from torchtitan.models.common.config_utils import make_router_config

    if isinstance(router, blocks.SoftmaxTopK):
        return make_router_config(dim=dim, num_experts=num_experts, gate_param_init=linear, top_k=top_k,
                                  score_func="softmax", route_norm=router.renormalize)
    if isinstance(router, blocks.SigmoidGroupTopK):
        grouped = router.n_group > 1  # one group: every expert is a candidate, as without groups
        return make_router_config(dim=dim, num_experts=num_experts, gate_param_init=linear, top_k=top_k,
                                  score_func="sigmoid", route_norm=router.renormalize,
                                  route_scale=router.scaling_factor,
                                  num_expert_groups=router.n_group if grouped else None,
                                  num_limited_groups=router.topk_group if grouped else None)
    raise TrainerError(f"no torchtitan builder for the router kind {type(router).__name__}; "
                       "add one to hpcrl/trainer/titan.py _router_config")


def _mlp_config(mlp: blocks.MLP, *, dim: int, linear: dict, depth: dict) -> dict:
    """The `feed_forward` or `moe` entry of torchtitan's block config for an MLP kind."""
    from torchtitan.models.common.config_utils import (
        make_ffn_config,
        make_moe_config,
        make_routed_experts_config,
    )

    if isinstance(mlp, blocks.DenseMLP):
        return {"moe": None, "feed_forward": make_ffn_config(dim=dim, hidden_dim=mlp.hidden_dim, w1_param_init=linear,
                                                             w2w3_param_init=depth)}
    if isinstance(mlp, blocks.RoutedExperts):
        e, k = mlp.num_experts, mlp.top_k
        routed = make_routed_experts_config(
            dim=dim, hidden_dim=mlp.hidden_dim, num_experts=e, top_k=k,
            param_init={"w1_EFD": linear["weight"], "w3_EFD": depth["weight"], "w2_EDF": depth["weight"]},
            comm_backend="standard")
        inner = routed.inner_experts
        routed.inner_experts = _exact_grouped_experts_class().Config(
            dim=inner.dim, hidden_dim=inner.hidden_dim, num_experts=inner.num_experts, param_init=inner.param_init)
        shared = (make_ffn_config(dim=dim, hidden_dim=mlp.shared_hidden_dim, w1_param_init=linear,
                                  w2w3_param_init=depth) if mlp.shared_hidden_dim else None)
        router = _router_config(mlp.router, dim=dim, num_experts=e, top_k=k, linear=linear)
        if isinstance(mlp.router, blocks.SigmoidGroupTopK):  # a router with a bias: see _biased_moe_class
            return {"feed_forward": None, "moe": _biased_moe_class().Config(
                num_experts=e, load_balance_coeff=1.0, routed_experts=routed, shared_experts=shared, router=router)}
        return {"feed_forward": None, "moe": make_moe_config(
            num_experts=e, load_balance_coeff=None, routed_experts=routed, shared_experts=shared, router=router)}
    raise TrainerError(f"no torchtitan builder for the MLP kind {type(mlp).__name__}; "
                       "add one to hpcrl/trainer/titan.py _mlp_config")


def _attention_config(attention: blocks.Attention, *, dim: int, eps: float, rope: Callable[..., Any],
                      linear: dict, depth: dict, norm: dict, mscale: float = 0.0):
    """torchtitan's attention config of an attention kind (see the module docstring for the choices);
    `rope(dim)` is the RoPE config over `dim` of each head; `mscale` YaRN's mscale_all_dim (MLA's softmax scale)."""
    from torchtitan.models.common import RMSNorm
    from torchtitan.models.common.config_utils import make_gqa_config

    if isinstance(attention, blocks.GroupedQueryAttention):
        config = make_gqa_config(
            dim=dim, n_heads=attention.num_heads, n_kv_heads=attention.num_kv_heads, head_dim=attention.head_dim,
            wqkv_param_init=linear, wo_param_init=depth, inner_attention=_document_attention_class().Config(),
            rope=rope(attention.head_dim), fuse_qkv=False,
            qk_norm=RMSNorm.Config(normalized_shape=attention.head_dim, eps=eps, param_init=norm)
            if attention.qk_norm else None)
        if attention.qkv_bias:
            config.qkv_linear.wq.bias = True
            config.qkv_linear.wkv.bias = True
        return config
    if isinstance(attention, blocks.LatentAttention):
        return _latent_attention_config(attention, dim=dim, eps=eps, rope=rope, linear=linear, depth=depth, norm=norm,
                                        mscale=mscale)
    raise TrainerError(f"no torchtitan builder for the attention kind {type(attention).__name__}; "
                       "add one to hpcrl/trainer/titan.py _attention_config")


def _latent_attention_config(mla: blocks.LatentAttention, *, dim: int, eps: float, rope: Callable[..., Any],
                             linear: dict, depth: dict, norm: dict, mscale: float):
    """torchtitan's DeepSeek-V3 multi-head latent attention (its `Attention`, the one MLA torchtitan has).
    RoPE over the qk_rope_head_dim part is interleaved (adjacent pairs, torchtitan's ComplexRoPE), as
    transformers' DeepSeek-V3 (rope_interleave) and vLLM's (is_neox_style=False) rotate it."""
    from torchtitan.models.common import Linear, RMSNorm

    def linear_config(inp: int, out: int, init: dict):
        return Linear.Config(in_features=inp, out_features=out, bias=False, param_init=init)

    heads, qk = mla.num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim
    query = ({"wq": linear_config(dim, heads * qk, linear)} if not mla.q_lora_rank else
             {"wq_a": linear_config(dim, mla.q_lora_rank, linear), "wq_b": linear_config(mla.q_lora_rank, heads * qk, linear)})
    return _titan_class("torchtitan.models.deepseek_v3.model.Attention").Config(
        n_heads=heads, dim=dim, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
        qk_nope_head_dim=mla.qk_nope_head_dim, qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
        wkv_a=linear_config(dim, mla.kv_lora_rank + mla.qk_rope_head_dim, linear),
        wkv_b=linear_config(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), linear),
        wo=linear_config(heads * mla.v_head_dim, dim, depth),
        q_norm=RMSNorm.Config(normalized_shape=max(mla.q_lora_rank, 1), eps=eps, param_init=norm),
        kv_norm=RMSNorm.Config(normalized_shape=mla.kv_lora_rank, eps=eps, param_init=norm),
        rope=rope(mla.qk_rope_head_dim, interleaved=True), inner_attention=_document_attention_class().Config(),
        mscale=mscale, **query)


def _titan_class(path: str):
    """The torchtitan class at dotted `path` (a model family names its classes so; hpcrl.models)."""
    module, _, name = path.rpartition(".")
    supply_missing_torch_names()
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise TrainerError(f"the model family names torchtitan class {path!r}, which this torchtitan "
                           f"lacks ({err}); fix the family's `titan` paths under hpcrl/models/") from None


def _rope_config(dim: int, *, theta: float, max_seq_len: int, scaling: RopeScaling | YarnRopeScaling | None,
                 interleaved: bool = False):
    """torchtitan's rotate-half RoPE config over `dim` of each head (Llama 3 scaled when `scaling`), or with
    `interleaved` its RoPE over adjacent pairs (MLA's; YaRN scaled when `scaling`)."""
    from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE

    if scaling is not None and isinstance(scaling, YarnRopeScaling) != interleaved:
        kind = "YaRN" if isinstance(scaling, YarnRopeScaling) else "Llama 3"
        raise TrainerError(f"{kind} RoPE scaling is not built for this model's attention (YaRN for multi-head latent "
                           "attention only, Llama 3 for rotate-half RoPE only); use a checkpoint without rope_scaling")
    if interleaved:
        if scaling is None:
            return ComplexRoPE.Config(dim=dim, max_seq_len=max_seq_len, theta=theta)
        assert isinstance(scaling, YarnRopeScaling)
        return ComplexRoPE.Config(dim=dim, max_seq_len=max_seq_len, theta=theta, scaling="yarn",
                                  rope_factor=scaling.factor, beta_fast=scaling.beta_fast, beta_slow=scaling.beta_slow,
                                  original_seq_len=scaling.original_max_position_embeddings, truncate=scaling.truncate)
    assert not isinstance(scaling, YarnRopeScaling)
    if scaling is None:
        return CosSinRoPE.Config(dim=dim, max_seq_len=max_seq_len, theta=theta)
    return _scaled_rope_class().Config(
        dim=dim, max_seq_len=max_seq_len, theta=theta, scaling="llama",
        scaling_factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
        high_freq_factor=scaling.high_freq_factor,
        original_max_position_embeddings=scaling.original_max_position_embeddings)


def _inits(shape: ModelShape):
    std = 0.02
    linear = {"weight": partial(nn.init.normal_, std=std), "bias": nn.init.zeros_}
    depth = {"weight": partial(nn.init.normal_, std=std / (2 * shape.num_layers) ** 0.5),
             "bias": nn.init.zeros_}
    return linear, depth, {"weight": nn.init.ones_}


def model_config(shape: ModelShape, *, max_seq_len: int, rope_scaling: RopeScaling | YarnRopeScaling | None = None):
    """The torchtitan `Decoder.Config` for `shape` (see the module docstring for the choices)."""
    supply_missing_torch_names()
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.param_init import skip_param_init
    family = shape.family
    model_cls, block_cls = _titan_class(family.titan.model), _titan_class(family.titan.block)

    linear, depth, norm = _inits(shape)
    dim, eps = shape.hidden_size, shape.rms_norm_eps
    layers = []
    for block in family.blocks(shape):
        attention = _attention_config(block.attention, dim=dim, eps=eps, linear=linear, depth=depth, norm=norm,
                                      rope=partial(_rope_config, theta=shape.rope_theta, max_seq_len=max_seq_len,
                                                   scaling=rope_scaling),
                                      mscale=rope_scaling.mscale_all_dim if isinstance(rope_scaling, YarnRopeScaling)
                                      else 0.0)
        layers.append(block_cls.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=norm),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=norm),
            attention=attention, **_mlp_config(block.mlp, dim=dim, linear=linear, depth=depth)))
    return model_cls.Config(
        dim=dim, vocab_size=shape.vocab_size, enable_weight_tying=shape.tie_embeddings,
        tok_embeddings=Embedding.Config(
            num_embeddings=shape.vocab_size, embedding_dim=dim,
            param_init={"weight": skip_param_init} if shape.tie_embeddings else linear),
        norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=norm),
        lm_head=Linear.Config(in_features=dim, out_features=shape.vocab_size, param_init=linear),
        layers=layers)


class _Decoder(Protocol):
    """What this module calls on a torchtitan decoder beyond nn.Module (torchtitan ships no types)."""

    layers: nn.ModuleDict
    """The transformer blocks, named "0", "1", ..."""

    def init_states(self, *, buffer_device: torch.device | None = None) -> None: ...


def build_model(shape: ModelShape, *, max_seq_len: int, rope_scaling: RopeScaling | YarnRopeScaling | None = None,
                device: str | torch.device = "meta") -> nn.Module:
    """The torchtitan model of `shape`, with parameters on `device` (meta: no memory, fill later)."""
    config = model_config(shape, max_seq_len=max_seq_len, rope_scaling=rope_scaling)
    with torch.device(device):
        return config.build()


def init_states(model: nn.Module, *, device: torch.device) -> None:
    """Random parameters (torchtitan's per-module inits) and RoPE caches, after `to_empty`."""
    with torch.no_grad():
        cast(_Decoder, model).init_states(buffer_device=device)


def set_trainable(model: nn.Module, trainable: bool) -> None:
    """requires_grad on every parameter, or none; a router bias never takes one (`_biased_moe_class`)."""
    model.requires_grad_(trainable)
    for module in model.modules():
        if isinstance(module, _biased_moe_class()):
            module.expert_bias_E.requires_grad_(False)


def router_biases(model: nn.Module) -> dict[int, nn.Parameter]:
    """{block index: its router's bias} for every block whose router has one (`_biased_moe_class`)."""
    return {int(clean_name(name).split(".")[1]): module.expert_bias_E for name, module in model.named_modules()
            if isinstance(module, _biased_moe_class())}


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every transformer block in backward (torch's checkpoint wrapper, as torchtitan's full AC)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = cast(_Decoder, model).layers
    for name, block in list(layers.named_children()):
        layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))


def hidden_states(model: nn.Module, tokens: torch.Tensor, *, positions: torch.Tensor | None = None,
                  documents: Documents | None = None) -> torch.Tensor:
    """The decoder's output before the lm_head (after the final norm), [b, T, D] in the compute dtype.

    A packed row (hpcrl.trainer.batch.pack) passes each token's position in its rollout (RoPE) and the
    rollouts' `documents`, within which the attention stays. torchtitan's decoder skips its lm_head when
    `_skip_lm_head` is set (its chunked loss uses it); the attribute is set for this call only, so
    `model(tokens)` still gives logits elsewhere.
    """
    model._skip_lm_head = True  # type: ignore[assignment]
    try:
        if documents is None and positions is None:
            return model(tokens)
        return model(tokens, positions, documents)
    finally:
        del model._skip_lm_head  # back to the class default (False)


def output_weight(model: nn.Module) -> torch.Tensor:
    """The lm_head weight [V, D] as the current forward sees it (FSDP: the gathered parameter
    after the root's forward, which keeps it gathered for the backward)."""
    head = cast(nn.Linear, model.lm_head)
    if head.bias is not None:
        raise TrainerError("the lm_head has a bias, which the engine's fused logprob does not add; "
                           "build the model without one (hpcrl/trainer/titan.py model_config)")
    return head.weight


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder's blocks in order (each becomes one FSDP unit)."""
    return list(cast(_Decoder, model).layers.values())


def moe_routers(model: nn.Module) -> dict[int, nn.Module]:
    """{block index: its router} for every MoE block (none for a dense model).

    torchtitan's `TokenChoiceTopKRouter.forward` returns (top-k scores [B, L, K], top-k expert ids
    [B, L, K], softmax scores of every expert [B, L, E], float32): a forward hook on it sees the
    block's routing without touching the forward (hpcrl.trainer.routing)."""
    supply_missing_torch_names()
    from torchtitan.models.common.moe import TokenChoiceTopKRouter

    routers = {}
    for name, module in model.named_modules():
        if isinstance(module, TokenChoiceTopKRouter):
            match = re.match(r"layers\.(\d+)\.", clean_name(name))
            if match is None:
                raise TrainerError(f"router {name!r} is not inside a block 'layers.N.'; "
                                   "hpcrl/trainer/titan.py moe_routers expects torchtitan's decoder layout")
            routers[int(match.group(1))] = module
    return routers


def _hf_templates(shape: ModelShape, config) -> dict[str, str | None]:
    """HF name template -> torchtitan name template: the family's state-dict adapter's, and its extras."""
    titan = shape.family.titan
    templates = dict(_titan_class(titan.state_dict_adapter)(config, None).from_hf_map)
    templates.update(titan.extra_names)
    return templates


def hf_expert_slots(shape: ModelShape) -> dict[str, tuple[str, int]]:
    """Every HF expert tensor of `shape` -> (torchtitan 3-D stack name, expert index along its dim 0)."""
    slots = {}
    for template, stack in shape.family.titan.expert_stacks.items():
        pattern = re.compile(re.escape(template).replace(r"\{\}", r"(\d+)") + "$")
        for hf_name, _ in shape.hf_parameters():
            match = pattern.match(hf_name)
            if match:
                slots[hf_name] = (stack.format(match.group(1)), int(match.group(2)))
    return slots


def expert_stack_name(hf_expert_name: str) -> tuple[str, int] | None:
    """(HF-style name of the 3-D stack, expert index) of a per-expert HF name, else None.

    The stack is named as HF names the expert tensor, without the expert index
    ("model.layers.0.mlp.experts.3.gate_proj.weight" -> "model.layers.0.mlp.experts.gate_proj.weight",
    3): the trainer's name for torchtitan's w1_EFD / w3_EFD / w2_EDF, and the weight transfer's
    (hpcrl/plan: a stack viewed 2-D, (E * rows, columns), FSDP chunks whole experts)."""
    match = _EXPERT.match(hf_expert_name)
    return (match.group(1) + match.group(3), int(match.group(2))) if match else None


_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)\.(.*)$")


def hf_to_titan_names(shape: ModelShape, *, max_seq_len: int = 16) -> dict[str, str]:
    """Every HF parameter name of `shape` -> the torchtitan parameter name holding the same tensor.

    A MoE layer's experts are not tensors of their own in torchtitan: each projection's experts
    are one 3-D stack, named here as its experts without the index (`expert_stack_name`), in the
    place of its first expert; hpcrl.trainer.weights reads and writes expert e at dim-0 index e."""
    slots = hf_expert_slots(shape)
    templates = _hf_templates(shape, model_config(shape, max_seq_len=max_seq_len))
    names = {}
    for hf_name, _ in shape.hf_parameters():
        if hf_name in slots:
            stack = expert_stack_name(hf_name)
            if stack is None:
                raise TrainerError(f"{shape.architecture}: expert tensor {hf_name!r} has no '.experts.N.' "
                                   "in its name; fix the family's expert_stacks (hpcrl/models/)")
            names[stack[0]] = slots[hf_name][0]
            continue
        layer = re.search(r"\d+", hf_name)
        template = re.sub(r"\d+", "{}", hf_name, count=1) if layer else hf_name
        titan = templates.get(template)
        if titan is None:
            raise TrainerError(f"no torchtitan parameter for HF parameter {hf_name!r} "
                               f"({shape.architecture}); the adapter map lacks {template!r}")
        names[hf_name] = titan.format(layer.group(0)) if layer else titan
    return names


def clean_name(fqn: str) -> str:
    """A parameter name without wrapper prefixes (activation checkpointing, torch.compile)."""
    return fqn.replace(_AC_PREFIX, "").replace("_orig_mod.", "")
