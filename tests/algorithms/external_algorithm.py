"""An algorithm defined outside hpcrl, loaded as algorithm.name = "external_algorithm:ALGORITHM"
(tests/algorithms/test_external_algorithm.py): a REINFORCE with a fixed baseline, an option of its own."""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.algorithms.base import Algorithm, Groups, Options, Selection, option


@dataclass(frozen=True, kw_only=True)
class BaselineOptions(Options):
    """The shared keys and the baseline subtracted from every reward."""

    baseline: float = option(0.5, "Subtracted from every reward to give a rollout's advantage.", at_least=0)


def select(groups: Groups, settings: BaselineOptions, *, wanted: int | None = None) -> Selection:
    """Every group, each rollout's advantage its reward less the baseline."""
    return Selection(kept=list(range(len(groups))),
                     advantages=[[r.reward - settings.baseline for r in group] for group in groups])


def loss(**kwargs):
    """GRPO's per-token clipped ratio of those advantages."""
    from hpcrl.algorithms.terms import token_ratio_loss

    return token_ratio_loss(**kwargs)


ALGORITHM = Algorithm(name="baseline_reinforce", options=BaselineOptions, defaults={"clip_eps_high": 0.3},
                      select=select, loss=loss)
NOT_AN_ALGORITHM = "a string"
