"""The paired test and its power, and the test of the test on the calibration model (es_ray/metrics/calibration.py:
per-problem logits N(-1, 1.8^2), method x problem sd 0.6, seed shift sd sv, seed x problem sd 0.4, n = 32 samples,
exact pass@k): the no-effect rejection rate stays at or below 7.5% at nominal 5% and at or below twice nominal at
5% / 40 (Holm's first threshold, where a verdict is called), with training variance in both methods or in one only,
and the printed detectable size is found under Holm's first threshold. The whole grid:
benchmarks/paired_calibration.py (docs/comparison.md, "Calibration")."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest

from es_ray.metrics.bootstrap import interval, separated
from es_ray.metrics.calibration import SD_METHOD_PROBLEM, THETA, expected_passk, passk_table, simulate
from es_ray.metrics.paired import (
    holm,
    paired_difference,
    paired_difference_tasks,
    power,
    t_quantile,
    t_two_sided_p,
    t_test,
    welch,
)


def test_t_distribution_against_known_values():
    assert t_quantile(0.975, 1) == pytest.approx(12.7062047, rel=1e-7)
    assert t_quantile(0.975, 10) == pytest.approx(2.2281389, rel=1e-7)
    assert t_quantile(0.025, 10) == pytest.approx(-2.2281389, rel=1e-7)
    assert float(t_two_sided_p(2.0, 30)) == pytest.approx(0.0546250, rel=1e-5)
    assert float(t_two_sided_p(t_quantile(0.99, 4.3), 4.3)) == pytest.approx(0.02, rel=1e-9)  # real df too


HOLM_FIRST = 0.05 / 40
"""Holm's first threshold in a 5-method report (10 pairs x (3 k + entropy)): where a verdict is called."""


def _levels(a, b):
    """[R, S, P] no-effect draws -> (rejection rate at 5%, at HOLM_FIRST)."""
    p = t_test([(a, b)])[3]
    return float(np.mean(p < 0.05)), float(np.mean(p < HOLM_FIRST))


@pytest.mark.parametrize("problems,seeds,sv", [(100, 2, 0.3), (500, 2, 0.15), (500, 3, 0.3)])
def test_no_effect_level_at_5_percent_and_at_holms_threshold(problems, seeds, sv):
    """The grid's worst cells (benchmarks/paired_calibration.py): with the df switched to the problem terms' where V
    sat at its floor, these rejected 1.1-1.5% (2 seeds) and 0.3-0.7% (3 seeds) at 5% / 40 against a nominal 0.125%;
    at most twice nominal now (15 of 6000), and within 7.5% at 5%."""
    rng = np.random.default_rng([problems, seeds, int(100 * sv)])
    rates = []
    for _ in range(2):  # 2 x 3000 replicates, in halves to bound memory
        a, b = simulate(rng, 3000, problems, seeds, sv)
        rates.append([_levels(a[..., j], b[..., j]) for j in range(a.shape[-1])])
    for j, ((five_1, first_1), (five_2, first_2)) in enumerate(zip(*rates)):  # pass@1, 16, 32
        assert (five_1 + five_2) / 2 <= 0.075, (j, five_1, five_2)
        assert (first_1 + first_2) / 2 <= 2 * HOLM_FIRST, (j, first_1, first_2)


def test_floored_variance_keeps_the_seeds_degrees_of_freedom():
    """Two seeds whose means agree say nothing about the training variance: V sits at its floor (the problem part)
    and the df stays what the seeds allow (it was the problem terms' 499, whence 0.6-2.1% at 5% / 40)."""
    rng = np.random.default_rng(11)
    base = rng.random(500)
    a = np.clip(base + rng.normal(0, 0.1, size=(2, 500)), 0, 1)
    b = np.clip(base + 0.01 + rng.normal(0, 0.1, size=(2, 500)), 0, 1)
    a, b = a - a.mean(1, keepdims=True) + a.mean(), b - b.mean(1, keepdims=True) + b.mean()  # seeds agree exactly
    r = paired_difference(a, b)
    assert r.var_training == 0 and r.se**2 == pytest.approx(float((b.mean(0) - a.mean(0)).var(ddof=1)) / 500)
    assert 1 <= r.df <= 3, r.df


