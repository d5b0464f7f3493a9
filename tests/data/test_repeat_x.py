"""builtin:repeat_x, the long-completion task (issue 39): its prompts, the skew of its lengths, its reward."""

from __future__ import annotations

import statistics

from hpcrl.data.builtin import REPEAT_X_MOST, repeat_x
from hpcrl.reward.builtin import length_credit


def test_repeat_x_asks_for_n_xs_with_n_from_1_to_256_skewed_to_the_short():
    examples = [repeat_x("train", i) for i in range(4000)]
    lengths = [len(e["answer"]) for e in examples]
    assert all(e["prompt"] == f"x {len(e['answer'])}:" and set(e["answer"]) == {"x"} for e in examples)
    assert min(lengths) == 1 and max(lengths) == REPEAT_X_MOST == 256
    assert statistics.median(lengths) <= REPEAT_X_MOST / 8          # the skew
    assert sum(n > 64 for n in lengths) / len(lengths) > 0.2        # and a real tail
    assert repeat_x("train", 5) == repeat_x("train", 5) != repeat_x("test", 5)


def test_length_credit_is_one_for_the_exact_answer_and_partial_for_a_near_one():
    answer = "x" * 40
    assert length_credit("x 40:", answer, answer) == 1.0
    assert length_credit("x 40:", "x" * 39, answer) == 1.0 - 1 / 40
    assert length_credit("x 40:", "x" * 44, answer) == 1.0 - 4 / 40
    assert length_credit("x 40:", "x" * 20 + "y" * 20, answer) == 0.5      # half the characters are wrong
    assert length_credit("x 40:", "x" * 80, answer) == 0.0
    assert length_credit("x 40:", "", answer) == 0.0
    assert length_credit("x 1:", " x\n", "x") == 1.0                       # spaces around it ignored
