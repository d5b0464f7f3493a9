"""The tensor terms the algorithms share: ratios, clipping, aggregation, KL, group advantages.

Imports torch: the algorithm modules import it inside their functions, so the registry stays
importable without torch (see hpcrl.algorithms). Every per-token tensor is [batch, seq] and aligned
with the token ids: position t holds the value for token t (predicted from the logits at t - 1);
`mask` is 1 on the tokens the policy generated and 0 on prompt, tool output and padding.

Exact normalisation under gradient accumulation and data parallelism: a loss returns this
micro-batch's *share* of the step loss, i.e. a sum divided by a `Normaliser` that counts the
whole step (every micro-batch on every rank). Summing the shares' gradients over micro-batches
(accumulation) and over ranks (FSDP with sum reduction) gives exactly the gradient of the loss
of the full batch, whatever the split.

    loss_t  = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) + kl_coef * KL_t
    r_t     = exp(logp_t - logp_old_t)          per token (GRPO, DAPO, Dr. GRPO)
    r_t     = exp(mean_t' (logp_t' - logp_old_t'))   per sequence (GSPO; its gradient see gspo.py)

Aggregations (N = generated tokens of the step, S = sequences with a generated token, L = max_tokens):
    token_mean               sum_{i,t} loss / N
    seq_mean_token_mean      sum_i (sum_t loss / n_i) / S
    seq_mean_token_sum       sum_i (sum_t loss) / S
    seq_mean_token_sum_norm  sum_{i,t} loss / (L S)      (Dr. GRPO: no per-sequence length)

Run the tests: `python -m pytest tests/algorithms -q`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from hpcrl.algorithms.base import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    AdvantageNorm,
    Aggregation,
    KLEstimator,
    LossShare,
    Options,
    Selection,
)
from hpcrl.errors import HpcrlError

# ------------------------------------------------------------------------------ normalisation


@dataclass(frozen=True, kw_only=True)
class Normaliser:
    """Counts over the whole optimizer step (all micro-batches, all data-parallel ranks)."""

    tokens: float
    """Generated tokens of the step (the token_mean denominator)."""
    sequences: float
    """Sequences with at least one generated token (the seq_mean_* denominator)."""

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.sequences < 0:
            raise HpcrlError(f"normaliser counts must be >= 0, got tokens={self.tokens} "
                             f"sequences={self.sequences}")


def local_counts(mask: Tensor) -> Tensor:
    """[tokens, sequences] of this rank's part of the step, as a float64 tensor to all-reduce."""
    mask = mask.bool()
    return torch.stack([mask.sum(), mask.any(dim=-1).sum()]).double()


def aggregate(values: Tensor, mask: Tensor, *, aggregation: Aggregation, norm: Normaliser,
              max_tokens: int = 0) -> Tensor:
    """This micro-batch's share of the step mean of per-token `values` (see module docstring)."""
    weights = mask.to(values.dtype)
    masked = values * weights
    if aggregation == "token_mean":
        return masked.sum() / max(norm.tokens, 1.0)
    if aggregation == "seq_mean_token_sum_norm":
        if max_tokens < 1:
            raise HpcrlError("seq_mean_token_sum_norm needs max_tokens >= 1 (inference.max_tokens)")
        return masked.sum() / (max_tokens * max(norm.sequences, 1.0))
    per_seq = masked.sum(dim=-1)
    if aggregation == "seq_mean_token_mean":
        per_seq = per_seq / weights.sum(dim=-1).clamp(min=1.0)
    elif aggregation != "seq_mean_token_sum":
        raise HpcrlError(f"unknown loss aggregation {aggregation!r}; use one of {', '.join(AGGREGATIONS)}")
    return per_seq.sum() / max(norm.sequences, 1.0)


# ------------------------------------------------------------------------------- token terms

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


def clipped_surrogate(ratio: Tensor, advantages: Tensor, *, clip_eps_low: float,
                      clip_eps_high: float) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's clipped surrogate of importance ratios `ratio` [B, T]: (loss, clipped_low, clipped_high).

    `advantages` is per token [B, T] or per sequence [B]. clipped_low/high are bool tensors of the
    tokens whose gradient the clip removed (A < 0 and r < 1 - eps_low; A > 0 and r > 1 + eps_high).
    """
    if advantages.dim() == ratio.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.to(ratio.dtype)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        clipped_low = (advantages < 0) & (ratio < 1.0 - clip_eps_low)
        clipped_high = (advantages > 0) & (ratio > 1.0 + clip_eps_high)
    return loss, clipped_low, clipped_high


def clipped_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *,
                        clip_eps_low: float, clip_eps_high: float, behavior_cap: float = 0.0
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token PPO surrogate with separate clips of r_t = exp(logp_t - old_t): see clipped_surrogate.

    With `behavior_cap` > 0, decoupled (AReaL, Fu et al. 2025): the proximal policy is the weights the step starts
    from (`logprobs` detached: one update per batch), so r_t = exp(logp_t - prox_t) is 1 in value and its clip never
    acts; each token's surrogate is weighted by min(exp(prox_t - old_t), behavior_cap), its behaviour ratio against
    the sampling weights, truncated. A stale token keeps its gradient, weighted by how likely the current policy
    finds it, where the clip against the sampling weights would zero it."""
    if behavior_cap <= 0:
        return clipped_surrogate(torch.exp(logprobs - old_logprobs), advantages, clip_eps_low=clip_eps_low,
                                 clip_eps_high=clip_eps_high)
    proximal = logprobs.detach()
    loss, low, high = clipped_surrogate(torch.exp(logprobs - proximal), advantages, clip_eps_low=clip_eps_low,
                                        clip_eps_high=clip_eps_high)
    return loss * behavior_weight(proximal, old_logprobs, behavior_cap), low, high


