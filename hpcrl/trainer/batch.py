"""The trainer's batch: right-padded token ids with per-token tensors aligned to them.

Layout (one row per rollout; B rows, T positions):

    tokens           [B, T] int64   the rollout's ids (prompt, the policy's turns, tool output), then padding
    completion_mask  [B, T] bool    True on the tokens the policy sampled (a rollout's policy mask)
    old_logprobs     [B, T] float   log p_old(tokens[b, t]) from vLLM where the mask is True
    advantages       [B]    float   one advantage per rollout (group advantages), or [B, T] per token
    ref_logprobs     [B, T] float   optional: reference logprobs (else the engine computes them)

Position t holds the value of token t, which the model predicts from the logits at t - 1; the
mask is therefore False at t = 0. Each trainer rank gets its own rows (`shard`), and the loss is
normalised over the whole step by the engine, so rows may be split unevenly.

Packed (trainer.micro_batch_tokens, issue 39): `pack(batch)` lays a micro-batch's rows end to end in one
row with no padding, each row up to its last policy token, positions restarting at 0 in each (RoPE) and
the rows' bounds for the attention, which stays within a row (hpcrl.trainer.titan). The model's per-position
outputs come back to the layout above through `Packing.unpack`, so an algorithm's loss sees the same
[B, T] tensors either way:

    rows      a a a a . .        packed    a a a a b b b c c c c c      positions  0 1 2 3 0 1 2 0 1 2 3 4
              b b b . . .                  |-------|-----|---------|    bounds     (0, 4, 7, 12)
              c c c c c .
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from hpcrl.errors import TrainerError


@dataclass(frozen=True, kw_only=True)
class RolloutBatch:
    tokens: Tensor
    """[B, T] int64 token ids, right-padded."""
    completion_mask: Tensor
    """[B, T] bool: True where tokens[b, t] was sampled by the policy (False at t = 0)."""
    old_logprobs: Tensor
    """[B, T] float: behaviour-policy logprob of tokens[b, t] where the mask is True."""
    advantages: Tensor
    """[B] (or [B, T]) float: advantage of each completion (or token)."""
    ref_logprobs: Tensor | None = None
    """[B, T] float: reference-policy logprobs, or None to let the engine compute them."""

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2:
            raise TrainerError(f"batch tokens must be [B, T], got shape {tuple(self.tokens.shape)}")
        shape = tuple(self.tokens.shape)
        for name in ("completion_mask", "old_logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise TrainerError(f"batch {name} has shape {tuple(value.shape)} but tokens {shape}; "
                                   "every per-token tensor is aligned with the token ids")
        if tuple(self.advantages.shape) not in ((shape[0],), shape):
            raise TrainerError(f"batch advantages have shape {tuple(self.advantages.shape)}; "
                               f"expected [{shape[0]}] (per completion) or {list(shape)} (per token)")
        if self.completion_mask.dtype != torch.bool:
            object.__setattr__(self, "completion_mask", self.completion_mask.bool())
        if shape[1] and bool(self.completion_mask[:, 0].any()):
            raise TrainerError("completion_mask is True at position 0, which no logits predict; "
                               "a completion follows at least one prompt token (e.g. <bos>)")

    @property
    def size(self) -> int:
        """Rows (completions) in the batch."""
        return self.tokens.shape[0]

    @property
    def lengths(self) -> Tensor:
        """[B] real length of each row: one past its last completion token (0 for an empty row)."""
        positions = torch.arange(1, self.tokens.shape[1] + 1).expand_as(self.completion_mask)
        return (positions * self.completion_mask).amax(dim=1) if self.size else torch.zeros(0, dtype=torch.long)

    def rows(self, start: int, stop: int) -> RolloutBatch:
        """Rows start..stop-1, trimmed to their longest real length (padding costs compute)."""
        return self._select(slice(start, stop), empty=stop <= start)

    def take(self, rows: list[int]) -> RolloutBatch:
        """These rows, in this order, trimmed to their longest real length."""
        return self._select(torch.tensor(rows, dtype=torch.long), empty=not rows)

    def _select(self, which: slice | Tensor, *, empty: bool) -> RolloutBatch:
        """The rows `which` (a slice: views; an index: copies), trimmed to their longest real length."""
        width = 2 if empty else max(int(self.lengths[which].max()), 2)
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                value = value[which]
                out[f.name] = value[:, :width] if value.dim() == 2 else value
        return RolloutBatch(**out)

    def micro_batches(self, size: int) -> list[RolloutBatch]:
        """Consecutive chunks of at most `size` rows."""
        return [self.rows(i, min(i + size, self.size)) for i in range(0, self.size, size)]

    def shard(self, rank: int, world_size: int) -> RolloutBatch:
        """This data-parallel rank's rows (torch.chunk-like: the first ranks get one more when uneven)."""
        base, extra = divmod(self.size, world_size)
        start = rank * base + min(rank, extra)
        stop = start + base + (1 if rank < extra else 0)
        return self.rows(start, stop) if stop > start else self.empty()

    def empty(self) -> RolloutBatch:
        """A batch with no rows (a rank that got none still joins the collectives)."""
        return RolloutBatch(tokens=self.tokens[:0, :2], completion_mask=self.completion_mask[:0, :2],
                            old_logprobs=self.old_logprobs[:0, :2], advantages=self.advantages[:0],
                            ref_logprobs=None if self.ref_logprobs is None else self.ref_logprobs[:0, :2])

    def to(self, device: torch.device) -> RolloutBatch:
        moved: dict[str, Any] = {f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                                 for f in fields(self)}
        return RolloutBatch(**moved)


