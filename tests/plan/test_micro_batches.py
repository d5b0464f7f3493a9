"""The token-budget plan (hpcrl/plan/micro_batches.py): rows into micro-batches and micro-batches onto ranks."""

from __future__ import annotations

import random

import pytest

from hpcrl.errors import PlanError
from hpcrl.plan.micro_batches import pack_rows, plan_by_rows, plan_micro_batches


def skewed_lengths(count: int, seed: int = 0) -> list[int]:
    """Rollouts of builtin:repeat_x's shape: a 7-token prompt and 1 to 257 completion tokens, log-uniform."""
    rng = random.Random(seed)
    return [7 + round(2 ** rng.uniform(0, 8)) + 1 for _ in range(count)]


def test_first_fit_decreasing_fills_bins_to_the_budget_longest_rows_first():
    assert pack_rows([3, 9, 4, 6, 2], 10) == [[1], [3, 2], [0, 4]]
    assert pack_rows([5, 0, 5], 10) == [[0, 2]]                     # a row with no tokens is left out
    assert pack_rows([], 10) == []


def test_a_row_longer_than_the_budget_is_refused_naming_the_key_to_raise():
    with pytest.raises(PlanError, match="row 1 has 30 tokens.*micro_batch_tokens to at least 30"):
        pack_rows([5, 30], 20)


def test_the_docstrings_example_holds():
    plan = plan_micro_batches([12, 300, 40, 7], ranks=2, budget=512)
    assert plan.ranks == (((1,),), ((2, 0, 3),))
    assert plan.tokens() == (300, 59)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_row_is_planned_once_within_the_budget_and_every_rank_has_the_same_count(ranks: int, seed: int):
    lengths = skewed_lengths(128, seed) + [0, 0]
    plan = plan_micro_batches(lengths, ranks=ranks, budget=1024)
    rows = [row for rank in range(ranks) for row in plan.rows(rank)]
    assert sorted(rows) == [r for r, n in enumerate(lengths) if n > 0]
    assert len({len(micro_batches) for micro_batches in plan.ranks}) == 1
    assert all(sum(lengths[r] for r in micro) <= plan.budget <= 1024 for rank in plan.ranks for micro in rank)
    tokens = plan.tokens()
    assert max(tokens) <= 1.15 * min(tokens)      # the goal for the slower rank


def test_token_budget_ranks_are_balanced_where_row_counts_are_not():
    lengths = sorted(skewed_lengths(64), reverse=True)   # the long rows first: row counts give them all to rank 0
    by_rows = plan_by_rows(lengths, ranks=2, micro_batch_size=8).tokens()
    by_tokens = plan_micro_batches(lengths, ranks=2, budget=1024).tokens()
    assert max(by_rows) > 2 * min(by_rows)
    assert max(by_tokens) <= 1.05 * min(by_tokens)
    assert sum(by_rows) == sum(by_tokens) == sum(lengths)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_budget_ranks_get_as_many_rows_and_long_rows_as_each_other(seed: int):
    """The work that grows faster than the tokens (each rollout's attention, its length squared; a call per rollout)
    is even too: the ranks' row counts and sums of squared lengths within 15 %."""
    lengths = skewed_lengths(128, seed)
    plan = plan_micro_batches(lengths, ranks=2, budget=1024)
    counts = [len(plan.rows(rank)) for rank in range(2)]
    squares = [sum(lengths[r] ** 2 for r in plan.rows(rank)) for rank in range(2)]
    assert max(counts) <= 1.15 * min(counts), counts
    assert max(squares) <= 1.15 * min(squares), squares


def test_a_rank_short_of_micro_batches_gets_an_idle_one():
    plan = plan_micro_batches([100, 100, 100], ranks=2, budget=100)
    assert plan.ranks == (((0,), (2,)), ((1,), ()))
    assert plan_micro_batches([], ranks=2, budget=100).ranks == (((),), ((),))


def test_the_row_count_split_is_contiguous_like_torch_chunk():
    plan = plan_by_rows([1] * 5, ranks=2, micro_batch_size=2)
    assert plan.ranks == (((0, 1), (2,)), ((3, 4), ()))
