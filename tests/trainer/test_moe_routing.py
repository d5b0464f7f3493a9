"""Mixture-of-Experts routing in the trainer: the load-balancing loss (its value, its gradient, off by
default), and the trainer's top-k experts that the routing mismatch compares with vLLM's."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hpcrl.algorithms.base import Options
from hpcrl.config.model_shapes import PRESETS
from hpcrl.errors import TrainerError
from hpcrl.trainer import routing
from hpcrl.trainer.batch import pad_rows

pytest.importorskip("torchtitan")

REPO = Path(__file__).resolve().parents[2]

#: Three blocks, the middle one dense: routing is reported for blocks 0 and 2 only.
MIXED = replace(PRESETS["tiny-qwen3-moe"], num_layers=3, mlp_only_layers=(1,))

# Two real tokens and one of padding (E = 4, k = 2), worked by hand:
#   f = chosen share of the two tokens = (1, 1/2, 1/2, 0); P = mean probability = (.375, .175, .35, .1)
#   E x sum f P = 4 x (.375 + .0875 + .175) = 2.55
SCORES = torch.tensor([[[0.4, 0.3, 0.2, 0.1], [0.35, 0.05, 0.5, 0.1], [0.7, 0.1, 0.1, 0.1]]])
CHOSEN = torch.tensor([[[0, 1], [2, 0], [0, 1]]])
VALID = torch.tensor([[True, True, False]])


@contextmanager
def _quiet():
    """torchtitan's router asks for float32 autocast on CPU, which warns on every forward."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="In CPU autocast")
        yield


def _engine(**overrides):
    from hpcrl.trainer import EngineOptions, TrainerEngine

    options = dict(shape=MIXED, max_seq_len=64, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, micro_batch_size=2,
                   grad_clip=1.0, total_steps=10, seed=3, loss=Options(clip_eps_low=0.2, clip_eps_high=0.28))
    options.update(overrides)
    return TrainerEngine(EngineOptions(**options))


def _batch():
    return pad_rows(sequences=[[1, 40, 41, 42, 43, 44], [1, 40, 50, 51], [1, 60, 61, 62, 63]],
                    prompt_lengths=[2, 2, 3], old_logprobs=[[-4.8, -4.9, -5.0, -4.7], [-4.6, -5.1], [-4.5, -4.4]],
                    advantages=[1.0, -1.0, 0.5])


def test_the_load_balancing_loss_of_a_hand_worked_example_leaves_padding_out():
    record = routing.block_record(0, SCORES, CHOSEN, VALID)
    assert record.fraction.tolist() == [1.0, 0.5, 0.5, 0.0]
    assert routing.load_balancing_loss([record]).item() == pytest.approx(2.55, abs=1e-6)
    # transformers' Qwen3-MoE computes the same for one block (it pools blocks, hpcrl averages them)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    theirs = load_balancing_loss_func((SCORES.log()[0],), num_experts=4, top_k=2, attention_mask=VALID.long())
    assert float(theirs) == pytest.approx(2.55, abs=1e-6)
    # a perfectly balanced block gives k = 2, and blocks are averaged
    balanced = routing.block_record(1, torch.full((1, 3, 4), 0.25), torch.tensor([[[0, 1], [2, 3], [0, 1]]]), VALID)
    assert routing.load_balancing_loss([balanced]).item() == pytest.approx(2.0, abs=1e-6)
    assert routing.load_balancing_loss([record, balanced]).item() == pytest.approx((2.55 + 2.0) / 2, abs=1e-6)


def test_valid_tokens_run_to_each_rows_last_completion_token():
    mask = torch.tensor([[False, False, True, True, False], [False, True, False, False, False],
                         [False] * 5])
    assert routing.valid_tokens(mask).tolist() == [[True] * 4 + [False], [True] * 2 + [False] * 3, [False] * 5]


