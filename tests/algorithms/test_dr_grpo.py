"""Dr. GRPO: mean-centred advantages and a constant-length loss, against values worked out by hand."""

from __future__ import annotations

import pytest
import torch

from hpcrl.algorithms import load_algorithm
from hpcrl.algorithms.base import Options, Rollout
from hpcrl.algorithms.grpo import GrpoOptions
from hpcrl.algorithms.terms import Normaliser

DR_GRPO = load_algorithm("dr_grpo")


def test_dr_grpo_defaults_drop_the_std_and_the_per_sequence_length_normalisation():
    assert DR_GRPO.defaults == {"advantage_norm": "mean", "loss_aggregation": "seq_mean_token_sum_norm"}


def test_dr_grpo_advantages_subtract_the_group_mean_without_dividing_by_the_std():
    rollouts = [Rollout.single_turn([1], [2], [-1.0], reward=r) for r in (1.0, 0.0, 0.0, 0.0)]
    selection = DR_GRPO.select([rollouts], GrpoOptions(advantage_norm="mean"), wanted=1)
    # mean 0.25: 1 - 0.25, 0 - 0.25 (GRPO would give 1.5 and -0.5 after dividing by the std 0.5).
    assert selection.advantages == [[0.75, -0.25, -0.25, -0.25]]


def test_dr_grpo_loss_sums_token_losses_and_divides_by_max_tokens_times_sequences():
    # On-policy (ratio 1): token loss = -A. Sequence 0: two tokens, A = 0.75; sequence 1: one token, A = -0.25.
    logp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -1.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.bool)
    share = DR_GRPO.loss(logprobs=logp, old_logprobs=logp.detach().clone(), advantages=torch.tensor([0.75, -0.25]),
                         mask=mask, norm=Normaliser(tokens=3, sequences=2),
                         settings=Options(loss_aggregation="seq_mean_token_sum_norm", max_tokens=4))
    # (-0.75 - 0.75 + 0.25) / (max_tokens 4 x 2 sequences) = -1.25 / 8 = -0.15625
    # (token_mean would give -1.25 / 3, seq_mean_token_mean (-0.75 + 0.25) / 2).
    assert share.loss.item() == pytest.approx(-0.15625)
    (grad,) = torch.autograd.grad(share.loss, logp)
    # Each token's gradient is -A / 8, whatever its sequence's length: -0.09375 and 0.03125.
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.09375, -0.09375], [0.0, 0.03125, 0.0]]))