@dataclass(frozen=True, kw_only=True)
class Packing:
    """A micro-batch's rows end to end in one row (see the module docstring)."""

    tokens: Tensor
    """[1, N] int64: each row's tokens up to its last policy token, row after row."""
    positions: Tensor
    """[1, N] int64: each token's position in its own row (0 at each row's first token)."""
    bounds: tuple[int, ...]
    """Where each packed row starts, then N: row i is tokens[0, bounds[i]:bounds[i + 1]]."""
    index: Tensor
    """[B, T] int64: where the value of token (b, t) is in the packed outputs, or N where none is (t = 0,
    padding, a row with no policy token); the output at packed position i is the prediction of token i + 1."""
    valid: Tensor
    """[1, N] bool: True on the rows' tokens (False only on the stand-in row of a micro-batch with none)."""

    def unpack(self, values: Tensor) -> Tensor:
        """[1, N] per-position outputs (a logprob of the next token) -> [B, T] aligned with the batch's
        tokens, 0 where no prediction belongs. Differentiable (a gather)."""
        flat = torch.cat([values.reshape(-1), values.new_zeros(1)])
        return flat[self.index]

    def to(self, device: torch.device) -> Packing:
        return Packing(tokens=self.tokens.to(device), positions=self.positions.to(device), bounds=self.bounds,
                       index=self.index.to(device), valid=self.valid.to(device))


def pack(batch: RolloutBatch) -> Packing:
    """The batch's rows packed end to end (a row without policy tokens leaves nothing). A batch with no
    token to pack gets one stand-in row of two padding ids, so that its forward still runs (an idle
    micro-batch joins FSDP's collectives); nothing reads its outputs."""
    lengths = batch.lengths.tolist()
    starts, offset = [], 0
    for n in lengths:
        starts.append(offset)
        offset += n
    total = offset
    index = torch.full(tuple(batch.tokens.shape), total, dtype=torch.long)
    pieces, positions = [], []
    for row, (start, n) in enumerate(zip(starts, lengths, strict=True)):
        if n:
            pieces.append(batch.tokens[row, :n])
            positions.append(torch.arange(n))
            index[row, 1:n] = torch.arange(start, start + n - 1)
    bounds = tuple(s for s, n in zip(starts, lengths, strict=True) if n) + (total,)
    valid = torch.ones(1, total, dtype=torch.bool)
    if not total:
        pieces, positions, bounds = [torch.zeros(2, dtype=torch.long)], [torch.arange(2)], (0, 2)
        valid = torch.zeros(1, 2, dtype=torch.bool)
        index.fill_(2)
    return Packing(tokens=torch.cat(pieces).view(1, -1), positions=torch.cat(positions).view(1, -1),
                   bounds=bounds, index=index, valid=valid)


def empty_batch() -> RolloutBatch:
    """No rows at all: what a trainer rank passes when the step's batch has no share for it."""
    return RolloutBatch(tokens=torch.zeros(0, 2, dtype=torch.long), completion_mask=torch.zeros(0, 2, dtype=torch.bool),
                        old_logprobs=torch.zeros(0, 2), advantages=torch.zeros(0))


def pad_masked_rows(sequences: list[list[int]], policy_masks: list[list[int]], logprobs: list[list[float]],
                    advantages: list, *, pad_id: int = 0) -> RolloutBatch:
    """A batch from Python lists (what TrainBatch carries): each sequence with one policy-mask entry and
    one logprob per token (the logprob counts only where the mask is 1), and one advantage per
    sequence or a list of one per token. No sequences: empty_batch()."""
    if not sequences:
        return empty_batch()
    width = max(len(s) for s in sequences)
    tokens = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.bool)
    old = torch.zeros(len(sequences), width)
    per_token = any(isinstance(a, list) for a in advantages)
    adv = torch.zeros(len(sequences), width) if per_token else torch.tensor(advantages, dtype=torch.float32)
    for i, (seq, flags, lps) in enumerate(zip(sequences, policy_masks, logprobs, strict=True)):
        if not len(seq) == len(flags) == len(lps) or (per_token and len(advantages[i]) != len(seq)):
            raise TrainerError(f"row {i}: {len(seq)} tokens with {len(flags)} mask entries and {len(lps)} logprobs"
                               + (f" and {len(advantages[i])} advantages" if per_token else "")
                               + "; give one of each per token")
        tokens[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = torch.tensor(flags, dtype=torch.bool)
        old[i, :len(seq)] = torch.tensor(lps, dtype=torch.float32)
        if per_token:
            adv[i, :len(seq)] = torch.tensor(advantages[i], dtype=torch.float32)
    return RolloutBatch(tokens=tokens, completion_mask=mask, old_logprobs=old, advantages=adv)


def pad_rows(sequences: list[list[int]], prompt_lengths: list[int], old_logprobs: list[list[float]],
             advantages: list[float], *, pad_id: int = 0) -> RolloutBatch:
    """A single-turn batch: each sequence is prompt + completion ids, with the completion's logprobs
    (one per completion token). Handy for tests and the engine's scoring; no sequences: empty_batch()."""
    for i, (seq, plen, lps) in enumerate(zip(sequences, prompt_lengths, old_logprobs, strict=True)):
        if plen < 1 or len(lps) != len(seq) - plen:
            raise TrainerError(f"row {i}: prompt length {plen} and {len(lps)} logprobs do not fit "
                               f"{len(seq)} tokens (need prompt >= 1 and one logprob per completion token)")
    masks = [[0] * plen + [1] * (len(seq) - plen) for seq, plen in zip(sequences, prompt_lengths)]
    logprobs = [[0.0] * plen + list(lps) for plen, lps in zip(prompt_lengths, old_logprobs)]
    return pad_masked_rows(sequences, masks, logprobs, advantages, pad_id=pad_id)
