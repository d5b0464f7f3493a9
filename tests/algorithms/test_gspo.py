"""GSPO's sequence-level ratio, clipping and gradient against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from hpcrl.algorithms import load_algorithm
from hpcrl.algorithms.base import Options
from hpcrl.algorithms.terms import Normaliser

GSPO = load_algorithm("gspo")
SETTINGS = Options(name="gspo", clip_eps_low=0.2, clip_eps_high=0.28, loss_aggregation="seq_mean_token_mean")


def test_gspo_defaults_are_the_papers_small_clips_and_a_sequence_mean():
    assert GSPO.defaults == {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4, "loss_aggregation": "seq_mean_token_mean"}


def test_gspo_clips_the_sequence_ratio_not_each_tokens():
    # Old logprobs 0. Sequence 0 (A = +1): log ratios 0.4 and -0.4, so s = exp(mean) = exp(0) = 1: not clipped,
    # although its first token's own ratio exp(0.4) = 1.49 is above 1.28. Sequence 1 (A = -1): log ratio -0.5,
    # s = 0.6065 < 0.8: clipped low.
    logp = torch.tensor([[0.0, 0.4, -0.4], [0.0, -0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.bool)
    share = GSPO.loss(logprobs=logp, old_logprobs=torch.zeros(2, 3), advantages=torch.tensor([1.0, -1.0]), mask=mask,
                      settings=SETTINGS, norm=Normaliser(tokens=3, sequences=2))
    # Sequence losses: -min(1 * 1, 1 * 1) = -1; -min(-0.6065, -0.8) = 0.8. Mean over sequences: -0.1.
    assert share.loss.item() == pytest.approx(-0.1, abs=1e-6)
    assert (share.clipped_low.item(), share.clipped_high.item()) == (1, 0)
    (grad,) = torch.autograd.grad(share.loss, logp)
    # d/dlogp_t of -s_0 A / 2 with s_0 = exp(mean_t logp_t): -s_0 / 2 tokens / 2 sequences = -0.25 per token;
    # the clipped sequence gets none.
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.25, -0.25], [0.0, 0.0, 0.0]]))


def test_gspo_gradient_is_the_sequence_ratio_times_the_mean_token_gradient():
    # One sequence, A = +2, log ratios 0.1 and 0.3: s = exp(0.2) = 1.2214028 (inside 1.28).
    logp = torch.tensor([[0.0, 0.1, 0.3]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1]], dtype=torch.bool)
    share = GSPO.loss(logprobs=logp, old_logprobs=torch.zeros(1, 3), advantages=torch.tensor([2.0]), mask=mask,
                      settings=SETTINGS, norm=Normaliser(tokens=2, sequences=1))
    assert share.loss.item() == pytest.approx(-2 * 1.2214028, abs=1e-6)
    (grad,) = torch.autograd.grad(share.loss, logp)
    # -A s / n = -2 * 1.2214028 / 2 = -1.2214028 on each token.
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1.2214028, -1.2214028]]))
    # With the paper's clips (4e-4 above) the same sequence is clipped: loss -(1 + 4e-4) * 2, no gradient.
    clipped = GSPO.loss(logprobs=logp, old_logprobs=torch.zeros(1, 3), advantages=torch.tensor([2.0]), mask=mask,
                        settings=Options(clip_eps_low=3e-4, clip_eps_high=4e-4, loss_aggregation="seq_mean_token_mean"),
                        norm=Normaliser(tokens=2, sequences=1))
    assert clipped.loss.item() == pytest.approx(-2.0008, abs=1e-6) and clipped.clipped_high.item() == 2
    assert not torch.autograd.grad(clipped.loss, logp)[0].any()
    assert math.isclose(share.policy_loss.item(), share.loss.item())
