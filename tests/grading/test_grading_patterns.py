"""No grader can hang: every answer-extraction pattern is linear (a 1 MB adversarial input finishes fast) and every
reward runs under a per-completion time limit (a timeout scores 0 and is counted)."""

from __future__ import annotations

import time

import pytest

from es_ray.grading.boxed import last_boxed, normalize, restates_problem
from es_ray.grading.choice import extract_letter
from es_ray.grading.code import extract_code
from es_ray.grading.countdown import extract_equation, score
from es_ray.grading.limit import GRADE_TIMEOUT_S, time_limit
from es_ray.grading.numbers import final_number
from es_ray.grading.result import GraderFailure
from es_ray.tasks.dataset import _last_expression

MB = 1 << 20
# Each of these took seconds to hours before (the choice lead grew as n^4.7 on "answer" + spaces); linear code
# does 1 MB in milliseconds, so a generous bound still tells the two apart on a loaded machine.
BOUND_S = 3.0
HOSTILE = {
    "spaces": " " * MB,
    "answer+spaces": "answer" + " " * MB,
    "answer is+spaces": "Answer is" + " " * MB + "!",
    "answers": "answer " * (MB // 7),
    "box+spaces": "\\boxed{" + " " * MB,
    "box+text+spaces": "\\boxed{\\text{" + " " * MB,
    "newlines": "\n" * MB + "x",
    "blank lines": " \n" * (MB // 2),
    "parens": "(" * MB,
    "braces": "{" * MB,
    "boxes": "\\boxed{" * (MB // 7),
    "tags": "<answer>" * (MB // 8),
    "digits": "1" * MB,
    "commas": "1," * (MB // 2),
    "equals": "=" * MB,
    "dollars": "$" + "a" * MB,
    "fence+spaces": "```" + " " * MB,
    "fence+word": "```" + "a" * MB,
    "fences": "```\n" * (MB // 4),
    "latex": "\\frac{1}{2}" * (MB // 11),
}
EXTRACTORS = {
    "choice": lambda t: extract_letter(t, "ABCDE"),
    "countdown": extract_equation,
    "countdown_score": lambda t: score(t, [1, 2, 3], 6),
    "boxed": last_boxed,
    "normalize": normalize,
    "restated": lambda t: restates_problem(t[-5000:], t),
    "number": final_number,
    "code_fence": extract_code,
    "last_expression": _last_expression,
}


@pytest.mark.parametrize("name", sorted(EXTRACTORS))
def test_every_pattern_is_linear_on_1mb_inputs(name):
    fn = EXTRACTORS[name]
    for kind, text in HOSTILE.items():
        t0 = time.perf_counter()
        fn(text)
        took = time.perf_counter() - t0
        assert took < BOUND_S, f"{name} on 1 MB of {kind!r}: {took:.2f} s"


def test_the_patterns_still_find_what_they_found():
    assert extract_letter("so the answer is   (c)") == "C"
    assert extract_letter("Answer:   **B**") == "B"
    assert extract_letter("answer is option  D") == "D"
    assert extract_letter("\\boxed{ \\text{ A } }") == "A"
    assert extract_letter("reasoning\n\n  (B)  \n") == "B"
    assert extract_letter("reasoning\n  **C**.\n") == "C"
    assert extract_equation("x <answer>1+2</answer> y <answer>3*2</answer> <answer>open") == "3*2"
    assert extract_equation("no tags\n1 + 2 = 3\nthanks") == "1 + 2 = 3"
    assert extract_code("```  python  \ndef f():\n    return 1\n```") == "def f():\n    return 1"
    assert extract_code("```\ndef g():\n    pass\n```") == "def g():\n    pass"


def test_a_grader_past_its_time_limit_scores_zero_and_is_counted():
    from es_ray.tasks.base import score as score_all

    class Slow:
        grade_timeout_s = 0.3

        def reward(self, completion, problem):
            if completion == "hang":
                while True:
                    pass
            return 1.0

    t0 = time.monotonic()
    rewards, errors = score_all(Slow(), ["ok", "hang", "ok"], [None, None, None])
    assert (rewards, errors) == ([1.0, 0.0, 1.0], 1)
    assert time.monotonic() - t0 < 3.0
    with pytest.raises(GraderFailure, match="timeout"):
        with time_limit(0.2):
            time.sleep(5)
    assert GRADE_TIMEOUT_S > 0
