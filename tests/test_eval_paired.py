"""The paired test and its power, and the test of the test: simulated per-problem data (per-problem logits
N(-1.5, 2), n = 4 samples per problem, method B shifted in logit) keeps the no-effect rejection rate at the nominal
level and finds a known effect with the stated power, each within binomial error of the replicate count."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from es_ray.metrics.bootstrap import interval, separated
from es_ray.metrics.paired import holm, paired_difference, paired_difference_tasks, power

REPLICATES, DRAWS, N = 300, 1000, 4
Z80 = NormalDist().inv_cdf(0.975) + NormalDist().inv_cdf(0.8)


def _simulate(rng, replicates: int, problems: int, shift: float, seeds: int = 1, seed_sd: float = 0.0):
    """(replicates, seeds, problems) pass@1 estimates of methods A and B on the same problems."""
    logit = rng.normal(-1.5, 2.0, size=(replicates, 1, problems))
    run_a = rng.normal(0.0, seed_sd, size=(replicates, seeds, 1))  # training variance: one shift per seed's run
    run_b = rng.normal(0.0, seed_sd, size=(replicates, seeds, 1))
    shape = (replicates, seeds, problems)
    a = rng.binomial(N, np.broadcast_to(1 / (1 + np.exp(-(logit + run_a))), shape)) / N
    b = rng.binomial(N, np.broadcast_to(1 / (1 + np.exp(-(logit + shift + run_b))), shape)) / N
    return a, b


def _rejections(a, b, alpha: float = 0.05) -> float:
    return float(np.mean([paired_difference(a[r], b[r], draws=DRAWS, seed=r).p < alpha for r in range(len(a))]))


def _tolerance(rate: float, replicates: int = REPLICATES) -> float:
    """Three binomial standard errors of a rejection rate estimated from ``replicates`` replicates."""
    return 3 * math.sqrt(rate * (1 - rate) / replicates)


def test_no_effect_rejects_at_the_nominal_level():
    a, b = _simulate(np.random.default_rng(1), REPLICATES, 40, shift=0.0)
    assert abs(_rejections(a, b) - 0.05) <= _tolerance(0.05)


def test_a_known_effect_is_found_with_the_stated_power_and_power_names_it():
    rng = np.random.default_rng(2)
    # The effect's true size and per-problem variance, from one large draw; the problems that give it 80% power.
    big_a, big_b = _simulate(rng, 1, 200_000, shift=0.4)
    d = (big_b - big_a).ravel()
    problems = math.ceil(d.var() * Z80 ** 2 / d.mean() ** 2)
    a, b = _simulate(rng, REPLICATES, problems, shift=0.4)
    assert abs(_rejections(a, b) - 0.8) <= _tolerance(0.8)
    # power() reads the same detectable size off each replicate's own data (on average within a few percent) ...
    detectable = np.mean([power([(a[r], b[r])]).detectable for r in range(REPLICATES)])
    assert detectable == pytest.approx(d.mean(), rel=0.05)
    # ... and the problems that size needs, from a replicate of another size.
    assert power([(a[0, :, :60], b[0, :, :60])]).problems_needed(d.mean()) == pytest.approx(problems, rel=0.25)
    # The rule it replaces (two marginal 95% intervals must not overlap) almost never sees this effect.
    marginal = np.mean([separated(interval(a[r, 0], draws=500), interval(b[r, 0], draws=500)) != 0
                        for r in range(100)])
    assert marginal < 0.3


def test_seeds_are_a_second_level_pooling_them_ignores():
    a, b = _simulate(np.random.default_rng(3), REPLICATES, 50, shift=0.0, seeds=5, seed_sd=0.3)
    assert _rejections(a, b) <= 0.05 + _tolerance(0.05)
    pooled = _rejections(a.reshape(REPLICATES, 1, -1), b.reshape(REPLICATES, 1, -1))  # seeds treated as problems
    assert pooled > 0.15
    pw = power([(a[0], b[0])])
    assert pw.seeds == 5 and pw.var_seeds > 0 and pw.seeds_needed(1.0) == 2


def test_fields_interval_and_p_agree():
    rng = np.random.default_rng(4)
    a = rng.random((3, 100))
    b = a + 0.1 + rng.normal(0, 0.05, size=a.shape)
    r = paired_difference(a, b)
    assert r.diff == pytest.approx(float((b - a).mean())) and r.low < r.diff < r.high
    assert r.p < 0.05 and r.low > 0 and (r.seeds, r.problems) == (3, 100)
    same = paired_difference(a[0], a[0])
    assert same.diff == same.low == same.high == 0 and same.p == 1.0
    assert paired_difference(a, b, seed=7) == paired_difference(a, b, seed=7)
    # Three problems cannot give a small p however large the difference (an exact sign-flip test's floor).
    few = paired_difference([0.1, 0.2, 0.3], [0.9, 0.8, 0.95])
    assert few.low > 0 and few.p == 0.25
    assert power([(a[0], a[0])]).detectable is None and power([(a[0], a[0])]).problems_needed(0.02) is None


def test_tasks_are_strata_weighted_as_the_report_weighs_them():
    rng = np.random.default_rng(5)
    easy_a = rng.random(30)
    hard_a = rng.random(8)
    r = paired_difference_tasks([(easy_a, easy_a + 0.2), (hard_a, hard_a)])
    assert r.diff == pytest.approx(0.1)  # the mean over tasks, not over the 38 problems pooled
    # constant differences within each task: nothing to resample
    assert r.low == pytest.approx(0.1) and r.high == pytest.approx(0.1)
    weighted = paired_difference_tasks([(easy_a, easy_a + 0.2), (hard_a, hard_a)], weights=[3, 1])
    assert weighted.diff == pytest.approx(0.15)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="same shape"):
        paired_difference(np.zeros(5), np.zeros(6))
    with pytest.raises(ValueError, match="at least two common problems"):
        paired_difference([0.5], [0.4])
    with pytest.raises(ValueError, match="NaN"):
        paired_difference([0.1, np.nan, 0.3], [0.2, 0.2, 0.2])
    with pytest.raises(ValueError, match="same seeds"):
        paired_difference_tasks([(np.zeros((2, 3)), np.zeros((2, 3))), (np.zeros((3, 3)), np.zeros((3, 3)))])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        holm([0.2, 1.5])


def test_holm_step_down():
    # m = 4: sorted p 0.01, 0.03, 0.04, 0.5 -> 4*0.01, max(3*0.03, .04), max(2*0.04, .09), max(0.5, .09)
    assert holm([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])
    assert holm([0.9, 0.9]) == [1.0, 1.0] and holm([]) == []
