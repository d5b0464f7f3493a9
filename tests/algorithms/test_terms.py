"""The shared loss terms against values worked out by hand (hpcrl/algorithms/terms.py)."""

from __future__ import annotations

import math

import pytest
import torch

from hpcrl.algorithms.base import Options
from hpcrl.algorithms.terms import (
    Normaliser,
    aggregate,
    clipped_policy_loss,
    kl_per_token,
    local_counts,
    token_ratio_loss,
)
from hpcrl.errors import HpcrlError

LOG = math.log


def test_ratio_is_clipped_above_for_positive_and_below_for_negative_advantages():
    # old logprob 0 makes the ratio exp(logp): ratios 1.5, 0.5, 1.1 | 0.5, 1.5, 0.9.
    logp = torch.tensor([[LOG(1.5), LOG(0.5), LOG(1.1)], [LOG(0.5), LOG(1.5), LOG(0.9)]],
                        requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    loss, low, high = clipped_policy_loss(logp, torch.zeros(2, 3), adv, clip_eps_low=0.2, clip_eps_high=0.28)
    # A=+2: r=1.5 -> -min(3.0, 1.28*2) = -2.56 (clipped); r=0.5 -> -min(1.0, 1.6) = -1.0; r=1.1 -> -2.2.
    # A=-1: r=0.5 -> -min(-0.5, -0.8) = 0.8 (clipped); r=1.5 -> -min(-1.5, -1.28) = 1.5; r=0.9 -> 0.9.
    torch.testing.assert_close(loss, torch.tensor([[-2.56, -1.0, -2.2], [0.8, 1.5, 0.9]]))
    assert high.tolist() == [[True, False, False], [False, False, False]]
    assert low.tolist() == [[False, False, False], [True, False, False]]
    loss.sum().backward()
    # d/dlogp of -r*A is -r*A where unclipped; clipped tokens get no gradient.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.0, -2.2], [0.0, 1.5, 0.9]]))


def test_kl_estimators_match_their_closed_forms():
    logp, ref = torch.tensor([LOG(0.5)]), torch.tensor([LOG(0.25)])
    log_r = LOG(2.0)
    assert kl_per_token(logp, ref, estimator="k1").item() == pytest.approx(log_r)
    assert kl_per_token(logp, ref, estimator="k2").item() == pytest.approx(0.5 * log_r ** 2)
    # k3 = exp(-log r) + log r - 1 = 0.5 + 0.693147 - 1 = 0.193147
    assert kl_per_token(logp, ref, estimator="k3").item() == pytest.approx(0.1931472, abs=1e-6)
    assert kl_per_token(ref, ref, estimator="k3").item() == 0.0


VALUES = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize("aggregation, expected", [
    ("token_mean", (1 + 2 + 3 + 4) / 4),
    ("seq_mean_token_mean", (6 / 3 + 4 / 1) / 2),
    ("seq_mean_token_sum", (6 + 4) / 2),
    ("seq_mean_token_sum_norm", (1 + 2 + 3 + 4) / (5 * 2)),  # max_tokens 5 x 2 sequences
])
def test_each_aggregation_ignores_padding_and_gives_the_hand_computed_mean(aggregation, expected):
    norm = Normaliser(tokens=4, sequences=2)
    assert aggregate(VALUES, MASK, aggregation=aggregation, norm=norm, max_tokens=5).item() == pytest.approx(expected)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                         "seq_mean_token_sum_norm"])
def test_shares_of_micro_batches_add_up_to_the_full_batch_loss_and_gradient(aggregation):
    torch.manual_seed(0)
    logp = (torch.randn(6, 5) * 0.1 - 1).requires_grad_()
    old = logp.detach() + torch.randn(6, 5) * 0.3
    adv = torch.randn(6)
    mask = torch.rand(6, 5) > 0.3
    mask[2] = False  # a sequence without completion tokens counts for nothing
    settings = Options(clip_eps_low=0.2, clip_eps_high=0.28, loss_aggregation=aggregation, max_tokens=5)
    counts = local_counts(mask)
    norm = Normaliser(tokens=counts[0].item(), sequences=counts[1].item())
    full = token_ratio_loss(logprobs=logp, old_logprobs=old, advantages=adv, mask=mask, settings=settings, norm=norm)
    (full_grad,) = torch.autograd.grad(full.loss, logp)
    parts, grads = 0.0, torch.zeros_like(logp)
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        share = token_ratio_loss(logprobs=logp[rows], old_logprobs=old[rows], advantages=adv[rows],
                          mask=mask[rows], settings=settings, norm=norm)
        parts += share.loss.item()
        grads += torch.autograd.grad(share.loss, logp)[0]
    assert parts == pytest.approx(full.loss.item(), abs=1e-6)
    torch.testing.assert_close(grads, full_grad, atol=1e-7, rtol=0)


def test_padding_with_garbage_logprobs_changes_neither_loss_nor_gradient():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    settings = Options(kl_coef=0.1)
    norm = Normaliser(tokens=2, sequences=1)
    clean = token_ratio_loss(logprobs=logp, old_logprobs=torch.tensor([[-1.1, -1.9, 0.0]]),
                      advantages=torch.tensor([1.0]), mask=mask, settings=settings, norm=norm,
                      ref_logprobs=torch.tensor([[-1.0, -1.5, 0.0]]))
    dirty = token_ratio_loss(logprobs=logp, old_logprobs=torch.tensor([[-1.1, -1.9, -math.inf]]),
                      advantages=torch.tensor([1.0]), mask=mask, settings=settings, norm=norm,
                      ref_logprobs=torch.tensor([[-1.0, -1.5, math.nan]]))
    assert dirty.loss.item() == clean.loss.item()
    g_clean, = torch.autograd.grad(clean.loss, logp)
    g_dirty, = torch.autograd.grad(dirty.loss, logp)
    assert torch.equal(g_clean, g_dirty) and g_dirty[0, 2] == 0


def test_loss_adds_kl_coef_times_the_k3_kl_and_reports_clip_counts():
    logp = torch.tensor([[LOG(0.5), LOG(0.5)]])
    old = torch.tensor([[LOG(0.5), LOG(0.25)]])  # ratios 1 and 2
    ref = torch.tensor([[LOG(0.25), LOG(0.5)]])  # k3: 0.193147 and 0
    share = token_ratio_loss(logprobs=logp, old_logprobs=old, advantages=torch.tensor([1.0]),
                      mask=torch.ones(1, 2, dtype=torch.bool), norm=Normaliser(tokens=2, sequences=1),
                      settings=Options(clip_eps_high=0.28, kl_coef=0.5), ref_logprobs=ref)
    # policy: (-1 + -1.28) / 2 = -1.14; kl token mean 0.0965736; loss = -1.14 + 0.5 * 0.0965736
    assert share.policy_loss.item() == pytest.approx(-1.14)
    assert share.kl.item() == pytest.approx(0.0965736, abs=1e-6)
    assert share.loss.item() == pytest.approx(-1.14 + 0.5 * 0.0965736, abs=1e-6)
    assert (share.clipped_low.item(), share.clipped_high.item()) == (0, 1)


def test_kl_coef_without_reference_logprobs_is_an_error_that_says_how_to_fix_it():
    with pytest.raises(HpcrlError, match="kl_coef"):
        token_ratio_loss(logprobs=torch.zeros(1, 2), old_logprobs=torch.zeros(1, 2), advantages=torch.ones(1),
                  mask=torch.ones(1, 2), settings=Options(kl_coef=0.1),
                  norm=Normaliser(tokens=2, sequences=1))
