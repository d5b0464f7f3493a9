"""Packed micro-batches (issue 39): the same loss, gradients and logprobs as right-padded rows, for every algorithm."""

from __future__ import annotations

import pytest
import torch
from trainer_workers import engine_options, run_ranks, skewed_train_batch, step_gradients

from hpcrl.algorithms import ALGORITHMS, load_algorithm
from hpcrl.trainer import TrainerEngine
from hpcrl.trainer.batch import pack, pad_masked_rows


def options_for(name: str):
    algorithm = load_algorithm(name)
    return algorithm.options(**{**algorithm.defaults, "name": name, "kl_coef": 0.1, "max_tokens": 32})


def relative_gap(got: dict, want: dict) -> float:
    """The largest |got - want| / |want| over the parameters (norms)."""
    assert got.keys() == want.keys() and got
    return max(float((got[n] - want[n]).norm() / want[n].norm()) for n in want)


def test_pack_lays_rows_end_to_end_with_positions_restarting_and_unpacks_to_the_padded_layout():
    batch = pad_masked_rows([[1, 5, 6, 7], [1, 8, 9], [1, 4]], [[0, 1, 1, 1], [0, 0, 1], [0, 0]],
                            [[0.0, -1.0, -2.0, -3.0], [0.0, 0.0, -4.0], [0.0, 0.0]], [1.0, 2.0, 3.0])
    packing = pack(batch)
    assert packing.tokens.tolist() == [[1, 5, 6, 7, 1, 8, 9]]          # row 2 has no policy token: left out
    assert packing.positions.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert packing.bounds == (0, 4, 7)
    # position i predicts token i + 1 of its row; the last of a row predicts nothing that is read
    outputs = torch.arange(10.0, 17.0).view(1, 7)
    assert packing.unpack(outputs).tolist() == [[0.0, 10.0, 11.0, 12.0], [0.0, 14.0, 15.0, 0.0], [0.0] * 4]
    idle = pack(batch.take([2]))
    assert idle.tokens.shape == (1, 2) and not idle.valid.any() and idle.unpack(torch.ones(1, 2)).eq(0).all()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_packed_gradients_and_loss_equal_the_padded_ones_for_every_algorithm(tiny_model, name: str):
    batch = skewed_train_batch(per_token=name == "reinforce_pp").rows()
    results = []
    for tokens in (0, 48):  # padded rows of 4; packed micro-batches of at most 48 tokens
        engine = TrainerEngine(engine_options(str(tiny_model), micro_batch_size=4, micro_batch_tokens=tokens,
                                              loss=options_for(name)))
        grads = step_gradients(engine)
        results.append((engine.train_step(batch), grads))
    (padded, padded_grads), (packed, packed_grads) = results
    assert relative_gap(packed_grads, padded_grads) < 1e-6
    # a loss is a sum of terms of both signs (~0.1 each here): its rounding is the terms', not the sum's
    for key in ("loss", "policy_loss", "kl", "entropy", "sampling_logprob_diff", "grad_norm"):
        assert getattr(packed, key) == pytest.approx(getattr(padded, key), rel=1e-6, abs=1e-7), key
    assert (packed.completion_tokens, packed.sequences) == (padded.completion_tokens, padded.sequences)


@pytest.mark.timeout(120)
def test_packed_logprobs_for_the_mismatch_probe_equal_the_padded_ones(tiny_model):
    train = skewed_train_batch()
    batch = train.rows()
    padded = TrainerEngine(engine_options(str(tiny_model), micro_batch_size=4))
    packed = TrainerEngine(engine_options(str(tiny_model), micro_batch_tokens=48))
    mask = batch.completion_mask
    torch.testing.assert_close(packed.logprobs(batch)[mask], padded.logprobs(batch)[mask], rtol=0, atol=1e-6)
    for got, want in zip(packed.sequence_logprobs(train.input_ids), padded.sequence_logprobs(train.input_ids),
                         strict=True):
        assert len(got) == len(want) and max((abs(a - b) for a, b in zip(got, want)), default=0.0) < 1e-6


@pytest.mark.timeout(60)
def test_a_packed_rollouts_logprobs_do_not_see_the_rollout_before_it(tiny_model):
    engine = TrainerEngine(engine_options(str(tiny_model), micro_batch_tokens=64))
    rows = [[1, 10, 11, 12, 13, 14], [1, 20, 21, 22, 23]]
    batch = pad_masked_rows(rows, [[0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], [[0.0] * 6, [0.0] * 5], [0.0, 0.0])
    changed = pad_masked_rows([[1, 30, 31, 32, 33, 34], rows[1]], [[0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1]],
                              [[0.0] * 6, [0.0] * 5], [0.0, 0.0])
    before, after = engine.logprobs(batch), engine.logprobs(changed)
    assert (before[0] - after[0]).abs().max() > 0.01                  # the first rollout did change
    assert (before[1] - after[1]).abs().max() < 1e-6                  # the second, packed after it, did not


@pytest.mark.timeout(200)
def test_token_budget_shares_on_two_gloo_ranks_give_the_whole_batchs_unpacked_gradient(tiny_model, tmp_path):
    whole = TrainerEngine(engine_options(str(tiny_model), micro_batch_size=12))
    want_grads = step_gradients(whole)
    want = whole.train_step(skewed_train_batch().rows())
    ranks = run_ranks(2, tmp_path, str(tiny_model), shares=True, micro_batch_tokens=48)
    for rank in ranks:
        assert relative_gap(rank["grads"], want_grads) < 1e-6
        assert rank["metrics"]["loss"] == pytest.approx(want.loss, rel=1e-6)
        assert rank["metrics"]["grad_norm"] == pytest.approx(want.grad_norm, rel=1e-6)
    # each rank's own CPU time in the step, summed into every rank's metrics (the balance figure of a run)
    busy = {(r["metrics"]["time_rank_busy_min_s"], r["metrics"]["time_rank_busy_max_s"]) for r in ranks}
    assert len(busy) == 1 and 0 < min(busy)[0] <= min(busy)[1], busy
