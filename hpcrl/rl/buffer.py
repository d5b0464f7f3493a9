"""Scored groups waiting to be trained on, bounded by the policy lag.

A group is the `group_size` rollouts of one prompt, scored, with the weight version that
generated them. The trainer is at version v (v optimizer steps done); a group generated at
version g may be trained on only while v - g <= max_policy_lag. Older groups are dropped and
counted — with max_policy_lag >= 1, rollouts of step k+1 overlap training of step k.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hpcrl.algorithms.base import Rollout


@dataclass(frozen=True, kw_only=True)
class ScoredGroup:
    """The scored rollouts of one prompt (hpcrl.algorithms.base.Rollout: tokens, policy mask, logprobs, reward)."""

    prompt_id: str
    rollouts: list[Rollout]
    weight_version: int
    batch: int = 0
    """Index of the batch (= the training step) this group belongs to."""

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]

    def to_dict(self) -> dict:
        return {"prompt_id": self.prompt_id, "rollouts": [r.to_dict() for r in self.rollouts],
                "weight_version": self.weight_version, "batch": self.batch}

    @classmethod
    def from_dict(cls, data: dict) -> ScoredGroup:
        """From `to_dict`, or from a checkpoint written before rollouts had a policy mask (a prompt and
        one completion per sample), which resumes as single-turn rollouts."""
        if "rollouts" in data:
            rollouts = [Rollout.from_dict(r) for r in data["rollouts"]]
        else:
            reasons = data.get("finish_reasons") or [""] * len(data["completions"])
            rollouts = [Rollout.single_turn(data["prompt_token_ids"], tokens, logprobs, reward=reward,
                                            finish_reason=reason)
                        for tokens, logprobs, reward, reason in zip(data["completions"], data["logprobs"],
                                                                     data["rewards"], reasons, strict=True)]
        return cls(prompt_id=data["prompt_id"], rollouts=rollouts, weight_version=data["weight_version"],
                   batch=data.get("batch", 0))


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
