"""Scored GRPO groups waiting to be trained on, bounded by the policy lag.

A group is the `group_size` completions of one prompt, scored, with the weight version that
generated them. The trainer is at version v (v optimizer steps done); a group generated at
version g may be trained on only while v - g <= max_policy_lag. Older groups are dropped and
counted — with max_policy_lag >= 1, rollouts of step k+1 overlap training of step k.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class ScoredGroup:
    prompt_id: str
    prompt_token_ids: list[int]
    completions: list[list[int]]
    logprobs: list[list[float]]
    rewards: list[float]
    weight_version: int
    batch: int = 0
    """Index of the batch (= the training step) this group belongs to."""
    finish_reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: dict) -> ScoredGroup:
        return cls(**data)


class ReplayBuffer:
    """FIFO of scored groups with the staleness bound of the module docstring."""

    def __init__(self, *, max_policy_lag: int) -> None:
        self.max_policy_lag = max_policy_lag
        self._groups: deque[ScoredGroup] = deque()
        self.dropped_stale = 0

    def __len__(self) -> int:
        return len(self._groups)

    def put(self, group: ScoredGroup) -> None:
        self._groups.append(group)

    def _drop_stale(self, trainer_version: int) -> None:
        kept = deque(g for g in self._groups if trainer_version - g.weight_version <= self.max_policy_lag)
        self.dropped_stale += len(self._groups) - len(kept)
        self._groups = kept

    def ready(self, count: int, trainer_version: int) -> bool:
        self._drop_stale(trainer_version)
        return len(self._groups) >= count

    def take(self, count: int, trainer_version: int) -> list[ScoredGroup]:
        """The oldest `count` fresh-enough groups (fewer if there are not that many)."""
        self._drop_stale(trainer_version)
        return [self._groups.popleft() for _ in range(min(count, len(self._groups)))]

    def take_batch(self, batch: int, trainer_version: int) -> list[ScoredGroup]:
        """Every fresh-enough group of batch `batch`, in the order they were put."""
        self._drop_stale(trainer_version)
        taken = [g for g in self._groups if g.batch == batch]
        self._groups = deque(g for g in self._groups if g.batch != batch)
        return taken

    def state_dict(self) -> dict:
        return {"groups": [g.to_dict() for g in self._groups], "dropped_stale": self.dropped_stale}

    def load_state_dict(self, state: dict) -> None:
        self._groups = deque(ScoredGroup.from_dict(g) for g in state["groups"])
        self.dropped_stale = int(state["dropped_stale"])
