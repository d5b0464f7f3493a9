"""The GRPO loss as pure tensor functions: the clipped policy loss, KL, entropy, exact normalisation.

No I/O, no process groups, no model: the trainer engine (engine.py) calls these on each
micro-batch. The head's side of GRPO, group advantages, is hpcrl.rl.grpo. Every per-token tensor
is [batch, seq] and aligned with the token ids: position t holds the value for token t (predicted
from the logits at t - 1); `mask` is 1 on completion tokens and 0 on prompt and padding.

Exact normalisation under gradient accumulation and data parallelism: `grpo_loss` returns this
micro-batch's *share* of the step loss, i.e. a sum divided by a `Normaliser` that counts the
whole step (every micro-batch on every rank). Summing the shares' gradients over micro-batches
(accumulation) and over ranks (FSDP with sum reduction) gives exactly the gradient of the loss
of the full batch, whatever the split.

    loss_t  = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) + kl_coef * KL_t
    r_t     = exp(logp_t - logp_old_t)          (DAPO clip-higher: eps_high > eps_low)

Aggregations (N = completion tokens of the step, S = sequences with a completion token):
    token_mean           sum_{i,t} loss / N
    seq_mean_token_mean  sum_i (sum_t loss / n_i) / S
    seq_mean_token_sum   sum_i (sum_t loss) / S

Run the tests: `python -m pytest tests/trainer/test_loss.py -q`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from hpcrl.errors import HpcrlError

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
KLEstimator = Literal["k1", "k2", "k3"]
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
KL_ESTIMATORS = ("k1", "k2", "k3")


# ------------------------------------------------------------------------------ normalisation

@dataclass(frozen=True, kw_only=True)
class Normaliser:
    """Counts over the whole optimizer step (all micro-batches, all data-parallel ranks)."""

    tokens: float
    """Completion tokens of the step (the token_mean denominator)."""
    sequences: float
    """Sequences with at least one completion token (the seq_mean_* denominator)."""

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.sequences < 0:
            raise HpcrlError(f"normaliser counts must be >= 0, got tokens={self.tokens} "
                             f"sequences={self.sequences}")


def local_counts(mask: Tensor) -> Tensor:
    """[tokens, sequences] of this rank's part of the step, as a float64 tensor to all-reduce."""
    mask = mask.bool()
    return torch.stack([mask.sum(), mask.any(dim=-1).sum()]).double()


def aggregate(values: Tensor, mask: Tensor, *, aggregation: Aggregation, norm: Normaliser) -> Tensor:
    """This micro-batch's share of the step mean of per-token `values` (see module docstring)."""
    weights = mask.to(values.dtype)
    masked = values * weights
    if aggregation == "token_mean":
        return masked.sum() / max(norm.tokens, 1.0)
    per_seq = masked.sum(dim=-1)
    if aggregation == "seq_mean_token_mean":
        per_seq = per_seq / weights.sum(dim=-1).clamp(min=1.0)
    elif aggregation != "seq_mean_token_sum":
        raise HpcrlError(f"unknown loss aggregation {aggregation!r}; use one of {', '.join(AGGREGATIONS)}")
    return per_seq.sum() / max(norm.sequences, 1.0)


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


def kl_per_token(logprobs: Tensor, ref_logprobs: Tensor, *, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1, k2, k3).

    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) + log r - 1, with log r = logp - logp_ref.
    k3 is unbiased and never negative.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise HpcrlError(f"unknown KL estimator {estimator!r}; use one of {', '.join(KL_ESTIMATORS)}")