def _hetero(rng, replicates, problems, seeds, k):
    """Training variance in one method only (benchmarks/verdict_breaker.py's hetero_seeds): A sv 0 and seed x
    problem sd 0.2 (a base model's seeds: sampling only), B sv 0.5 and sd 0.6, B shifted so E[pass@k] is equal."""
    n, sv, sb = 32, (0.0, 0.5), (0.2, 0.6)
    sds = [np.sqrt(THETA[1] ** 2 + SD_METHOD_PROBLEM**2 + sv[m] ** 2 + sb[m] ** 2) for m in (0, 1)]
    x, wts = np.polynomial.hermite_e.hermegauss(120)
    grid = np.linspace(-3, 3, 601)
    curve = [
        float(np.sum(wts * (1 - (1 - 1 / (1 + np.exp(-(THETA[0] + g + sds[1] * x)))) ** k))) / wts.sum() for g in grid
    ]
    target = float(np.sum(wts * (1 - (1 - 1 / (1 + np.exp(-(THETA[0] + sds[0] * x)))) ** k))) / wts.sum()
    shift = float(np.interp(target, curve, grid))
    theta = rng.normal(*THETA, size=(replicates, 1, problems))
    table = passk_table(n, (k,))[:, 0]
    out = []
    for m in (0, 1):
        logit = (
            theta
            + rng.normal(0, SD_METHOD_PROBLEM, size=(replicates, 1, problems))
            + (shift if m else 0.0)
            + rng.normal(0, sv[m], size=(replicates, seeds, 1))
            + rng.normal(0, sb[m], size=(replicates, seeds, problems))
        )
        out.append(table[rng.binomial(n, 1 / (1 + np.exp(-logit)))])
    return out


@pytest.mark.parametrize("problems,seeds", [(500, 2), (100, 2), (500, 3)])
def test_training_variance_in_one_method_only(problems, seeds):
    """The base model against a trained method: one method's seed term carries all the training variance on S - 1
    df. With the df estimated from the seed terms as they fell, 2 seeds rejected 10-12% at 5% and 4-5% at 5% / 40,
    3 seeds 7.3-8.4% at 5%: the replicates whose seeds happened to agree. Now within 7.5% at 5% and (2 seeds) at most
    twice nominal at 5% / 40 (benchmarks/paired_calibration.py --hetero: 3 seeds 0.15-0.26% there)."""
    rng = np.random.default_rng([problems, seeds])
    for k in (1, 16, 32):
        five, first = _levels(*_hetero(rng, 4000, problems, seeds, k))
        assert five <= 0.075, (k, five)
        if seeds == 2:
            assert first <= 2 * HOLM_FIRST, (k, first)


def test_five_seeds_stay_near_nominal():
    """The price of the bound is paid at 2-3 seeds (docs/comparison.md): 5 seeds with training variance keep the
    level within 3-7.5% at 5%."""
    a, b = simulate(np.random.default_rng(5), 3000, 500, 5, 0.3, ks=(1, 16))
    for j in range(2):
        five, first = _levels(a[..., j], b[..., j])
        assert 0.03 <= five <= 0.075 and first <= 2 * HOLM_FIRST, (j, five, first)


def test_pooling_seeds_as_problems_over_rejects():
    """Training variance is a second level: the same data with the seeds' runs treated as more problems."""
    a, b = simulate(np.random.default_rng(3), 1000, 50, 5, 0.3, ks=(1,))
    rate = float(np.mean(t_test([(a[..., 0], b[..., 0])])[3] < 0.05))
    pooled = float(np.mean(t_test([(a.reshape(1000, 1, -1), b.reshape(1000, 1, -1))])[3] < 0.05))
    assert rate <= 0.075 and pooled > 0.25


@lru_cache(maxsize=None)
def _effect_curve(sv, k):
    grid = np.linspace(0, 6, 121)
    return grid, np.array([expected_passk(g, sv, k) for g in grid]) - expected_passk(0.0, sv, k)


def _shift_for(effect, sv, k):
    """calibration.shift_for by interpolation on one curve (it bisects 100 times per call)."""
    grid, curve = _effect_curve(sv, k)
    return float(np.interp(effect, curve, grid))


