"""What every algorithm is made of, in plain Python (no torch): the rollout, settings, the interface.

    Rollout     one sample: a token sequence, which tokens the policy generated, their logprobs, a reward
    Settings    the head's knobs (group size, filtering, dynamic sampling, reward shaping)
    LossSettings the trainer's knobs (clips, KL, aggregation), carried by EngineOptions
    LossShare   what a loss returns: a micro-batch's share of the step loss and its metrics
    Selection   what an algorithm makes of a batch's scored groups: the groups kept, their advantages
    Algorithm   the three things an algorithm module says (see hpcrl.algorithms)

A rollout is a sequence with a per-token policy mask rather than "prompt + completion", so a
multi-turn environment (model turn, tool output, model turn) only fills it differently: tool tokens
are in the sequence with mask 0 and are neither trained on nor compared with the sampler.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from hpcrl.errors import HpcrlError

if TYPE_CHECKING:
    from torch import Tensor

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]
AdvantageNorm = Literal["mean_std", "mean"]
"""How rewards are normalised within a group (config key algorithm.advantage_norm)."""
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


# ------------------------------------------------------------------------------------ rollout

@dataclass(frozen=True, kw_only=True)
class Rollout:
    """One sample of a group: its tokens, which of them the policy generated, and its reward.

    `policy_mask[t]` is 1 where the policy sampled `tokens[t]` (those tokens are trained on and
    their `logprobs[t]` is the sampler's logprob), 0 on prompt, tool output and any other token
    the policy did not choose (logprob 0.0 there). All three lists have one entry per token.
    """

    tokens: list[int]
    policy_mask: list[int]
    logprobs: list[float]
    reward: float
    finish_reason: str = ""

    def __post_init__(self) -> None:
        if not len(self.tokens) == len(self.policy_mask) == len(self.logprobs):
            raise HpcrlError(f"a rollout of {len(self.tokens)} tokens has {len(self.policy_mask)} mask entries "
                             f"and {len(self.logprobs)} logprobs; give one of each per token")
        if self.policy_mask[:1] == [1]:
            raise HpcrlError("a rollout's first token is marked as generated, which no logits predict; "
                             "it starts with at least one prompt token (e.g. <bos>)")

    @classmethod
    def single_turn(cls, prompt: list[int], completion: list[int], logprobs: list[float], *, reward: float,
                    finish_reason: str = "") -> Rollout:
        """One prompt and the policy's completion: mask 0 on the prompt, 1 on the completion."""
        if len(logprobs) != len(completion):
            raise HpcrlError(f"{len(logprobs)} logprobs for a completion of {len(completion)} tokens; "
                             "give one per completion token")
        return cls(tokens=prompt + completion, policy_mask=[0] * len(prompt) + [1] * len(completion),
                   logprobs=[0.0] * len(prompt) + list(logprobs), reward=reward, finish_reason=finish_reason)

    @property
    def generated(self) -> int:
        """Tokens the policy generated (the length the token budget and the overlong shaping count)."""
        return sum(self.policy_mask)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: dict) -> Rollout:
        return cls(**data)


# ----------------------------------------------------------------------------------- settings

@dataclass(frozen=True, kw_only=True)
class Settings:
    """The head's side of an algorithm (from [algorithm] and inference.max_tokens)."""

    group_size: int = 8
    advantage_norm: AdvantageNorm = "mean_std"
    filter_zero_variance: bool = False
    """Train only on groups whose rewards differ."""
    dynamic_sampling: bool = False
    """Refill groups that filtering drops by generating more prompts (DAPO)."""
    max_sampling_rounds: int = 1
    """Most generate rounds for one batch with dynamic sampling (the first included)."""
    overlong_buffer_fraction: float = 0.0
    """Share of max_tokens at the end of the budget over which the overlong penalty ramps; 0 = none."""
    overlong_penalty: float = 1.0
    """The penalty of a completion that reaches max_tokens (DAPO: 1)."""
    max_tokens: int = 1
    """Most tokens the policy generates per rollout (inference.max_tokens)."""

    @classmethod
    def from_config(cls, config) -> Settings:
        """From an `hpcrl.config.schema.Config` (its [algorithm] table and inference.max_tokens)."""
        a = config.algorithm
        return cls(group_size=a.group_size, advantage_norm=a.advantage_norm,
                   filter_zero_variance=a.filter_zero_variance, dynamic_sampling=a.dynamic_sampling,
                   max_sampling_rounds=a.max_sampling_rounds, overlong_buffer_fraction=a.overlong_buffer_fraction,
                   overlong_penalty=a.overlong_penalty, max_tokens=config.inference.max_tokens)


@dataclass(frozen=True, kw_only=True)
class LossSettings:
    """The trainer's side of an algorithm: which loss, and its knobs."""

    algorithm: str = "grpo"
    """algorithm.name: whose `loss` the engine calls."""
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
    max_tokens: int = 0
    """The constant length of seq_mean_token_sum_norm (inference.max_tokens)."""

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise HpcrlError(f"unknown loss aggregation {self.aggregation!r}; use one of {', '.join(AGGREGATIONS)}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise HpcrlError(f"unknown KL estimator {self.kl_estimator!r}; use one of {', '.join(KL_ESTIMATORS)}")
        if self.aggregation == "seq_mean_token_sum_norm" and self.max_tokens < 1:
            raise HpcrlError("seq_mean_token_sum_norm divides by max_tokens, which is not set; pass "
                             "LossSettings(max_tokens=inference.max_tokens)")

    @classmethod
    def from_config(cls, algorithm, *, max_tokens: int = 0) -> LossSettings:
        """From an `hpcrl.config.schema.AlgorithmConfig` (and inference.max_tokens)."""
        return cls(algorithm=algorithm.name, clip_eps_low=algorithm.clip_eps_low,
                   clip_eps_high=algorithm.clip_eps_high, kl_coef=algorithm.kl_coef,
                   kl_estimator=algorithm.kl_estimator, aggregation=algorithm.loss_aggregation,
                   max_tokens=max_tokens)


# ---------------------------------------------------------------------------------- interface

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



@dataclass(frozen=True, kw_only=True)
class Selection:
    """An algorithm's reading of one batch of scored groups."""

    kept: list[int]
    """Indices of the groups to train on, in batch order."""
    advantages: list[list[Any]]
    """For each kept group, one entry per rollout: a float (per sequence) or a list with one float
    per token of the rollout (per token)."""
    dropped_zero_variance: int = 0
    """Groups left out because their rewards were all equal."""


Groups = list[list[Rollout]]


def one_round(groups: Groups, settings: Settings, *, wanted: int, rounds_done: int) -> int:
    """No dynamic sampling: a batch is the prompts of one generate round."""
    return 0


@dataclass(frozen=True, kw_only=True)
class Algorithm:
    """What an algorithm module defines as ALGORITHM."""

    name: str
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """[algorithm] keys this algorithm sets unless the user set them (config/load.py merges them)."""
    select: Callable[..., Selection]
    """Head: the groups of a batch to train on and their advantages, called as
    select(groups, settings, wanted=prompts per step)."""
    loss: Callable[..., LossShare]
    """Trainer: this micro-batch's share of the step loss, called as
    loss(logprobs=, old_logprobs=, advantages=, mask=, settings=, norm=, ref_logprobs=)."""
    more_prompts: Callable[..., int] = one_round
    """Head, after each generate round of a batch: how many more prompts to generate (0 = the batch
    is complete), called as more_prompts(groups_so_far, settings, wanted=, rounds_done=)."""

