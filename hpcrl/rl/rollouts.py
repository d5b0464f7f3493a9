"""From generated completions and their rewards to scored groups and a training batch.

    groups = score_groups(prompts, completions, results, weight_version=3)
    selection = algorithm.select([g.rollouts for g in groups], settings, wanted=8)   # hpcrl.algorithms
    batch = batch_from_groups(groups, selection)

A sample is a hpcrl.algorithms.base.Rollout (tokens, the policy's mask over them, their sampling
logprobs, a reward); a single-turn completion fills it as prompt (mask 0) + completion (mask 1).
A completion whose reward could not be computed (the verifier raised, hung or died) is never
scored zero: its whole group is held out of training and counted, so a broken verifier shows up
in the metrics instead of silently teaching the policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.algorithms.base import Rollout, Selection
from hpcrl.data.prompts import Prompt
from hpcrl.inference.types import Completion
from hpcrl.reward.types import RewardResult, Sample
from hpcrl.rl.buffer import ScoredGroup
from hpcrl.trainer.types import TrainBatch


def samples_for(prompts: list[Prompt], completions: list[list[Completion]]) -> list[Sample]:
    """The reward requests of a batch: one per completion, ids "prompt_id/k". The prompt is the row's text in
    both formats, never the chat template's rendering (hpcrl.data.chat); the trainer's tokens are the
    completion's prompt_token_ids, the rendered ids vLLM generated from (score_groups)."""
    return [Sample(id=f"{p.id}/{c.index}", prompt_id=p.id, prompt=p.text, completion=c.text, answer=p.answer)
            for p, group in zip(prompts, completions) for c in group]


@dataclass(frozen=True, kw_only=True)
class ScoreStats:
    groups: int
    groups_with_errors: int
    errors: list[str]
    """"prompt_id/k: why", for the log."""
    parts: dict[str, list[float]]
    """With several reward functions: each one's scores over the samples of the groups kept."""


def score_groups(prompts: list[Prompt], completions: list[list[Completion]], results: list[RewardResult],
                 *, weight_version: int, batch: int = 0) -> tuple[list[ScoredGroup], ScoreStats]:
    """Pair completions with rewards; groups with any reward error are held out (see the docstring)."""
    by_id = {r.id: r for r in results}
    groups, errors, bad = [], [], 0
    parts: dict[str, list[float]] = {}
    for prompt, group in zip(prompts, completions):
        rewards = [by_id[f"{prompt.id}/{c.index}"] for c in group]
        failed = [r for r in rewards if r.reward is None]
        if failed:
            bad += 1
            errors += [f"{r.id}: {r.error}" for r in failed]
            continue
        for r in rewards:
            for name, value in (r.parts or {}).items():
                parts.setdefault(name, []).append(value)
        rollouts = [Rollout.single_turn(c.prompt_token_ids, c.token_ids, c.logprobs, reward=float(r.reward),
                                        finish_reason=c.finish_reason)
                    for c, r in zip(group, rewards) if r.reward is not None]  # all scored: see above
        groups.append(ScoredGroup(prompt_id=prompt.id, rollouts=rollouts, batch=batch,
                                  weight_version=min((c.weight_version for c in group), default=weight_version)))
    return groups, ScoreStats(groups=len(prompts), groups_with_errors=bad, errors=errors, parts=parts)


def batch_from_groups(groups: list[ScoredGroup], selection: Selection) -> TrainBatch:
    """One sequence per rollout of the groups `selection` keeps, in its order, with its advantages."""
    fields: dict[str, list] = {k: [] for k in ("prompt_ids", "input_ids", "policy_mask", "logprobs",
                                                "advantages", "rewards")}
    for index, group_adv in zip(selection.kept, selection.advantages, strict=True):
        group = groups[index]
        for rollout, adv in zip(group.rollouts, group_adv, strict=True):
            fields["prompt_ids"].append(group.prompt_id)
            fields["input_ids"].append(rollout.tokens)
            fields["policy_mask"].append(rollout.policy_mask)
            fields["logprobs"].append(rollout.logprobs)
            fields["advantages"].append(adv)
            fields["rewards"].append(rollout.reward)
    return TrainBatch(**fields)