@pytest.mark.parametrize("problems,seeds,sv,k", [(100, 3, 0.0, 1), (500, 5, 0.15, 1)])
def test_the_printed_detectable_size_is_found_under_holm(problems, seeds, sv, k):
    """Pilots print the detectable size at alpha / 40 (a 5-method family's first Holm step); a fresh experiment
    with that true effect rejects at alpha / 40 at least 75% of the time (benchmarks/paired_calibration.py checks
    more cases and the planning numbers)."""
    rng = np.random.default_rng(7)
    a, b = simulate(rng, 60, problems, seeds, sv, ks=(k,))
    dets = [power([(a[r, ..., 0], b[r, ..., 0])], alpha=HOLM_FIRST).detectable for r in range(60)]
    reach = [d for d in dets if d < 1 - expected_passk(0.0, sv, k) - 0.01]
    assert len(reach) >= 30, dets
    hits = []
    for det in reach:
        x, y = simulate(rng, 1, problems, seeds, sv, ks=(k,), shift=_shift_for(det, sv, k))
        hits.append(float(t_test([(x[0, ..., 0], y[0, ..., 0])])[3]) < HOLM_FIRST)
    assert np.mean(hits) >= 0.75, (len(reach), np.mean(hits))


def test_one_seed_compares_checkpoints_and_plans_nothing():
    rng = np.random.default_rng(4)
    a = rng.random((1, 100))
    b = a + 0.05 + rng.normal(0, 0.1, size=a.shape)
    r = paired_difference(a, b)
    assert r.checkpoints_only and r.var_training == 0 and r.df == pytest.approx(99)
    pw = power([(a, b)])
    assert pw.var_seeds is None and pw.problems_needed(0.02) is None and pw.seeds_needed(0.02) is None
    assert pw.detectable > 0  # the two checkpoints' own detectable size
    few = power([(rng.random((3, 100)), rng.random((3, 100)))])
    assert not few.can_plan and few.problems_needed(0.02) is None  # 3 seeds: too few to plan on


def test_seeds_of_the_two_methods_are_independent_runs_and_may_differ():
    rng = np.random.default_rng(5)
    a, b = rng.random((3, 40)), rng.random((2, 40))
    r = paired_difference(a, b)
    assert (r.seeds_a, r.seeds_b, r.seeds) == (3, 2, 2) and r.diff == pytest.approx(b.mean() - a.mean())
    # relabelling the seeds of one method changes nothing: they are not paired with the other's
    assert paired_difference(a[::-1], b).p == pytest.approx(r.p)


def test_fields_interval_and_p_agree():
    rng = np.random.default_rng(4)
    a = rng.random((3, 100))
    b = a + 0.1 + rng.normal(0, 0.05, size=a.shape)
    r = paired_difference(a, b)
    assert r.diff == pytest.approx(float((b - a).mean())) and r.low < r.diff < r.high
    assert r.p < 0.05 and r.low > 0 and (r.seeds, r.problems) == (3, 100)
    assert r.high - r.diff == pytest.approx(t_quantile(0.975, r.df) * r.se)
    same = paired_difference(a[0], a[0])
    assert same.diff == same.low == same.high == 0 and same.p == 1.0
    # Three problems cannot give a small p however large the difference (an exact sign-flip test's floor).
    few = paired_difference([0.1, 0.2, 0.3], [0.9, 0.8, 0.95])
    assert few.p >= 0.25
    assert power([(a[0], a[0])]).detectable is None and power([(a[0], a[0])]).problems_needed(0.02) is None
    # the marginal-interval rule this replaced does not see what the paired test finds
    assert separated(interval(a[0], draws=500), interval(b[0], draws=500)) == 0


def test_welch_on_one_value_per_run():
    r = welch([1.0, 1.2, 0.9], [2.0, 2.3, 2.1])
    assert r.diff == pytest.approx(np.mean([2.0, 2.3, 2.1]) - np.mean([1.0, 1.2, 0.9]))
    assert r.p < 0.01 and r.low > 0
    with pytest.raises(ValueError, match="at least two runs"):
        welch([1.0], [2.0, 3.0])


def test_tasks_are_strata_weighted_as_the_report_weighs_them():
    rng = np.random.default_rng(5)
    easy_a = rng.random(30)
    hard_a = rng.random(8)
    r = paired_difference_tasks([(easy_a, easy_a + 0.2), (hard_a, hard_a)])
    assert r.diff == pytest.approx(0.1)  # the mean over tasks, not over the 38 problems pooled
    # constant differences within each task: no variance
    assert r.low == pytest.approx(0.1) and r.high == pytest.approx(0.1) and r.se == pytest.approx(0, abs=1e-12)
    weighted = paired_difference_tasks([(easy_a, easy_a + 0.2), (hard_a, hard_a)], weights=[3, 1])
    assert weighted.diff == pytest.approx(0.15)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="same problems"):
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
