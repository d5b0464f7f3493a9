"""The model-output terms the trainer engine needs besides an algorithm's loss: token logprobs, entropy.

An algorithm's loss (clipping, aggregation, KL, normalisation over the step) is in hpcrl.algorithms
(its module, and the shared terms in hpcrl/algorithms/terms.py); the engine (engine.py) calls the
configured one on each micro-batch.

Run the tests: `python -m pytest tests/trainer/test_loss.py -q`.
"""

from __future__ import annotations

import torch
from torch import Tensor

# ------------------------------------------------------------------------------- token terms

def token_logprobs(logits: Tensor, targets: Tensor, *, temperature: float = 1.0) -> Tensor:
    """log p(target) under softmax(logits / temperature), in float32. logits [..., V], targets [...]."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return -torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none").view(targets.shape)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy (nats) of softmax(logits) over the last dim, in float32."""
    logits = logits.float()
    logp = logits.log_softmax(dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
