"""Graders: final-number extraction and the Countdown equation checker (parsed, never eval'd)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from es_ray.grading.countdown import MAX_EXPR_CHARS, ExpressionError, evaluate, extract_equation, score
from es_ray.grading.numbers import final_number, parse_number

# -- final_number -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        ("23 + 45 = 68", 68),
        ("#### 1,234", 1234),
        ("\\boxed{12}", 12),
        ("The answer is 42.", 42),
        ("She has 3 apples and buys 4 more.\n3 + 4 = 7\n#### 7", 7),
        ("So the total is \\boxed{1,500} dollars, not 20.", 1500),
        ("x = -3.5", Fraction(-7, 2)),
        ("#### -12", -12),
        ("First 2 then 5 then 9", 9),
        ("10 - 3 = 7 apples, then 7 * 2 = 14", 14),
    ],
)
def test_final_number_typical_outputs(text, expected):
    got = final_number(text)
    assert isinstance(got, Fraction)
    assert got == expected


@pytest.mark.parametrize("text", ["no number", "", "#### ", "the answer is = unknown"])
def test_final_number_none_when_there_is_no_number(text):
    assert final_number(text) is None


def test_final_number_prefers_the_marker_over_later_numbers():
    assert final_number("#### 42\nI used 3 steps") == 42


def test_parse_number():
    assert parse_number(" 1,234 ") == 1234
    assert parse_number("0.25") == Fraction(1, 4)
    assert parse_number("abc") is None


# -- countdown: evaluate ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expr,value,numbers",
    [
        ("(1 + 2) / 3", Fraction(1), [1, 2, 3]),
        ("3 + 5 * 2", Fraction(13), [3, 5, 2]),
        ("3 + 5 * 2 = 13", Fraction(13), [3, 5, 2]),
        ("7 / 2", Fraction(7, 2), [7, 2]),
        ("(7 / 2) * 2", Fraction(7), [7, 2, 2]),
        ("1 / 3 + 1 / 6", Fraction(1, 2), [1, 3, 1, 6]),
        ("(95 - 11) / 4 - 1", Fraction(20), [95, 11, 4, 1]),
        ("  44 ", Fraction(44), [44]),
    ],
)
def test_evaluate_with_exact_fractions(expr, value, numbers):
    got, used = evaluate(expr)
    assert isinstance(got, Fraction)
    assert got == value
    assert used == numbers


@pytest.mark.parametrize(
    "expr",
    [
        "2**10",
        "9**9**9**9",
        "__import__('os')",
        "__import__('os').system('true')",
        "abs(-3)",
        "x + 1",
        "10 // 3",
        "10 % 3",
        "-3 + 5",
        "1 / 0",
        "4 / (2 - 2)",
        "()",
        "1 2",
        "",
        "1e5",
        "0x10",
        "(1, 2)",
    ],
)
def test_evaluate_refuses(expr):
    with pytest.raises(ExpressionError):
        evaluate(expr)


def test_evaluate_refuses_too_long_input():
    long_expr = "+".join(["1"] * (MAX_EXPR_CHARS // 2 + 1))
    assert len(long_expr) > MAX_EXPR_CHARS
    with pytest.raises(ExpressionError, match=str(MAX_EXPR_CHARS)):
        evaluate(long_expr)
    # just under the cap is fine
    ok = "+".join(["1"] * (MAX_EXPR_CHARS // 2))
    assert len(ok) <= MAX_EXPR_CHARS
    assert evaluate(ok)[0] == MAX_EXPR_CHARS // 2


def test_extract_equation_prefers_the_last_answer_tag():
    assert extract_equation("<answer>1 + 1</answer> no wait <answer>2 * 3</answer>") == "2 * 3"
    assert extract_equation("thinking\n(1 + 2) * 3 = 9\nDone.") == "(1 + 2) * 3 = 9"
    assert extract_equation("no digits at all") is None


# -- countdown: score -------------------------------------------------------------------------------------


def test_score_correct_equation_is_one():
    assert score("Let me try. <answer>(1 + 2) * 3</answer>", [1, 2, 3], 9) == 1.0
    assert score("<answer>(95 - 11) / 4 - 1</answer>", [1, 4, 11, 95], 20) == 1.0  # any order of nums
    assert score("<answer>3 * (2 + 1) = 9</answer>", [1, 2, 3], 9) == 1.0
    assert score("work...\n(1 + 2) * 3", [1, 2, 3], 9) == 1.0  # untagged: last line with digits


def test_score_well_formed_but_wrong_is_format_score():
    assert score("<answer>1 + 2 + 3</answer>", [1, 2, 3], 9) == 0.1  # wrong value
    assert score("<answer>1 + 2 + 3</answer>", [1, 2, 3], 9, format_score=0.25) == 0.25


def test_score_numbers_must_be_used_exactly_once():
    assert score("<answer>3 * 3</answer>", [3, 2], 9) == 0.1  # 3 twice, 2 unused
    assert score("<answer>3 * 3</answer>", [3, 3], 9) == 1.0  # given twice, used twice
    assert score("<answer>9</answer>", [9, 1], 9) == 0.1  # 1 unused
    assert score("<answer>9 * 1 * 1</answer>", [9, 1], 9) == 0.1  # 1 used twice
    assert score("<answer>12 - 3</answer>", [1, 2, 3], 9) == 0.1  # 12 is not 1 and 2


def test_score_malformed_is_zero():
    assert score("I don't know", [1, 2, 3], 6) == 0.0
    assert score("<answer>one plus two</answer>", [1, 2, 3], 6) == 0.0
    assert score("<answer>2**10</answer>", [2, 10], 1024) == 0.0
    assert score("<answer>6 / (3 - 3)</answer>", [6, 3, 3], 6) == 0.0
    assert score("<answer>__import__('os')</answer>", [1], 1) == 0.0
