"""Built-in reward functions."""

from hpcrl.reward.builtin import boxed_format, exact_match, format_ok, math_answer


def test_exact_match_compares_the_first_line_ignoring_surrounding_spaces():
    assert exact_match("", " 12 \nrest", "12") == 1.0
    assert exact_match("", "13", "12") == 0.0
    assert exact_match("", "", "12") == 0.0


def test_math_answer_takes_the_boxed_or_last_number_and_compares_values():
    assert math_answer("", "so x = \\boxed{1/2}", "0.5") == 1.0
    assert math_answer("", "first 3 then 7", "7") == 1.0
    assert math_answer("", "first 7 then 3", "7") == 0.0
    assert math_answer("", "no number", "7") == 0.0
    assert math_answer("", "14.0", "14") == 1.0


def test_format_ok_wants_one_non_empty_line():
    assert format_ok("", "42", "") == 1.0
    assert format_ok("", "42\nand more", "") == 0.0
    assert format_ok("", "  ", "") == 0.0


def test_boxed_format_wants_one_closed_boxed_answer_near_the_end():
    assert boxed_format("", "2 + 3 = 5, so the answer is \\boxed{5}.", "") == 1.0
    assert boxed_format("", "half: \\boxed{\\frac{1}{2}}", "") == 1.0  # nested braces
    assert boxed_format("", "no box: 5", "") == 0.0
    assert boxed_format("", "\\boxed{4} or \\boxed{5}", "") == 0.0  # two answers
    assert boxed_format("", "\\boxed{\\frac{1}{2}", "") == 0.0  # never closed
    assert boxed_format("", "\\boxed{5}" + " and then more text" * 5, "") == 0.0  # rambles on after it
