"""Strict boxed answers and restatements of the problem."""

from __future__ import annotations

import pytest

from es_ray.grading.boxed import last_boxed, normalize, restates_problem


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the answer is \\boxed{14}.", "14"),
        ("\\boxed{1} then \\boxed{\\frac{14}{3}}", "\\frac{14}{3}"),
        ("nested \\boxed{\\sqrt{2}+\\{x\\}}", "\\sqrt{2}+\\{x\\}"),
        ("\\fbox{7}", "7"),
        ("we can find 5^3 by cubing", None),  # no box: no final answer
        ("the answer is \\boxed{12", None),  # cut off by the token limit
        ("\\boxed{}", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_restating_the_problem_is_recognised_but_numbers_are_not():
    q = "Compute $5^3$."
    assert restates_problem("5^3", q) and restates_problem("5 ^ 3", q)
    assert not restates_problem("125", q)
    assert not restates_problem("3", "What is 1 + 2? The answer is at most 3.")  # bare numbers are results
    assert not restates_problem(None, q)
    assert normalize("$\\left( 1, 2 \\right)$") == "(1,2)"
