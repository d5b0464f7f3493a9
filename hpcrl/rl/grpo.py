"""GRPO at the head: advantages of completions normalised within their group.

A pure tensor function, no I/O: hpcrl.rl.rollouts turns scored groups into a training batch
with it. The loss the trainer minimises is hpcrl.trainer.loss.

Run the tests: `python -m pytest tests/rl/test_grpo.py -q`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from hpcrl.errors import HpcrlError


@dataclass(frozen=True, kw_only=True)
class GroupAdvantages:
    advantages: Tensor
    """[N] advantage of each completion (N = groups x group_size, group-major order)."""
    zero_variance: Tensor
    """[N // group_size] bool: the group's rewards are all equal (no learning signal)."""
    keep: Tensor
    """[N] bool: completions to train on (all, or those of non-zero-variance groups when filtering)."""


AdvantageNorm = Literal["mean_std", "mean"]
"""How rewards are normalised within a group (config key algorithm.advantage_norm)."""


def group_advantages(rewards: Tensor, *, group_size: int, norm: AdvantageNorm = "mean_std",
                     eps: float = 1e-6, filter_zero_variance: bool = False) -> GroupAdvantages:
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
    keep = torch.ones_like(grouped, dtype=torch.bool)
    if filter_zero_variance:
        keep = ~zero_variance[:, None].expand_as(grouped)
    return GroupAdvantages(advantages=centred.view(-1).to(rewards.dtype), zero_variance=zero_variance,
                           keep=keep.reshape(-1))
