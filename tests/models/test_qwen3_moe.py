"""The Qwen3-MoE family: config.json both ways, HF and vLLM parameters, memory terms, and torchtitan's
model giving transformers' logits from the same checkpoint."""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from hpcrl.config.model_shapes import PRESETS, from_hf_config
from hpcrl.models import ModelShape
from hpcrl.models.shape import numel

#: Qwen/Qwen3-30B-A3B's config.json as published (the keys hpcrl reads; "num_experts" as Qwen spells it).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "attention_bias": False,
}

#: Three blocks, the middle one dense (mlp_only_layers), experts not renormalised: every branch.
MIXED = replace(PRESETS["tiny-qwen3-moe"], num_layers=3, mlp_only_layers=(1,), norm_topk_prob=False)


def test_a_published_qwen3_moe_config_json_reads_as_the_preset_and_back():
    shape = from_hf_config(QWEN3_30B_A3B)
    assert shape == PRESETS["qwen3-30b-a3b"]
    assert from_hf_config(shape.to_hf_config()) == shape
    # transformers 5 saves the expert count as num_local_experts (its attribute_map).
    saved = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert from_hf_config(saved).num_experts == 128


def test_transformers_reads_the_config_json_the_family_writes():
    transformers = pytest.importorskip("transformers")
    hf = MIXED.to_hf_config()
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 32)
    assert (config.mlp_only_layers, config.norm_topk_prob) == ([1], False)


def test_qwen3_moe_presets_have_the_published_parameter_counts():
    assert round(PRESETS["qwen3-30b-a3b"].num_parameters / 1e9, 2) == 30.53
    assert round(PRESETS["qwen3-235b-a22b"].num_parameters / 1e9, 2) == 235.09


@pytest.mark.parametrize("preset, non_embedding, active", [("qwen3-30b-a3b", 29.9, 3.3),
                                                           ("qwen3-235b-a22b", 234, 22)])
def test_qwen3_moe_presets_have_the_model_cards_non_embedding_and_activated_counts(preset, non_embedding, active):
    """Qwen's model cards: 30.5B total, 29.9B non-embedding, 3.3B activated; 235B, 234B, 22B (here
    29.91, 3.35; 233.85, 22.19). The
    activated count (every tensor but the experts, plus k of E experts per block) pins the expert
    width and top-k; the non-embedding one the attention and vocabulary."""
    shape = PRESETS[preset]
    params = dict(shape.hf_parameters())
    experts = sum(numel(size) for name, size in params.items() if ".mlp.experts." in name)
    embeddings = numel(params["model.embed_tokens.weight"]) + numel(params["lm_head.weight"])
    activated = shape.num_parameters - experts + experts * shape.num_experts_per_tok // shape.num_experts
    # to the cards' last digit (they round 233.85 up to 234 and 3.35 down to 3.3)
    assert (shape.num_parameters - embeddings) / 1e9 == pytest.approx(non_embedding, abs=0.06 if non_embedding < 100 else 0.6)
    assert activated / 1e9 == pytest.approx(active, abs=0.06 if active < 10 else 0.6)


def test_moe_layers_list_a_router_and_every_expert_and_dense_layers_a_plain_mlp():
    params = dict(MIXED.hf_parameters())
    assert params["model.layers.0.mlp.gate.weight"] == (8, 64)
    assert params["model.layers.2.mlp.experts.7.gate_proj.weight"] == (32, 64)
    assert params["model.layers.2.mlp.experts.7.down_proj.weight"] == (64, 32)
    assert params["model.layers.1.mlp.gate_proj.weight"] == (128, 64)  # mlp_only_layers: dense
    assert "model.layers.0.mlp.gate_proj.weight" not in params and "model.layers.1.mlp.gate.weight" not in params
    attention = 2 * 64 + 2 * 32 + (128 + 2 * 64 + 128) * 64
    assert MIXED.layer_parameters == attention + 8 * 64 + 8 * 3 * 32 * 64  # the largest block: a MoE one


def test_vllm_parameters_are_the_router_and_fused_w13_and_w2_per_moe_layer():
    params = {p.name: p for p in MIXED.family.vllm_parameters(MIXED)}
    w13 = params["model.layers.0.mlp.experts.routed_experts.w13_weight"]
    assert w13.layer == "moe_w13" and len(w13.hf) == 16
    assert w13.hf[:3] == ("model.layers.0.mlp.experts.0.gate_proj.weight",
                          "model.layers.0.mlp.experts.0.up_proj.weight",
                          "model.layers.0.mlp.experts.1.gate_proj.weight")
    w2 = params["model.layers.2.mlp.experts.routed_experts.w2_weight"]
    assert w2.layer == "moe_w2" and w2.hf[-1] == "model.layers.2.mlp.experts.7.down_proj.weight"
    assert params["model.layers.0.mlp.gate.weight"].layer == "replicated"
    assert params["model.layers.1.mlp.gate_up_proj.weight"].layer == "merged_column"
    # Every HF tensor is read by exactly one vLLM parameter.
    read = [name for p in params.values() for name in p.hf]
    assert sorted(read) == sorted(name for name, _ in MIXED.hf_parameters())


