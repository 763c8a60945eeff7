"""pass@k and maj@k against hand-computed values."""

from __future__ import annotations

import math

import pytest

from es_ray.metrics.passk import (
    NotEnoughSamplesError,
    expected_majority,
    maj_at_k,
    majority_correct,
    mean_pass_at_k,
    pass_at_k,
)


@pytest.mark.parametrize(
    "n,c,k,expected",
    [
        (5, 2, 1, 1 - 3 / 5),  # 1 - C(3,1)/C(5,1)
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (5, 2, 3, 1 - 1 / 10),  # 1 - C(3,3)/C(5,3)
        (5, 2, 4, 1.0),  # fewer than k wrong samples: some correct one is always drawn
        (5, 0, 3, 0.0),
        (5, 5, 1, 1.0),
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (200, 1, 100, 0.5),  # C(199,100)/C(200,100) = 100/200; factorials would overflow floats
        (1000, 3, 1, 3 / 1000),  # pass@1 is the fraction correct
        (32, 8, 16, 1 - math.comb(24, 16) / math.comb(32, 16)),
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_pass_at_k_matches_the_combinatorial_definition():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)


def test_pass_at_k_is_monotone_in_k():
    values = [pass_at_k(32, 4, k) for k in range(1, 33)]
    assert values == sorted(values) and values[-1] == 1.0


def test_mean_over_problems_for_a_list_of_k():
    got = mean_pass_at_k([0, 2, 5], n=5, ks=[1, 2])
    assert got[1] == pytest.approx((0 + 0.4 + 1) / 3)
    assert got[2] == pytest.approx((0 + 0.7 + 1) / 3)


def test_n_must_cover_the_largest_k():
    with pytest.raises(NotEnoughSamplesError, match=r"eval\.n"):
        mean_pass_at_k([1, 0], n=2, ks=[1, 4])
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)  # more correct than samples
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 0)


def test_majority_vote_hand_values():
    answers = [["5", "5", "3", "5"], ["3", "4", "4", None], [None, None, "7", "8"]]
    correct = [[True, True, False, True], [False, True, True, False], [False, False, False, True]]
    # the expectation over subsets: k = 1 is the share of correct samples (3/4, 2/4, 1/4)
    assert maj_at_k(answers, correct, 1) == pytest.approx(0.5)
    # k = 3: A always 5; B: "4" wins without "3" or without None, ties 3-4 otherwise (1/2): 3/4; C: 8 alone
    # (1/4 of subsets) wins, 7-8 ties (2/4) count 1/2: 1/2
    assert maj_at_k(answers, correct, 3) == pytest.approx((1 + 0.75 + 0.5) / 3)
    assert maj_at_k(answers, correct, 4) == pytest.approx((1 + 1 + 0.5) / 3)  # C: 7 and 8 tie, either first
    with pytest.raises(NotEnoughSamplesError):
        maj_at_k(answers, correct, 5)


def test_majority_ties_and_empty_votes():
    # a tie goes to the answer that reached the winning count first: in [a, b, b, a] that is b
    assert majority_correct(["a", "b", "b", "a"], [False, True, True, False]) is True
    assert majority_correct(["a", "b", "b", "a"], [True, False, False, True]) is False
    assert majority_correct([None, None], [False, False]) is False
    assert majority_correct([], []) is False


def test_expected_majority_equals_brute_force_over_ordered_subsets():
    """Every ordered k-sample without replacement of n = 7 samples, voted by majority_correct (ties to the answer
    that reaches the count first): the mean equals the exact formula."""
    import itertools
    import random

    rnd = random.Random(0)
    for _ in range(12):
        answers = [rnd.choice(["a", "b", "c", None]) for _ in range(7)]
        right = rnd.choice(["a", "b", "c"])
        correct = [x == right for x in answers]
        for k in range(1, 8):
            votes = [
                majority_correct([answers[i] for i in order], [correct[i] for i in order])
                for order in itertools.permutations(range(7), k)
            ]
            assert expected_majority(answers, correct, k) == pytest.approx(sum(votes) / len(votes), abs=1e-12)
