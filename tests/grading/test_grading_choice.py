"""Multiple-choice letter extraction."""

from __future__ import annotations

import pytest

from es_ray.grading.choice import extract_letter


@pytest.mark.parametrize(
    "text,letters,expected",
    [
        ("Answer: B", "ABCD", "B"),
        ("The answer is (C).", "ABCD", "C"),
        ("Reasoning...\nThe Answer is: **B**", "ABCD", "B"),
        ("\\boxed{A}", "ABCD", "A"),
        ("\\boxed{\\text{(B)}}", "ABCD", "B"),
        ("Answer: (b)", "ABCD", "B"),
        ("Between (A) and (C), I pick (C)", "ABCD", "C"),
        ("First I thought Answer: A. Final answer: D", "ABCD", "D"),
        ("A cat sat.\nB", "ABCD", "B"),
        ("C", "ABCD", "C"),
        ("answer: E", "ABCDE", "E"),
    ],
)
def test_extract_letter(text, letters, expected):
    assert extract_letter(text, letters) == expected


@pytest.mark.parametrize(
    "text,letters",
    [
        ("answer: E", "ABCD"),  # not one of the options
        ("the answer is a bit unclear", "ABCD"),  # lower-case 'a' as a word
        ("I think the answer is d", "ABCD"),
        ("nothing here", "ABCD"),
        ("", "ABCD"),
    ],
)
def test_no_letter(text, letters):
    assert extract_letter(text, letters) is None