def test_moe_activation_memory_counts_each_token_once_per_routed_expert():
    shape = PRESETS["qwen3-30b-a3b"]
    h, kv = 2048, 4 * 128
    assert shape.family.activation_values_per_token(shape) == 7 * h + 2 * kv + 8 * (2 * h + 4 * 768) + 2 * 128
    top2 = replace(shape, num_experts_per_tok=2)
    assert top2.family.activation_values_per_token(top2) < shape.family.activation_values_per_token(shape)


def test_the_trainer_names_each_expert_stack_as_its_experts_without_the_index():
    pytest.importorskip("torchtitan")
    from hpcrl.trainer import titan

    names = titan.hf_to_titan_names(MIXED)
    assert names["model.layers.2.mlp.experts.down_proj.weight"] == "layers.2.moe.routed_experts.inner_experts.w2_EDF"
    assert names["model.layers.1.mlp.down_proj.weight"] == "layers.1.feed_forward.w2.weight"
    assert not any(".experts.0." in name for name in names)
    assert titan.expert_stack_name("model.layers.0.mlp.experts.11.up_proj.weight") == (
        "model.layers.0.mlp.experts.up_proj.weight", 11)


def test_torchtitan_builds_qwen3_moe_with_every_hf_tensor_in_a_parameter():
    pytest.importorskip("torchtitan")
    from hpcrl.trainer import titan

    model = titan.build_model(MIXED, max_seq_len=32, device="meta")
    params = {titan.clean_name(n): tuple(p.shape) for n, p in model.named_parameters()}
    names = titan.hf_to_titan_names(MIXED)
    slots = titan.hf_expert_slots(MIXED)
    assert slots["model.layers.2.mlp.experts.5.up_proj.weight"] == (
        "layers.2.moe.routed_experts.inner_experts.w3_EFD", 5)
    assert params["layers.0.moe.routed_experts.inner_experts.w1_EFD"] == (8, 32, 64)
    assert params["layers.0.moe.routed_experts.inner_experts.w2_EDF"] == (8, 64, 32)
    assert sorted(params) == sorted(names.values())


