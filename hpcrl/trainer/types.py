"""What the trainer group takes: plain data the head can build and send without importing torch.

    batch = batch_from_groups(groups, selection)          # hpcrl.rl.rollouts: a TrainBatch
    payload = batch.to_dict()                             # crosses the bus as plain lists
    rows = TrainBatch.from_dict(payload).shard(rank, world_size).rows()   # a trainer rank's RolloutBatch

A sequence is any token list with a per-token policy mask (hpcrl.algorithms.base.Rollout): a
single-turn rollout is prompt (mask 0) + completion (mask 1), a multi-turn one interleaves the
policy's turns (1) with tool output (0). `rows()` pads into the engine's tensors
(hpcrl.trainer.batch), importing torch only then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpcrl.trainer.batch import RolloutBatch


@dataclass(frozen=True, kw_only=True)
class TrainBatch:
    """Sequences of one optimizer step, in a fixed order; the trainer ranks split it by index."""

    prompt_ids: list[str]
    input_ids: list[list[int]]
    """Every token of each sequence (unpadded)."""
    policy_mask: list[list[int]]
    """1 where the policy generated the token (trained on), 0 elsewhere; one per token."""
    logprobs: list[list[float]]
    """The sampler's logprob of each token where policy_mask is 1 (behaviour policy), 0.0 elsewhere."""
    advantages: list
    """One float per sequence, or a list of one float per token for per-token advantages."""
    rewards: list[float]

    def __len__(self) -> int:
        return len(self.input_ids)

    def shard(self, rank: int, world_size: int) -> TrainBatch:
        """Rank `rank`'s contiguous share, split like torch.chunk (later ranks may get fewer, or none)."""
        size = -(-len(self) // world_size)
        part = slice(min(rank * size, len(self)), min((rank + 1) * size, len(self)))
        return TrainBatch(**{k: getattr(self, k)[part] for k in self.__dataclass_fields__})

    def lengths(self) -> list[int]:
        """Tokens of each sequence up to its last policy token (what the trainer computes; 0: none)."""
        return [max((i + 1 for i, flag in enumerate(mask) if flag), default=0) for mask in self.policy_mask]

    def take(self, rows: list[int]) -> TrainBatch:
        """These sequences, in this order."""
        return TrainBatch(**{k: [getattr(self, k)[i] for i in rows] for k in self.__dataclass_fields__})

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def rows(self) -> RolloutBatch:
        """The trainer's padded tensors of these sequences."""
        from hpcrl.trainer.batch import pad_masked_rows  # torch: on the trainer side only, not in the head

        return pad_masked_rows(self.input_ids, self.policy_mask, self.logprobs, self.advantages)

    @classmethod
    def from_dict(cls, data: dict) -> TrainBatch:
        return cls(**data)
