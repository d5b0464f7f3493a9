"""Token logprobs and entropy against values worked out by hand (hpcrl/trainer/loss.py).

The losses themselves are tested with the algorithms: tests/algorithms.
"""

from __future__ import annotations

import math

import pytest
import torch

from hpcrl.trainer.loss import entropy_from_logits, token_logprobs

LOG = math.log


def test_token_logprobs_and_entropy_match_softmax_by_hand():
    logits = torch.tensor([[0.0, LOG(3.0)]])  # probabilities 1/4, 3/4
    assert token_logprobs(logits, torch.tensor([1])).item() == pytest.approx(LOG(0.75))
    assert token_logprobs(logits, torch.tensor([0]), temperature=2.0).item() == pytest.approx(
        LOG(1 / (1 + math.sqrt(3))))
    assert entropy_from_logits(logits).item() == pytest.approx(-(0.25 * LOG(0.25) + 0.75 * LOG(0.75)))
