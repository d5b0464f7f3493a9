"""Evaluation on the held-out prompts while a run trains ([eval]): pass@1, pass@k, mean reward and length.

    outcomes = prompt_outcomes(episodes, results)                      # per prompt: rewards and lengths
    figures = eval_metrics(greedy=outcomes, sampled=None, k=0, threshold=1.0)
    pass_at_k(n=8, c=3, k=4)                                           # 1 - C(5, 4) / C(8, 4) = 13/14

pass@k is the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models Trained on
Code"): of n completions of a prompt c pass, and 1 - C(n - c, k) / C(n, k) is the chance that k of
them, drawn without replacement, hold at least one that passes; the figure is its mean over the
prompts. It uses every one of the n samples, where "pass@k over k samples" would throw n - k away,
and its mean is the pass@k of the policy whatever n >= k is. A completion passes when its reward is
at least eval.pass_threshold.

A completion whose reward could not be computed (the verifier raised, hung or died) is never scored
zero, as in training: its prompt is left out of the pass figures and the sample is counted in
eval/reward_errors, so a broken verifier shows instead of reading as a bad policy.

The controller (hpcrl.rl.controller) makes the calls: the held-out prompts' episodes (hpcrl.rl.episodes, as
a batch's: one turn, or with [env] the environment's) on the inference group with the weights just synced,
scored with the run's reward; these functions only count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpcrl.reward.types import RewardResult
from hpcrl.rl.episodes import Episode

#: Evaluation sampling seeds sit this far above every training seed (run.seed x 1,000,003 + batch + round x
#: 1,000,000,007, below 2**60 short of a billion sampling rounds), so an evaluation never draws a training
#: batch's random numbers; with run.seed < 2**32 they stay below 2**63 (msgpack's and vLLM's int64).
EVAL_SEED_OFFSET = 1 << 60


def eval_seed(run_seed: int, step: int) -> int:
    """The sampling seed of the evaluation after `step`: fixed by (run.seed, step), so a resume repeats it."""
    return EVAL_SEED_OFFSET + run_seed * 1_000_003 + step


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with `c` passing of `n` completions (module docstring)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a passing completion
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # exact integers, one correctly rounded division


@dataclass(frozen=True)
class PromptOutcome:
    """One prompt's evaluation completions: their rewards (None where the reward errored) and lengths in tokens."""

    rewards: list[float | None]
    lengths: list[int]

    @property
    def scored(self) -> bool:
        return all(r is not None for r in self.rewards)

    def passed(self, threshold: float) -> int:
        return sum(1 for r in self.rewards if r is not None and r >= threshold)


def prompt_outcomes(groups: list[list[Episode]], results: list[RewardResult]) -> list[PromptOutcome]:
    """Each prompt's episodes (hpcrl.rl.episodes) with their rewards (the environment's, else the [reward]
    result of sample id "prompt_id/k"; None without an outcome, which leaves the prompt out) and their lengths
    (the tokens the policy generated)."""
    by_id = {r.id: r for r in results}
    outcomes = []
    for group in groups:
        rewards: list[float | None] = []
        for e in group:
            result = by_id.get(e.id)
            rewards.append(None if e.error is not None else e.reward if e.reward is not None
                           else result.reward if result is not None else None)
        outcomes.append(PromptOutcome(rewards=rewards, lengths=[sum(e.mask) for e in group]))
    return outcomes


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _pass_mean(outcomes: list[PromptOutcome], k: int, threshold: float) -> float | None:
    """Mean pass@k over the prompts whose every completion was scored; None when there is none."""
    return _mean([pass_at_k(len(o.rewards), o.passed(threshold), k) for o in outcomes if o.scored])


def eval_metrics(*, greedy: list[PromptOutcome] | None, sampled: list[PromptOutcome] | None, k: int,
                 threshold: float) -> dict[str, float | int | None]:
    """The metrics of one evaluation.

    eval/pass@1, eval/reward_mean and eval/length_mean are of the greedy completions when there are any,
    else of the sampled ones; eval/pass@K (K = k > 1) of the sampled ones, and with both, the sampled
    completions' pass@1 as eval/sampled_pass@1. eval/prompts: the prompts eval/pass@1 counts;
    eval/reward_errors: completions (greedy and sampled) whose reward errored."""
    primary = greedy if greedy is not None else sampled
    if primary is None:
        raise ValueError("an evaluation needs greedy or sampled completions")
    rewards = [r for o in primary for r in o.rewards if r is not None]
    metrics: dict[str, float | int | None] = {
        "eval/pass@1": _pass_mean(primary, 1, threshold),
        "eval/reward_mean": _mean(rewards),
        "eval/length_mean": _mean([float(n) for o in primary for n in o.lengths]),
        "eval/prompts": sum(1 for o in primary if o.scored),
        "eval/reward_errors": sum(1 for part in (greedy, sampled) if part is not None
                                  for o in part for r in o.rewards if r is None),
    }
    if sampled is not None:
        if greedy is not None:
            metrics["eval/sampled_pass@1"] = _pass_mean(sampled, 1, threshold)
        if k > 1:
            metrics[f"eval/pass@{k}"] = _pass_mean(sampled, k, threshold)
    return metrics
