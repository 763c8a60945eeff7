"""pass@k (unbiased, Chen et al. 2021) and maj@k over per-problem samples. Pure Python and numpy.

With n samples of which c are correct, pass@k = 1 - C(n-c, k) / C(n, k): the chance that at least one of k
samples drawn without replacement from the n is correct. It is computed in the numerically stable product form
1 - prod_{i=n-c+1}^{n} (1 - k / i), never with factorials.

maj@k is likewise the expectation over the C(n, k) subsets of the n samples (not one draw of the first k): the
samples fall into groups by answer (n_a of answer a, n_0 without one), a subset's counts are multivariate
hypergeometric, and the vote is correct when a correct answer has the largest count, a tie of t + 1 answers counting
1 / (t + 1) (in a random order each tied answer is equally likely to reach the count first, ``majority_correct``'s
rule). Exactly, by a polynomial in the subset size over the other groups (``expected_majority``).
"""

from __future__ import annotations

from collections import Counter
from math import comb
from typing import Hashable, Sequence

import numpy as np


class NotEnoughSamplesError(ValueError):
    pass


def check_k(n: int, ks: Sequence[int]) -> None:
    """Refuse k values that n samples per problem cannot estimate."""
    bad = [k for k in ks if k < 1]
    if bad:
        raise ValueError(f"k must be >= 1, got {bad}")
    if ks and n < max(ks):
        raise NotEnoughSamplesError(
            f"pass@{max(ks)} needs at least {max(ks)} samples per problem, but n={n}; "
            f"raise eval.n to >= {max(ks)} or drop k > {n} from eval.k"
        )


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with n samples, c of them correct."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    check_k(n, [k])
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(correct_p: Sequence[int], n: int, ks: Sequence[int]) -> dict[int, float]:
    """Mean pass@k over problems (correct_p[i] = correct samples of problem i, each with n samples) for every k."""
    check_k(n, ks)
    if not len(correct_p):
        return {k: float("nan") for k in ks}
    return {k: float(np.mean([pass_at_k(n, c, k) for c in correct_p])) for k in ks}


def majority_correct(answers: Sequence[Hashable | None], correct: Sequence[bool]) -> bool:
    """Whether the majority answer among these samples is correct.

    Samples without an answer (None) do not vote; a tie goes to the answer that reached the winning count first
    (in [a, b, b, a], b); no votes at all is incorrect. The majority answer is correct when its first sample is.
    """
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    top = max(votes.values())
    seen: Counter = Counter()
    for a, ok in zip(answers, correct):
        if a is None:
            continue
        seen[a] += 1
        if seen[a] == top:
            return next(bool(o) for b, o in zip(answers, correct) if b == a)
    return False  # unreachable


def expected_majority(answers: Sequence[Hashable | None], correct: Sequence[bool], k: int) -> float:
    """E[majority vote correct] over the k-subsets of one problem's samples (each subset in a random order).

    For each correct answer a and each count m >= 1 it could win with: C(n_a, m) times the number of ways the other
    groups fill the remaining k - m places with no count above m, each way weighted 1 / (1 + answers tied at m)."""
    n = len(answers)
    check_k(n, [k])
    groups: dict = {}
    for a, ok in zip(answers, correct):
        if a is not None:
            groups.setdefault(a, [0, bool(ok)])[0] += 1
    if not groups:
        return 0.0
    correctness = {a: next(bool(o) for b, o in zip(answers, correct) if b == a) for a in groups}  # first sample's
    n_none = n - sum(c for c, _ in groups.values())
    total = 0.0
    for target, (n_t, _) in groups.items():
        if not correctness[target]:
            continue
        others = [c for a, (c, _) in groups.items() if a != target]
        for m in range(1, min(n_t, k) + 1):
            # ways[s, t]: subsets of size s of the other samples with every other answer's count <= m, t of them = m
            ways = np.zeros((k - m + 1, len(others) + 1))
            ways[:, 0] = [comb(n_none, s) for s in range(k - m + 1)]
            for c in others:
                nxt = np.zeros_like(ways)
                for x in range(min(c, m, k - m) + 1):
                    tie = 1 if x == m else 0
                    nxt[x:, tie:] += comb(c, x) * ways[: k - m + 1 - x, : ways.shape[1] - tie]
                ways = nxt
            total += comb(n_t, m) * float(np.sum(ways[k - m] / (1.0 + np.arange(ways.shape[1]))))
    return total / comb(n, k)


def maj_at_k(answers_pn: Sequence[Sequence[Hashable | None]], correct_pn: Sequence[Sequence[bool]], k: int) -> float:
    """Mean over problems of the expected majority vote over k of each problem's n samples (``expected_majority``)."""
    if not len(answers_pn):
        return float("nan")
    n = min(len(a) for a in answers_pn)
    check_k(n, [k])
    return float(np.mean([expected_majority(a, c, k) for a, c in zip(answers_pn, correct_pn)]))
