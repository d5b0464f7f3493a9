"""From a batch's episodes (hpcrl.rl.episodes) and their rewards to scored groups and a training batch.

    results = await ports.score(samples_for(episodes))       # the episodes no environment rewarded
    groups, stats = score_groups(episodes, results, weight_version=3)
    selection = algorithm.select([g.rollouts for g in groups], settings, wanted=8)   # hpcrl.algorithms
    batch = batch_from_groups(groups, selection)

A sample is a hpcrl.algorithms.base.Rollout (tokens, the policy's mask over them, their sampling
logprobs, a reward): an episode's ids, mask 1 on its policy turns (a one-turn episode: prompt, mask 0,
then completion, mask 1). An episode whose reward could not be computed (the verifier raised, hung or
died) or whose environment failed is never scored zero: its whole group is held out of training and
counted, so a broken verifier shows up in the metrics instead of silently teaching the policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.algorithms.base import Selection
from hpcrl.reward.types import RewardResult, Sample
from hpcrl.rl.buffer import ScoredGroup
from hpcrl.rl.episodes import Episode
from hpcrl.trainer.types import TrainBatch


def samples_for(groups: list[list[Episode]]) -> list[Sample]:
    """The [reward] requests of a batch's episodes: one per episode the environment left unrewarded (every one
    without an environment), ids "prompt_id/k"; none for a group held out already (an episode without an
    outcome). The prompt is the row's text in both formats, never the chat template's rendering
    (hpcrl.data.chat); the completion is the episode's last policy turn; `extra` is the row's data.columns.extra
    (Prompt.extra), which reward functions with an `extra` parameter are given."""
    return [Sample(id=e.id, prompt_id=e.prompt.id, prompt=e.prompt.text, completion=e.text, answer=e.prompt.answer,
                   extra=e.prompt.extra)
            for group in groups if all(e.error is None for e in group) for e in group if e.reward is None]


@dataclass(frozen=True, kw_only=True)
class ScoreStats:
    groups: int
    groups_with_errors: int
    errors: list[str]
    """"prompt_id/k: why", for the log."""
    parts: dict[str, list[float]]
    """With several reward functions: each one's scores over the samples of the groups kept."""


def score_groups(groups: list[list[Episode]], results: list[RewardResult], *, weight_version: int,
                 batch: int = 0) -> tuple[list[ScoredGroup], ScoreStats]:
    """The episodes' groups as scored groups: each episode's reward the environment's, else its [reward]
    result; a group with an environment error or a reward error is held out (see the docstring)."""
    by_id = {r.id: r for r in results}
    scored, errors, bad = [], [], 0
    parts: dict[str, list[float]] = {}
    for group in groups:
        if any(e.error is not None for e in group):
            bad += 1
            continue
        results_of = {e.id: by_id[e.id] for e in group if e.reward is None}
        failed = [r for r in results_of.values() if r.reward is None]
        if failed:
            bad += 1
            errors += [f"{r.id}: {r.error}" for r in failed]
            continue
        for r in results_of.values():
            for name, value in (r.parts or {}).items():
                parts.setdefault(name, []).append(value)
        rewards = [e.reward if e.reward is not None else results_of[e.id].reward for e in group]
        rollouts = [e.rollout(float(reward)) for e, reward in zip(group, rewards) if reward is not None]
        versions = {v for e in group for v in e.versions}
        scored.append(ScoredGroup(prompt_id=group[0].prompt.id, rollouts=rollouts, batch=batch,
                                  weight_version=min(versions, default=weight_version)))
    return scored, ScoreStats(groups=len(groups), groups_with_errors=bad, errors=errors, parts=parts)


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
