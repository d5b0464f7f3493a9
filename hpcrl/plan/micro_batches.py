"""Which rows of a step's batch go to which trainer rank, in which micro-batch (issue 39). Pure.

With `trainer.micro_batch_tokens` set, the trainer packs rollouts into micro-batches of at most that many
tokens (hpcrl.trainer.batch.pack). Two questions are planned here, from the rows' lengths only:

    lengths (tokens of each row)  --pack_rows-->  bins: micro-batches of rows, each <= budget tokens
    bins  --assign to ranks-->  every rank the same count of micro-batches (an empty one where a rank is short)
                                and about the same tokens

`pack_rows` is first-fit decreasing: rows longest first (ties by index), each into the first bin it fits.

`plan_micro_batches` first deals the rows to the ranks, longest first, each to the rank with the fewest tokens so
far (longest processing time first): the ranks get about the same tokens, and also about the same count of rows
and of long rows, so the work that grows faster than the tokens (attention, over each rollout's length squared;
a call per rollout) is even too. Dealing whole bins instead gave one rank the long rows' bins: on the repeat_x
batch of tools/bench/bench_packing.py, 28 rows against 100 and 1.7x the sum of squared lengths, for equal
tokens. Then each rank packs its rows, first-fit decreasing, into bins of the smallest size at or below `budget`
at which every rank makes at most k = ceil(the busiest rank's tokens / budget) of them (bins about equally
full); a rank with fewer bins than the others gets idle ones, so every rank runs the same count and the
collectives line up. Rows of length 0 (no policy token: nothing to train) are left out. Each rank's rows and
micro-batches go to its engine as planned (hpcrl.trainer.engine TrainerEngine.train_share).

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
    every rank the same count of micro-batches and about the same tokens, rows and long rows (see the module
    docstring)."""
    if ranks < 1:
        raise PlanError(f"a plan needs at least one rank, got {ranks}")
    lengths = tuple(int(n) for n in lengths)
    pack_rows(lengths, budget)  # raises on a row over the budget
    # Rows to ranks, longest first, each to the rank with the fewest tokens so far (ties: the lower rank).
    shares: list[set[int]] = [set() for _ in range(ranks)]
    tokens = [0] * ranks
    for row in sorted((r for r, n in enumerate(lengths) if n > 0), key=lambda r: (-lengths[r], r)):
        rank = min(range(ranks), key=lambda r: (tokens[r], r))
        shares[rank].add(row)
        tokens[rank] += lengths[row]
    # The bin size: the smallest at or below the budget at which every rank's first-fit decreasing makes at most
    # ceil(its tokens / budget) bins of the busiest rank, so the bins are about equally full.
    per_rank = max(1, -(-max(tokens) // budget))
    size = max(1, max(lengths, default=1), -(-max(tokens) // per_rank))
    while True:
        packed = [pack_rows([n if r in share else 0 for r, n in enumerate(lengths)], min(size, budget))
                  for share in shares]
        if size >= budget or all(len(bins) <= per_rank for bins in packed):
            break
        size = min(budget, size + max(1, size // 64))
    per_rank = max(per_rank, max(len(bins) for bins in packed))
    plan = tuple(tuple(tuple(b) for b in bins) + ((),) * (per_rank - len(bins)) for bins in packed)
    return MicroBatchPlan(lengths=lengths, budget=min(size, budget), ranks=plan)


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