def clipped_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *,
                        clip_eps_low: float, clip_eps_high: float) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token PPO surrogate with separate clips: (loss, clipped_low, clipped_high).

    `advantages` is per token [B, T] or per sequence [B]. clipped_low/high are bool tensors of the
    tokens whose gradient the clip removed (A < 0 and r < 1 - eps_low; A > 0 and r > 1 + eps_high).
    """
    if advantages.dim() == logprobs.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        clipped_low = (advantages < 0) & (ratio < 1.0 - clip_eps_low)
        clipped_high = (advantages > 0) & (ratio > 1.0 + clip_eps_high)
    return loss, clipped_low, clipped_high


def logprob_mismatch(trainer_logprobs: Tensor, inference_logprobs: Tensor, mask: Tensor) -> tuple[float, int]:
    """(sum of |trainer - inference| over masked tokens, token count): the train-inference mismatch
    metric is the sum over ranks divided by the count over ranks."""
    mask = mask.bool()
    difference = (trainer_logprobs.float() - inference_logprobs.float()).abs()
    return float(difference[mask].sum()), int(mask.sum())


# ------------------------------------------------------------------------------------- loss

@dataclass(frozen=True, kw_only=True)
class LossSettings:
    clip_eps_low: float = 0.2
    """Lower clip of the importance ratio: 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """Upper clip of the importance ratio: 1 + clip_eps_high."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy; 0 = none."""
    kl_estimator: KLEstimator = "k3"
    """Per-token KL estimator."""
    aggregation: Aggregation = "token_mean"
    """How per-token losses become one number."""

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise HpcrlError(f"unknown loss aggregation {self.aggregation!r}; use one of {', '.join(AGGREGATIONS)}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise HpcrlError(f"unknown KL estimator {self.kl_estimator!r}; use one of {', '.join(KL_ESTIMATORS)}")

    @classmethod
    def from_config(cls, algorithm) -> LossSettings:
        """From an `hpcrl.config.schema.AlgorithmConfig`."""
        return cls(clip_eps_low=algorithm.clip_eps_low, clip_eps_high=algorithm.clip_eps_high,
                   kl_coef=algorithm.kl_coef, kl_estimator=algorithm.kl_estimator,
                   aggregation=algorithm.loss_aggregation)


@dataclass(frozen=True, kw_only=True)
class LossShare:
    """One micro-batch's share of the step loss and of its metrics (sums over its tokens)."""

    loss: Tensor
    """Scalar to backward: policy share + kl_coef * KL share."""
    policy_loss: Tensor
    """Detached share of the policy (surrogate) term, aggregated like the loss."""
    kl: Tensor
    """Detached share of the token-mean KL to the reference (0 without one)."""
    clipped_low: Tensor
    """Detached count of tokens clipped below (A < 0)."""
    clipped_high: Tensor
    """Detached count of tokens clipped above (A > 0)."""


def grpo_loss(*, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
              settings: LossSettings, norm: Normaliser, ref_logprobs: Tensor | None = None) -> LossShare:
    """This micro-batch's share of the GRPO loss of the step (see the module docstring)."""
    mask = mask.bool()
    # Padding may hold anything (even -inf or nan): put finite values there first, so that no
    # inf * 0 = nan reaches the gradient through the masking below.
    old_logprobs = torch.where(mask, old_logprobs, logprobs.detach())
    if ref_logprobs is not None:
        ref_logprobs = torch.where(mask, ref_logprobs, logprobs.detach())
    per_token, low, high = clipped_policy_loss(logprobs, old_logprobs, advantages,
                                               clip_eps_low=settings.clip_eps_low,
                                               clip_eps_high=settings.clip_eps_high)
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    policy = aggregate(per_token, mask, aggregation=settings.aggregation, norm=norm)
    loss = policy
    kl_share = torch.zeros((), dtype=torch.float64, device=logprobs.device)
    if settings.kl_coef > 0:
        if ref_logprobs is None:
            raise HpcrlError("kl_coef > 0 but no reference logprobs were given; compute them with "
                             "the reference model (TrainerEngine does) or set algorithm.kl_coef = 0")
        kl = torch.where(mask, kl_per_token(logprobs, ref_logprobs, estimator=settings.kl_estimator),
                         torch.zeros_like(per_token))
        loss = loss + settings.kl_coef * aggregate(kl, mask, aggregation=settings.aggregation, norm=norm)
        kl_share = aggregate(kl.detach(), mask, aggregation="token_mean", norm=norm).double()
    return LossShare(loss=loss, policy_loss=policy.detach().double(), kl=kl_share,
                     clipped_low=(low & mask).sum().double(), clipped_high=(high & mask).sum().double())