@pytest.mark.timeout(60)
def test_the_load_balancing_loss_sends_its_gradient_to_the_routers_and_not_to_the_experts():
    from hpcrl.trainer import titan

    model = titan.build_model(MIXED, max_seq_len=32, device="meta")
    model.to_empty(device="cpu")
    titan.init_states(model, device=torch.device("cpu"))
    tokens = torch.randint(0, MIXED.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with _quiet(), routing.RouterTap(model) as tap:
        titan.hidden_states(model, tokens)
    assert [r.layer for r in tap.records] == [0, 2]
    routing.load_balancing_loss(tap.records).backward()
    params = dict(model.named_parameters())
    assert params["layers.2.moe.router.gate.weight"].grad.abs().max() > 0
    assert params["layers.0.moe.router.gate.weight"].grad.abs().max() > 0
    assert params["layers.2.moe.routed_experts.inner_experts.w1_EFD"].grad is None


@pytest.mark.timeout(120)
def test_a_zero_coefficient_leaves_the_step_bitwise_as_without_routing_and_a_positive_one_adds_the_loss():
    batch = _batch()
    results = {}
    with _quiet():
        for name, coef, tapped in (("untapped", 0.0, False), ("off", 0.0, True), ("on", 0.5, True)):
            engine = _engine(moe_aux_loss_coef=coef)
            engine.moe = tapped  # False: the step as it was before MoE routing was measured
            metrics = engine.train_step(batch)
            results[name] = (metrics, engine.full_state_dict_hf())
    (untapped, w0), (off, w_off), (on, w_on) = results["untapped"], results["off"], results["on"]
    assert off.loss == untapped.loss and off.grad_norm == untapped.grad_norm
    assert all(torch.equal(w0[n], w_off[n]) for n in w0)
    assert untapped.moe_aux_loss == 0.0 and 2.0 <= off.moe_aux_loss <= 8.0  # between k (balanced) and E
    assert on.moe_aux_loss == off.moe_aux_loss  # measured before the update, from the same weights
    assert on.loss == pytest.approx(off.loss + 0.5 * off.moe_aux_loss, rel=1e-6)
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(w_on[router], w_off[router])


@pytest.mark.timeout(120)
def test_activation_checkpointing_keeps_the_load_balancing_loss_and_its_gradient():
    batch = _batch()
    runs = []
    with _quiet():
        for checkpointing in (False, True):  # the recompute in the backward runs outside the tap
            engine = _engine(moe_aux_loss_coef=5.0, activation_checkpointing=checkpointing)
            runs.append((engine.train_step(batch), engine.full_state_dict_hf()))
    (m1, w1), (m2, w2) = runs
    assert m1.moe_aux_loss == pytest.approx(m2.moe_aux_loss, rel=1e-6)
    assert m1.grad_norm == pytest.approx(m2.grad_norm, rel=1e-5)
    assert max((w1[n] - w2[n]).abs().max().item() for n in w1) < 1e-5


def test_a_coefficient_on_a_dense_model_is_refused_with_the_fix_at_config_check_and_by_the_engine():
    from hpcrl.config import load_config
    from hpcrl.errors import ConfigError
    from hpcrl.trainer import EngineOptions

    with pytest.raises(ConfigError, match="algorithm.moe_aux_loss_coef.*no Mixture-of-Experts block"):
        load_config(REPO / "configs" / "tiny_grpo.toml", overrides=["algorithm.moe_aux_loss_coef=0.01"])
    with pytest.raises(TrainerError, match="moe_aux_loss_coef = 0"):
        EngineOptions(shape=PRESETS["tiny-llama"], moe_aux_loss_coef=0.01)


@pytest.mark.timeout(120)
def test_the_trainers_top_k_per_block_is_what_its_routers_chose_with_minus_one_at_dense_blocks():
    from hpcrl.trainer import titan

    sequences = [[1, 40, 41, 42, 43, 44], [1, 50, 51], [1, 60, 61, 62, 63, 64, 65]]
    with _quiet():
        engine = _engine(micro_batch_size=2)
        routed = engine.routed_experts(sequences)
        for seq, ids in zip(sequences, routed):
            assert tuple(ids.shape) == (len(seq), 3, 2)
            with torch.no_grad(), routing.RouterTap(engine.model, keep_ids=True) as tap:  # alone, no padding
                titan.hidden_states(engine.model, torch.tensor([seq]))
            assert torch.equal(ids, tap.top_k(3)[0])
            assert (ids[:, 1] == -1).all() and (ids[:, 0] >= 0).all() and (ids[:, 2] < 8).all()
    assert routing.routing_mismatch(routed[0], routed[0], moe_layers=[0, 2]) == 0.0


def test_routing_mismatch_counts_tokens_and_blocks_whose_expert_sets_differ():
    trainer = [[[0, 1], [-1, -1], [2, 3]], [[4, 5], [-1, -1], [6, 7]], [[1, 2], [-1, -1], [3, 4]]]
    inference = [[[1, 0], [0, 0], [2, 3]],  # the same sets in another order, and a dense block's stale row
                 [[4, 6], [0, 0], [6, 7]]]  # one block differs; vLLM's routing ends one token early
    assert routing.routing_mismatch(trainer, inference, moe_layers=[0, 2]) == 1 / 4
    numpy = pytest.importorskip("numpy")  # vLLM's routed_experts is a numpy array, the trainer's a tensor
    assert routing.routing_mismatch(torch.tensor(trainer), numpy.array(inference), moe_layers=[0, 2]) == 1 / 4
    assert routing.routing_mismatch(trainer, [], moe_layers=[0, 2]) == 0.0


def test_the_tiny_moe_config_gives_the_engine_gspo_and_the_load_balancing_coefficient():
    from hpcrl.config import load_config
    from hpcrl.trainer import EngineOptions

    config = load_config(REPO / "configs" / "tiny_moe_grpo.toml", overrides=["algorithm.moe_aux_loss_coef=0.01"])
    options = EngineOptions.from_config(config, weights_path="")  # the shapes of the preset, no checkpoint
    assert options.shape == PRESETS["tiny-qwen3-moe"]
    assert (options.loss.name, options.moe_aux_loss_coef) == ("gspo", 0.01)
    assert load_config(REPO / "configs" / "tiny_moe_grpo.toml").algorithm.moe_aux_loss_coef == 0.0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_fsdp_ranks_take_the_one_process_step_with_the_load_balancing_loss(tmp_path: Path):
    """The routers' hooks on FSDP2-wrapped blocks, the token weights over ranks and the idle
    micro-batch of the rank with fewer rows: the same step and moe_aux_loss as one process."""
    from trainer_workers import engine_options, run_ranks, toy_batch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpcrl.trainer import TrainerEngine

    hf = MIXED.to_hf_config()
    torch.manual_seed(0)
    config = AutoConfig.for_model(hf.pop("model_type"), **hf, initializer_range=0.2)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "model")
    model = str(tmp_path / "model")
    with _quiet():
        engine = TrainerEngine(engine_options(model, moe_aux_loss_coef=0.5))
        metrics = engine.train_step(toy_batch()).as_dict()
        full = engine.full_state_dict_hf()
    ranks = run_ranks(2, tmp_path, model, timeout_s=200, moe_aux_loss_coef=0.5)
    assert 2.0 < metrics["moe_aux_loss"] < 8.0
    for key in ("loss", "moe_aux_loss", "grad_norm"):
        assert ranks[0]["metrics"][key] == pytest.approx(metrics[key], rel=1e-5), key
    for result in ranks:
        assert max((result["full"][n] - full[n]).abs().max().item() for n in full) < 1e-5