def behavior_weight(proximal: Tensor, old_logprobs: Tensor, cap: float) -> Tensor:
    """The decoupled loss's weight of each token (or sequence): exp(proximal - sampled), at most `cap`; no gradient."""
    return torch.exp(proximal - old_logprobs).clamp(max=cap).detach()


# ------------------------------------------------------------------------------------- loss

def finite_where_masked(mask: Tensor, logprobs: Tensor, other: Tensor) -> Tensor:
    """`other` with the policy's (detached) logprobs where `mask` is False.

    Padding may hold anything (even -inf or nan): put finite values there first, so that no
    inf * 0 = nan reaches the gradient through the masking.
    """
    return torch.where(mask, other, logprobs.detach())


def policy_share(per_token: Tensor, low: Tensor, high: Tensor, *, logprobs: Tensor, mask: Tensor,
                 settings: Options, norm: Normaliser, ref_logprobs: Tensor | None) -> LossShare:
    """The share of a per-token surrogate `per_token`, aggregated, plus the KL penalty (mask is bool)."""
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    policy = aggregate(per_token, mask, aggregation=settings.loss_aggregation, norm=norm, max_tokens=settings.max_tokens)
    loss = policy
    kl_share = torch.zeros((), dtype=torch.float64, device=logprobs.device)
    if settings.kl_coef > 0:
        if ref_logprobs is None:
            raise HpcrlError("kl_coef > 0 but no reference logprobs were given; compute them with "
                             "the reference model (TrainerEngine does) or set algorithm.kl_coef = 0")
        kl = torch.where(mask, kl_per_token(logprobs, ref_logprobs, estimator=settings.kl_estimator),
                         torch.zeros_like(per_token))
        loss = loss + settings.kl_coef * aggregate(kl, mask, aggregation=settings.loss_aggregation, norm=norm,
                                                   max_tokens=settings.max_tokens)
        kl_share = aggregate(kl.detach(), mask, aggregation="token_mean", norm=norm).double()
    return LossShare(loss=loss, policy_loss=policy.detach().double(), kl=kl_share,
                     clipped_low=(low & mask).sum().double(), clipped_high=(high & mask).sum().double())


def token_ratio_loss(*, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                     settings: Options, norm: Normaliser, ref_logprobs: Tensor | None = None) -> LossShare:
    """The clipped loss with a per-token importance ratio (GRPO, DAPO, Dr. GRPO differ in settings)."""
    mask = mask.bool()
    old_logprobs = finite_where_masked(mask, logprobs, old_logprobs)
    if ref_logprobs is not None:
        ref_logprobs = finite_where_masked(mask, logprobs, ref_logprobs)
    per_token, low, high = clipped_policy_loss(logprobs, old_logprobs, advantages,
                                               clip_eps_low=settings.clip_eps_low,
                                               clip_eps_high=settings.clip_eps_high,
                                               behavior_cap=settings.behavior_weight_cap)
    return policy_share(per_token, low, high, logprobs=logprobs, mask=mask, settings=settings, norm=norm,
                        ref_logprobs=ref_logprobs)


# ------------------------------------------------------------------------------- advantages

class GroupAdvantages(NamedTuple):
    """Advantages of completions within their groups (`group_advantages`)."""

    advantages: Tensor
    """[N] advantage of each completion (N = groups x group_size, group-major order)."""
    zero_variance: Tensor
    """[N // group_size] bool: the group's rewards are all equal (no learning signal): which groups a filter drops."""


def group_advantages(rewards: Tensor, *, group_size: int, norm: AdvantageNorm = "mean_std",
                     eps: float = 1e-6) -> GroupAdvantages:
    """Advantages of completions normalised within their group of `group_size`.

    `rewards` is [N] with the completions of one prompt next to each other. mean_std gives
    (r - mean) / (std + eps) with the unbiased std (as GRPO); mean gives r - mean (Dr. GRPO).
    A group whose rewards are all equal has zero advantages either way and is flagged.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise HpcrlError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of "
                         f"{group_size}; pass a flat tensor of groups x group_size rewards")
    if norm not in ("mean_std", "mean"):
        raise HpcrlError(f"unknown advantage norm {norm!r}; use 'mean_std' or 'mean'")
    grouped = rewards.double().view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    centred = grouped - mean
    zero_variance = (grouped == grouped[:, :1]).all(dim=1)
    if norm == "mean_std":
        centred = centred / (grouped.std(dim=1, keepdim=True, correction=1) + eps)
    centred = torch.where(zero_variance[:, None], torch.zeros_like(centred), centred)
    return GroupAdvantages(advantages=centred.view(-1).to(rewards.dtype), zero_variance=zero_variance)


def group_selection(rewards: list[list[float]], *, norm: AdvantageNorm, filter_zero_variance: bool,
                    wanted: int | None = None) -> Selection:
    """Per-sequence group advantages of a batch's groups (`rewards`, one list per group), the groups
    with equal rewards left out when filtering, and at most `wanted` groups kept (None: all)."""
    if not rewards:
        return Selection(kept=[], advantages=[])
    flat = torch.tensor([r for group in rewards for r in group], dtype=torch.float64)
    result = group_advantages(flat, group_size=len(rewards[0]), norm=norm)
    per_group = result.advantages.view(len(rewards), -1).tolist()
    signal = [i for i, zero in enumerate(result.zero_variance.tolist()) if not (filter_zero_variance and zero)]
    kept = signal if wanted is None else signal[:wanted]
    return Selection(kept=kept, advantages=[per_group[i] for i in kept],
                     dropped_zero_variance=len(rewards) - len(signal))