def _save_hf_checkpoint(shape: ModelShape, out: Path) -> None:
    """A random transformers Qwen3MoeForCausalLM of `shape`, saved as a checkpoint (per-expert names)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = shape.to_hf_config()
    torch.manual_seed(0)
    config = AutoConfig.for_model(hf.pop("model_type"), **hf, initializer_range=0.5)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", [PRESETS["tiny-qwen3-moe"], MIXED], ids=["tiny", "mixed"])
def test_torchtitan_qwen3_moe_gives_transformers_logits_from_the_same_checkpoint(shape: ModelShape, tmp_path: Path):
    pytest.importorskip("torchtitan")
    import torch
    from transformers import AutoModelForCausalLM

    from hpcrl.trainer import titan
    from hpcrl.trainer.weights import load_hf_weights

    _save_hf_checkpoint(shape, tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model = titan.build_model(shape, max_seq_len=64, device="meta")
    model.to_empty(device="cpu")
    titan.init_states(model, device=torch.device("cpu"))
    load_hf_weights(model, titan.hf_to_titan_names(shape), tmp_path)  # the trainer's loader: every parameter
    tokens = torch.randint(0, shape.vocab_size, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="In CPU autocast")  # torchtitan's fp32 router autocast
        ours, theirs = model.eval()(tokens), reference(tokens).logits
    assert theirs.abs().max() > 1.0  # large enough weights that a wrong route or expert shows
    assert (ours - theirs).abs().max() < 1e-5


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fsdp2_shards_whole_experts_and_keeps_the_logits_and_gradients(tmp_path: Path):
    pytest.importorskip("torchtitan")
    import time

    import forked
    import torch
    from moe_fsdp_worker import fsdp_rank

    from hpcrl.trainer import titan
    from hpcrl.trainer.weights import load_hf_weights

    shape = PRESETS["tiny-qwen3-moe"]
    _save_hf_checkpoint(shape, tmp_path)
    tokens = torch.randint(0, shape.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    model = titan.build_model(shape, max_seq_len=64, device="meta")
    model.to_empty(device="cpu")
    titan.init_states(model, device=torch.device("cpu"))
    load_hf_weights(model, titan.hf_to_titan_names(shape), tmp_path)
    state = {titan.clean_name(n): p.detach().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="In CPU autocast")
        logits = model(tokens)
        logits.float().square().mean().backward()
    w1 = dict(model.named_parameters())["layers.0.moe.routed_experts.inner_experts.w1_EFD"]

    ranks = 3  # 8 experts over 3 ranks: 3, 3 and 2 whole experts (torch.chunk on dim 0)
    context = forked.start_ranks(fsdp_rank, args=(ranks, str(tmp_path / "store"), str(tmp_path), shape, state, tokens),
                                 nprocs=ranks)
    deadline = time.monotonic() + 150
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            assert time.monotonic() < deadline, "the FSDP ranks did not finish in 150 s"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(ranks)]
    assert [r["w1_local"].shape[0] for r in results] == [3, 3, 2]
    assert torch.equal(torch.cat([r["w1_local"] for r in results]), w1.detach())
    assert w1.grad.abs().max() > 1e-4
    # The weight transfer's view of the down_proj stack: each rank's whole experts as contiguous rows.
    down = dict(model.named_parameters())["layers.0.moe.routed_experts.inner_experts.w2_EDF"].detach()
    assert [r["down"][1:] for r in results] == [((8 * 64, 32), 0), ((8 * 64, 32), 3 * 64), ((8 * 64, 32), 6 * 64)]
    assert torch.equal(torch.cat([r["down"][0] for r in results]), down.reshape(8 * 64, 32))
    for result in results:
        assert (result["logits"] - logits).abs().max() < 1e-5
        # Every rank ran the same tokens, and hpcrl's FSDP sums gradients over ranks (parallel.shard_decoder).
        assert (result["w1_grad"] - ranks * w1.grad).abs().max() < 1e-6


@pytest.mark.timeout(120)
def test_the_trainer_engine_loads_trains_and_exports_qwen3_moe_by_hf_names(tmp_path: Path):
    pytest.importorskip("torchtitan")
    import torch
    from engine_case import small_engine, two_rows
    from safetensors.torch import load_file

    _save_hf_checkpoint(MIXED, tmp_path)
    checkpoint = load_file(tmp_path / "model.safetensors")
    engine = small_engine(MIXED, tmp_path)
    exported = engine.full_state_dict_hf()
    assert set(exported) == set(checkpoint)
    assert all(torch.equal(exported[name], checkpoint[name]) for name in checkpoint)
    shard = engine.local_shards()["model.layers.0.mlp.experts.down_proj.weight"]
    assert (shard.global_shape, shard.dim0_offset, tuple(shard.tensor.shape)) == ((8 * 64, 32), 0, (8 * 64, 32))
    assert torch.equal(shard.tensor[64:128], checkpoint["model.layers.0.mlp.experts.1.down_proj.weight"])

    batch = two_rows()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="In CPU autocast")
        engine.train_step(batch)
    trained = engine.full_state_dict_hf()
    changed = {name for name in checkpoint if not torch.equal(trained[name], checkpoint[name])}
    assert "model.layers.0.mlp.gate.weight" in changed  # the router learns
    assert any(".mlp.experts." in name for name in changed)  # and the experts tokens went to


def test_a_moe_family_says_which_blocks_route_and_with_which_router_and_the_rest_sees_only_experts():
    from hpcrl.models.blocks import DenseMLP, GroupedQueryAttention, RoutedExperts, SoftmaxTopK

    blocks = MIXED.family.blocks(MIXED)
    assert [type(b.mlp) for b in blocks] == [RoutedExperts, DenseMLP, RoutedExperts]  # mlp_only_layers=(1,)
    assert blocks[0].mlp == RoutedExperts(num_experts=8, top_k=2, hidden_dim=32, router=SoftmaxTopK(renormalize=False))
    assert blocks[1].mlp == DenseMLP(hidden_dim=128)
    assert blocks[0].attention == GroupedQueryAttention(num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True)
    experts = MIXED.experts()
    assert experts is not None and (experts.layers, experts.num_experts, experts.top_k) == ((0, 2), 8, 2)
    assert experts.parameters == sum(numel(s) for n, s in MIXED.hf_parameters() if ".mlp.experts." in n)
    assert replace(MIXED, mlp_only_layers=(0, 1, 2)).experts() is None  # no block routes: a dense model


@pytest.mark.parametrize(("tp", "kv_heads_per_rank"), [(1, 2), (2, 1), (4, 1)])
def test_kv_bytes_per_token_are_what_each_blocks_attention_keeps_on_one_rank(tp, kv_heads_per_rank):
    shape = PRESETS["tiny-qwen3-moe"]
    # K and V, per block, of the KV heads on one rank (replicated past TP), head_dim 32, 2 bytes each
    assert shape.family.kv_bytes_per_token(shape, 2, tp) == 2 * 2 * kv_heads_per_rank * 32 * 2
