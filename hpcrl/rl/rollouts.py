"""From generated completions and their rewards to GRPO groups and a training batch.

    groups = score_groups(prompts, completions, results, weight_version=3)
    batch, dropped = build_batch(groups, norm="mean_std", drop_zero_variance=False)

A completion whose reward could not be computed (the verifier raised, hung or died) is never
scored zero: its whole group is held out of training and counted, so a broken verifier shows up
in the metrics instead of silently teaching the policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpcrl.data.prompts import Prompt
from hpcrl.inference.types import Completion
from hpcrl.reward.types import RewardResult, Sample
from hpcrl.rl.buffer import ScoredGroup
from hpcrl.trainer.types import TrainBatch

if TYPE_CHECKING:  # grpo imports torch: build_batch imports it when first called
    from hpcrl.rl.grpo import AdvantageNorm


def samples_for(prompts: list[Prompt], completions: list[list[Completion]]) -> list[Sample]:
    """The reward requests of a batch: one per completion, ids "prompt_id/k"."""
    return [Sample(id=f"{p.id}/{c.index}", prompt_id=p.id, prompt=p.text, completion=c.text, answer=p.answer)
            for p, group in zip(prompts, completions) for c in group]


@dataclass(frozen=True, kw_only=True)
class ScoreStats:
    groups: int
    groups_with_errors: int
    errors: list[str]
    """"prompt_id/k: why", for the log."""


def score_groups(prompts: list[Prompt], completions: list[list[Completion]], results: list[RewardResult],
                 *, weight_version: int, batch: int = 0) -> tuple[list[ScoredGroup], ScoreStats]:
    """Pair completions with rewards; groups with any reward error are held out (see the docstring)."""
    by_id = {r.id: r for r in results}
    groups, errors, bad = [], [], 0
    for prompt, group in zip(prompts, completions):
        rewards = [by_id[f"{prompt.id}/{c.index}"] for c in group]
        failed = [r for r in rewards if r.reward is None]
        if failed:
            bad += 1
            errors += [f"{r.id}: {r.error}" for r in failed]
            continue
        groups.append(ScoredGroup(
            prompt_id=prompt.id, prompt_token_ids=group[0].prompt_token_ids,
            completions=[c.token_ids for c in group], logprobs=[c.logprobs for c in group],
            rewards=[float(r.reward) for r in rewards if r.reward is not None], batch=batch,  # all scored: see above
            weight_version=min((c.weight_version for c in group), default=weight_version),
            finish_reasons=[c.finish_reason for c in group]))
    return groups, ScoreStats(groups=len(prompts), groups_with_errors=bad, errors=errors)


def batch_from_groups(groups: list[ScoredGroup], advantages: list[list[float]]) -> TrainBatch:
    """One sequence per completion of `groups`, in group order, with `advantages` (one list per group)."""
    fields: dict[str, list] = {k: [] for k in ("prompt_ids", "input_ids", "prompt_lengths", "old_logprobs",
                                                "advantages", "rewards")}
    for group, group_adv in zip(groups, advantages):
        for tokens, logprobs, adv, reward in zip(group.completions, group.logprobs, group_adv, group.rewards):
            fields["prompt_ids"].append(group.prompt_id)
            fields["input_ids"].append(group.prompt_token_ids + tokens)
            fields["prompt_lengths"].append(len(group.prompt_token_ids))
            fields["old_logprobs"].append(logprobs)
            fields["advantages"].append(adv)
            fields["rewards"].append(reward)
    return TrainBatch(**fields)


def build_batch(groups: list[ScoredGroup], *, norm: AdvantageNorm, drop_zero_variance: bool) -> tuple[TrainBatch, int]:
    """The training batch of `groups` (advantages by `hpcrl.rl.grpo.group_advantages`) and how many
    zero-variance groups were dropped."""
    if not groups:
        return batch_from_groups([], []), 0
    import torch

    from hpcrl.rl.grpo import group_advantages

    rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float64)
    result = group_advantages(rewards, group_size=len(groups[0].rewards), norm=norm)
    per_group = result.advantages.view(len(groups), -1).tolist()
    kept = [(g, a) for g, a, flat in zip(groups, per_group, result.zero_variance.tolist())
            if not (drop_zero_variance and flat)]
    return batch_from_groups([g for g, _ in kept], [a for _, a in kept]), len(groups) - len(kept)
