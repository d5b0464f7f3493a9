"""Which rows of a step's batch go to which trainer rank, in which micro-batch (issue 39). Pure.

With `trainer.micro_batch_tokens` set, the trainer packs rollouts into micro-batches of at most that many
tokens (hpcrl.trainer.batch.pack). Two questions are planned here, from the rows' lengths only:

    lengths (tokens of each row)  --pack_rows-->  bins: micro-batches of rows, each <= budget tokens
    bins  --assign to ranks-->  every rank the same count of micro-batches (an empty one where a rank is short)
                                and about the same tokens

`pack_rows` is first-fit decreasing: rows longest first (ties by index), each into the first bin it fits.

`plan_micro_batches` first picks the bin size: k = ceil(tokens / (ranks x budget)) micro-batches per rank, and
the smallest budget at or below `budget` whose first-fit decreasing makes at most ranks x k bins, so the bins
are about equally full; then it deals the bins, fullest first, each to the rank with the fewest tokens among
those with fewer than k. Rows of length 0 (no policy token: nothing to train) are left out. Each rank's rows
and micro-batches go to its engine as planned (hpcrl.trainer.engine TrainerEngine.train_share).

    plan = plan_micro_batches([12, 300, 40, 7], ranks=2, budget=512)
    plan.ranks[0]      # ((1,),)             rank 0: one micro-batch of row 1
    plan.ranks[1]      # ((2, 0, 3),)        rank 1: rows 2, 0 and 3 side by side
    plan.tokens()      # (300, 59)

Run the tests: `python -m pytest tests/plan/test_micro_batches.py -q`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hpcrl.errors import PlanError


@dataclass(frozen=True)
class MicroBatchPlan:
    """rank -> its micro-batches -> the rows (indices into the step's batch) of each, every rank the same count."""

    lengths: tuple[int, ...]
    """Tokens of each row of the step's batch."""
    budget: int
    """Most tokens of one micro-batch (the bins' size the plan used, at most the asked budget)."""
    ranks: tuple[tuple[tuple[int, ...], ...], ...]
    """ranks[r][m]: the rows of rank r's micro-batch m, in packing order (an empty tuple: an idle micro-batch)."""

    def rows(self, rank: int) -> tuple[int, ...]:
        """Rank `rank`'s rows, micro-batch after micro-batch."""
        return tuple(row for micro in self.ranks[rank] for row in micro)

    def tokens(self) -> tuple[int, ...]:
        """Tokens of each rank."""
        return tuple(sum(self.lengths[row] for micro in rank for row in micro) for rank in self.ranks)


def pack_rows(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Rows into bins of at most `budget` tokens, first-fit decreasing (see the module docstring); bins in the
    order they were opened, each bin's rows longest first. Rows of length 0 are left out."""
    if budget < 1:
        raise PlanError(f"a micro-batch token budget must be at least 1, got {budget}")
    longest = max(lengths, default=0)
    if longest > budget:
        raise PlanError(f"row {list(lengths).index(longest)} has {longest} tokens, more than the micro-batch "
                        f"budget of {budget}: raise trainer.micro_batch_tokens to at least {longest}")
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted((r for r, n in enumerate(lengths) if n > 0), key=lambda r: (-lengths[r], r)):
        n = lengths[row]
        for b, left in enumerate(room):
            if n <= left:
                bins[b].append(row)
                room[b] -= n
                break
        else:
            bins.append([row])
            room.append(budget - n)
    return bins


def plan_micro_batches(lengths: Sequence[int], *, ranks: int, budget: int) -> MicroBatchPlan:
    """Rows of lengths `lengths` over `ranks` data-parallel ranks, in micro-batches of at most `budget` tokens,
    every rank the same count of micro-batches and about the same tokens (see the module docstring)."""
    if ranks < 1:
        raise PlanError(f"a plan needs at least one rank, got {ranks}")
    lengths = tuple(int(n) for n in lengths)
    bins = pack_rows(lengths, budget)  # raises on a row over the budget
    per_rank = max(1, -(-sum(lengths) // (ranks * budget)))
    size = max(1, max(lengths, default=1), -(-sum(lengths) // (ranks * per_rank)))
    while size < budget:
        bins = pack_rows(lengths, size)
        if len(bins) <= ranks * per_rank:
            break
        size = min(budget, size + max(1, size // 64))
    else:
        size = budget
        bins = pack_rows(lengths, budget)
    per_rank = max(per_rank, -(-len(bins) // ranks))
    order = sorted(range(len(bins)), key=lambda b: (-sum(lengths[r] for r in bins[b]), b))
    dealt: list[list[int]] = [[] for _ in range(ranks)]
    tokens = [0] * ranks
    for b in order:
        rank = min((r for r in range(ranks) if len(dealt[r]) < per_rank), key=lambda r: (tokens[r], r))
        dealt[rank].append(b)
        tokens[rank] += sum(lengths[row] for row in bins[b])
    # each rank's bins in the order they were opened, so its own first-fit decreasing finds them again
    plan = tuple(tuple(tuple(bins[b]) for b in sorted(mine)) + ((),) * (per_rank - len(mine)) for mine in dealt)
    return MicroBatchPlan(lengths=lengths, budget=size, ranks=plan)


def plan_by_rows(lengths: Sequence[int], *, ranks: int, micro_batch_size: int) -> MicroBatchPlan:
    """The row-count split for comparison (what `trainer.micro_batch_size` does): contiguous shares, the first
    ranks one row more when uneven, cut into micro-batches of `micro_batch_size` consecutive rows."""
    lengths = tuple(int(n) for n in lengths)
    base, extra = divmod(len(lengths), ranks)
    shares, start = [], 0
    for rank in range(ranks):
        stop = start + base + (1 if rank < extra else 0)
        shares.append([tuple(range(i, min(i + micro_batch_size, stop))) for i in range(start, stop, micro_batch_size)])
        start = stop
    most = max(len(s) for s in shares)
    return MicroBatchPlan(lengths=lengths, budget=0,
                          ranks=tuple(tuple(s) + ((),) * (most - len(s)) for s in shares))
