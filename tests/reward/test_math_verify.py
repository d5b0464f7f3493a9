"""The math_verify reward: Hugging Face's math-verify judges the final answer, bounded by its own timer."""

from __future__ import annotations

import signal

import pytest

import hpcrl.reward.builtin as builtin
from hpcrl.reward.builtin import math_verify
from hpcrl.reward.pool import RewardPool
from hpcrl.reward.types import Sample

# (completion, answer, score): matches and non-matches in the forms math answers come in.
ANSWER_FORMS = [
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),                      # LaTeX fraction vs decimal
    ("so \\boxed{1/2}", "\\frac12", 1.0),                                       # plain fraction vs \frac12
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),                                     # \dfrac
    ("$\\frac{6}{8}$", "\\frac{3}{4}", 1.0),                                    # unreduced fraction
    ("\\boxed{0.333333}", "1/3", 1.0),                                          # rounded decimal
    ("we get $x = 2$", "2", 1.0),                                               # an equation's value
    ("Final answer: 42", "42", 1.0),                                            # plain text, no LaTeX
    ("\\boxed{1,000}", "1000", 1.0),                                            # thousands separator
    ("\\boxed{10^{3}}", "1000", 1.0),                                           # a power
    ("\\boxed{50\\%}", "0.5", 1.0),                                             # a percentage
    ("\\boxed{2 \\text{ cm}}", "2", 1.0),                                       # a unit
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),                      # a surd
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),                                      # an expression, expanded
    ("\\boxed{\\{1, 2, 3\\}}", "\\{3, 2, 1\\}", 1.0),                           # a set, any order
    ("\\boxed{[1, 2)}", "[1,2)", 1.0),                                          # an interval
    ("\\boxed{(-\\infty, 3)}", "x < 3", 1.0),                                   # an interval vs an inequality
    ("\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", 1.0),
    ("\\boxed{\\text{(B)}}", "B", 1.0),                                         # a choice letter
    ("\\boxed{-3}", "-3", 1.0),                                                 # a negative number
    ("\\boxed{2}", "3", 0.0),                                                   # a wrong number
    ("\\boxed{3}", "-3", 0.0),                                                  # the wrong sign
    ("Final answer: 42", "43", 0.0),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2, 3\\}", 0.0),                              # a set missing an element
    ("\\boxed{(1, 2]}", "[1,2)", 0.0),                                          # the wrong interval ends
    ("\\boxed{2\\pi}", "\\pi", 0.0),
    ("\\boxed{x^2+1}", "(x+1)^2", 0.0),                                         # a different expression
    ("first \\boxed{1} then \\boxed{5}", "5", 0.0),                             # two boxed answers are a set
    ("no answer here", "7", 0.0),                                               # nothing to compare
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("completion", "answer", "score"), ANSWER_FORMS)
def test_math_verify_scores_answer_forms_by_their_value(completion, answer, score):
    assert math_verify("", completion, answer) == score


@pytest.mark.timeout(60)
def test_math_verify_that_runs_past_its_timer_is_an_error_and_leaves_an_outer_timer_running(monkeypatch):
    monkeypatch.setattr(builtin, "MATH_VERIFY_TIMEOUT_S", 1e-4)
    outer = signal.setitimer(signal.ITIMER_REAL, 0)[0]  # pytest-timeout's, if it uses a timer
    signal.setitimer(signal.ITIMER_REAL, max(outer, 50.0))
    try:
        with pytest.raises(TimeoutError, match="math-verify took more than 0.0001 s"):
            math_verify("", "\\boxed{" + "+".join(f"\\frac{{{i}}}{{{i + 1}}}x^{{{i}}}" for i in range(60)) + "}", "1")
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 40  # the outer timer goes on
    finally:
        signal.setitimer(signal.ITIMER_REAL, outer)


def test_an_answer_that_is_not_math_is_an_error_not_a_zero():
    with pytest.raises(ValueError, match="does not parse as math"):
        math_verify("", "\\boxed{1}", "\\text{}")


@pytest.mark.timeout(120)
def test_math_verify_runs_in_the_reward_pools_workers():
    samples = [Sample(id=f"s{i}", prompt_id=f"p{i}", prompt="", completion=c, answer=a)
               for i, (c, a, _) in enumerate(ANSWER_FORMS[:4] + ANSWER_FORMS[-4:])]
    with RewardPool("hpcrl.reward.builtin:math_verify", workers=1, timeout_s=30) as pool:
        results = pool.score(samples)
    assert [r.error for r in results] == [None] * len(samples)
    assert [r.reward for r in results] == [s for _, _, s in ANSWER_FORMS[:4] + ANSWER_FORMS[-4:]]


def test_a_processs_first_math_verify_imports_nothing_under_its_deadline():
    """The first parse and verify import more of SymPy and the LaTeX parser; cut by the timer on a loaded node,
    an import leaves those modules half made for the whole process, and every later answer "does not parse".
    So a process's first call warms them up before the deadline is armed: nothing is imported under it."""
    import subprocess
    import sys

    code = """
import contextlib, sys
import hpcrl.reward.builtin as builtin
armed = builtin._deadline
imported = []
@contextlib.contextmanager
def watched(seconds):
    before = set(sys.modules)
    with armed(seconds):
        yield
    imported.extend(sorted(set(sys.modules) - before))
builtin._deadline = watched
for completion, answer in [("\\\\boxed{\\\\begin{pmatrix} 1 \\\\\\\\ 2 \\\\end{pmatrix}}", "x < 3"), ("so \\\\boxed{1/2}", "0.5")]:
    builtin.math_verify("", completion, answer)
print(imported)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
