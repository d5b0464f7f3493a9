"""FSDP2 over gloo ranks trains exactly like one process, and exposes HF-named dim-0 shards."""

from __future__ import annotations

import pytest
import torch
from trainer_workers import engine_options, run_ranks, toy_batch

from hpcrl.trainer import TrainerEngine


@pytest.fixture(scope="module")
def one_process_step(tiny_model):
    """Weights, metrics and logprobs of one train step taken in a single process (no FSDP)."""
    engine = TrainerEngine(engine_options(str(tiny_model)))
    batch = toy_batch()
    logprobs = engine.logprobs(batch)
    metrics = engine.train_step(batch)
    return {"full": engine.full_state_dict_hf(), "metrics": metrics.as_dict(), "logprobs": logprobs}


def _max_weight_difference(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[name] - b[name]).abs().max().item() for name in a)


def _assert_same_step(ranks: list[dict], reference: dict, batch_rows: list[range]) -> None:
    for result in ranks:
        assert _max_weight_difference(result["full"], reference["full"]) < 1e-5
    for key in ("loss", "policy_loss", "kl", "entropy", "clip_fraction", "grad_norm"):
        assert ranks[0]["metrics"][key] == pytest.approx(reference["metrics"][key], rel=1e-5, abs=1e-6), key
    for key in ("completion_tokens", "sequences", "lr"):
        assert ranks[0]["metrics"][key] == reference["metrics"][key]
    for result, rows in zip(ranks, batch_rows):
        ours = result["logprobs"]
        theirs = reference["logprobs"][rows.start:rows.stop, :ours.shape[1]]
        mask = toy_batch().completion_mask[rows.start:rows.stop, :ours.shape[1]]
        assert torch.allclose(ours[mask], theirs[mask], rtol=0, atol=1e-5)


def _assert_shards_tile_the_full_weights(ranks: list[dict]) -> None:
    full = ranks[0]["full"]
    for name, tensor in full.items():
        pieces = sorted((r["shards"][name] for r in ranks), key=lambda s: s[2])
        assert all(p[1] == tuple(tensor.shape) for p in pieces), name
        offsets = [p[2] for p in pieces]
        expected = torch.chunk(tensor, len(ranks), dim=0)
        assert offsets[:len(expected)] == [sum(c.shape[0] for c in expected[:i]) for i in range(len(expected))]
        assert torch.equal(torch.cat([p[0] for p in pieces], dim=0), tensor), name


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_one_step_on_two_fsdp_gloo_ranks_gives_the_weights_of_one_process(tiny_model, tmp_path, one_process_step):
    ranks = run_ranks(2, tmp_path, str(tiny_model))
    # toy_batch has 5 rows: rank 0 gets rows 0-2, rank 1 rows 3-4 (and idles one micro-batch).
    _assert_same_step(ranks, one_process_step, [range(0, 3), range(3, 5)])
    _assert_shards_tile_the_full_weights(ranks)
    # The 2 ranks' DCP checkpoint loads in one process (resharded on load).
    resumed = TrainerEngine(engine_options(str(tiny_model)))
    resumed.load_checkpoint(tmp_path / "checkpoint")
    assert resumed.step == 1
    full = resumed.full_state_dict_hf()
    assert all(torch.equal(full[name], ranks[0]["full"][name]) for name in full)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_local_shards_of_three_ranks_concatenate_to_the_full_weights_with_uneven_chunks(
        tiny_model, tmp_path, one_process_step):
    ranks = run_ranks(3, tmp_path, str(tiny_model))
    shards = ranks[2]["shards"]
    # 128 rows over 3 ranks with torch.chunk semantics: 43, 43, 42; k_proj's 64 rows: 22, 22, 20.
    assert shards["model.embed_tokens.weight"][0].shape[0] == 42
    assert shards["model.embed_tokens.weight"][2] == 86
    assert shards["model.layers.0.self_attn.k_proj.weight"][0].shape[0] == 20
    _assert_shards_tile_the_full_weights(ranks)
    _assert_same_step(ranks, one_process_step, [range(0, 2), range(2, 4), range(4, 5)])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hsdp_with_two_replicas_of_two_shards_takes_the_same_step_as_one_process(
        tiny_model, tmp_path, one_process_step):
    ranks = run_ranks(4, tmp_path, str(tiny_model), timeout_s=200, dp_replicate=2)
    _assert_same_step(ranks, one_process_step, [range(0, 2), range(2, 3), range(3, 4), range(4, 5)])
    # Ranks 0-1 shard one replica, ranks 2-3 the other: the same rows at the same offsets.
    _assert_shards_tile_the_full_weights(ranks[:2])
    for name, (tensor, shape, offset) in ranks[0]["shards"].items():
        twin = ranks[2]["shards"][name]
        assert torch.equal(twin[0], tensor) and twin[1:] == (shape, offset)
