"""DAPO (Yu et al. 2025): GRPO with dynamic sampling, clip-higher, token-level loss, overlong shaping.

    samples     group_size completions of each prompt. Dynamic sampling: a group whose (shaped)
                rewards are all equal has no signal and is filtered out; the batch is refilled by
                generating more prompts, round after round, until `wanted` groups have a signal or
                max_sampling_rounds rounds ran; the first `wanted` groups with a signal train.
    rewards     overlong shaping: a completion that reaches into the last B = overlong_buffer_fraction
                x max_tokens tokens of the budget gets a penalty ramping linearly from 0 to
                -overlong_penalty at max_tokens (DAPO eq. 13: (L_max - B - |y|) / B in the buffer)
    advantages  per sequence, GRPO's (r - mean) / (std + 1e-6) of the shaped rewards
    loss        per-token clipped ratio with clip-higher (eps_high 0.28 > eps_low 0.2), aggregated
                over all tokens of the step (token_mean), no KL (kl_coef = 0)

Which prompts each round draws and its sampling seed are fixed by (batch, round) in the controller
(hpcrl.rl.controller), so a resumed run generates the same rounds. The reward metrics stay those
the reward group gave (unshaped) over every round.
Run the tests: `python -m pytest tests/algorithms/test_dapo.py -q`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpcrl.algorithms.base import Algorithm, Groups, LossShare, Options, Rollout, Selection, option
from hpcrl.algorithms.grpo import GrpoOptions
from hpcrl.errors import ConfigError

if TYPE_CHECKING:
    from torch import Tensor

    from hpcrl.algorithms.terms import Normaliser



@dataclass(frozen=True, kw_only=True)
class DapoOptions(GrpoOptions):
    """[algorithm] of DAPO: GRPO's keys, dynamic sampling and overlong shaping."""

    dynamic_sampling: bool = option(False, "Refill the groups that filter_zero_variance drops by generating more "
                                           "prompts.")
    max_sampling_rounds: int = option(1, "With dynamic_sampling: most generate rounds for one batch, the first "
                                         "included.", at_least=1)
    overlong_buffer_fraction: float = option(
        0.0, "Overlong reward shaping: a completion reaching into the last this-share of inference.max_tokens gets a "
             "penalty ramping to -overlong_penalty at max_tokens; 0 = none.", at_least=0, below=1, example=0.2)
    overlong_penalty: float = option(1.0, "The overlong penalty at inference.max_tokens.", at_least=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dynamic_sampling and not self.filter_zero_variance:
            raise ConfigError(key="dynamic_sampling",
                              problem="refills the groups that filtering drops, but filter_zero_variance = false "
                                      "drops none", fix="set filter_zero_variance = true, or dynamic_sampling = false")
        if self.dynamic_sampling and self.partial_rollouts:
            raise ConfigError(key="dynamic_sampling", problem="draws more prompts until the batch is full, and with "
                              "partial_rollouts a batch is the groups that finish in its generation",
                              fix="set dynamic_sampling = false, or partial_rollouts = false")

    def check_episodes(self) -> None:
        super().check_episodes()
        if self.overlong_buffer_fraction > 0:
            raise ConfigError(key="overlong_buffer_fraction",
                              problem=f"is {self.overlong_buffer_fraction}: overlong shaping measures one completion "
                                      "against inference.max_tokens, and an episode's policy tokens span several turns "
                                      "(env.max_tokens bounds them)", fix="set algorithm.overlong_buffer_fraction = 0.0")


DEFAULTS = {"clip_eps_high": 0.28, "loss_aggregation": "token_mean", "filter_zero_variance": True,
            "dynamic_sampling": True, "max_sampling_rounds": 4, "overlong_buffer_fraction": 0.2,
            "overlong_penalty": 1.0}


def overlong_penalty(generated: int, *, max_tokens: int, buffer: int, penalty: float) -> float:
    """The reward added to a rollout of `generated` tokens: 0 before the buffer's start
    (max_tokens - buffer), then linearly down to -penalty at max_tokens (and beyond)."""
    start = max_tokens - buffer
    if buffer <= 0 or generated <= start:
        return 0.0
    if generated >= max_tokens:
        return -penalty
    return (start - generated) / buffer * penalty


def shaped_rewards(groups: Groups, settings: DapoOptions) -> list[list[float]]:
    """Each rollout's reward plus its overlong penalty, per group."""
    buffer = int(settings.overlong_buffer_fraction * settings.max_tokens)

    def shaped(rollout: Rollout) -> float:
        return rollout.reward + overlong_penalty(rollout.generated, max_tokens=settings.max_tokens, buffer=buffer,
                                                 penalty=settings.overlong_penalty)

    return [[shaped(r) for r in group] for group in groups]


def _with_signal(rewards: list[list[float]]) -> int:
    return sum(1 for group in rewards if any(r != group[0] for r in group))


def more_prompts(groups: Groups, settings: DapoOptions, *, wanted: int, rounds_done: int) -> int:
    """Prompts of the next round: enough to fill the batch at the signal rate seen so far (a whole
    batch while no group had a signal), or 0 once `wanted` groups have one or the rounds ran out."""
    have = _with_signal(shaped_rewards(groups, settings)) if settings.filter_zero_variance else len(groups)
    if not settings.dynamic_sampling or have >= wanted or rounds_done >= settings.max_sampling_rounds:
        return 0
    if have == 0:
        return wanted
    return min(wanted, math.ceil((wanted - have) * len(groups) / have))


def max_rounds(settings: DapoOptions) -> int:
    """With dynamic sampling, max_sampling_rounds; else one."""
    return settings.max_sampling_rounds if settings.dynamic_sampling else 1


def select(groups: Groups, settings: DapoOptions, *, wanted: int | None = None) -> Selection:
    """The first `wanted` groups whose shaped rewards differ, with GRPO advantages of those rewards."""
    from hpcrl.algorithms.terms import group_selection

    return group_selection(shaped_rewards(groups, settings), norm=settings.advantage_norm,
                           filter_zero_variance=settings.filter_zero_variance, wanted=wanted)


def loss(*, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, settings: Options,
         norm: Normaliser, ref_logprobs: Tensor | None = None) -> LossShare:
    """This micro-batch's share of the step's DAPO loss: the per-token clipped ratio with the
    clip-higher and token-level aggregation of `settings` (DEFAULTS)."""
    from hpcrl.algorithms.terms import token_ratio_loss

    return token_ratio_loss(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
                            settings=settings, norm=norm, ref_logprobs=ref_logprobs)


ALGORITHM = Algorithm(name="dapo", options=DapoOptions, defaults=DEFAULTS, select=select, loss=loss,
                      more_prompts=more_prompts, max_rounds=max_rounds)
