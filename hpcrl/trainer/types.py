"""What the trainer group takes: plain data the head can build and send without importing torch.

    batch = build_batch(groups, ...)                      # hpcrl.rl.rollouts: a TrainBatch
    payload = batch.to_dict()                             # crosses the bus as plain lists
    rows = TrainBatch.from_dict(payload).shard(rank, world_size).rows()   # a trainer rank's RolloutBatch

`rows()` pads into the engine's tensors (hpcrl.trainer.batch), importing torch only then.
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
    """prompt + completion tokens of each sequence (unpadded)."""
    prompt_lengths: list[int]
    old_logprobs: list[list[float]]
    """vLLM's logprob of each completion token (behaviour policy)."""
    advantages: list[float]
    rewards: list[float]

    def __len__(self) -> int:
        return len(self.input_ids)

    def shard(self, rank: int, world_size: int) -> TrainBatch:
        """Rank `rank`'s contiguous share, split like torch.chunk (later ranks may get fewer, or none)."""
        size = -(-len(self) // world_size)
        part = slice(min(rank * size, len(self)), min((rank + 1) * size, len(self)))
        return TrainBatch(**{k: getattr(self, k)[part] for k in self.__dataclass_fields__})

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def rows(self) -> RolloutBatch:
        """The trainer's padded tensors of these sequences."""
        from hpcrl.trainer.batch import pad_rows  # torch: on the trainer side only, not in the head

        return pad_rows(self.input_ids, self.prompt_lengths, self.old_logprobs, self.advantages)

    @classmethod
    def from_dict(cls, data: dict) -> TrainBatch:
        return cls(**data)
