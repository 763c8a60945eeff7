"""The paired test and its power, and the test of the test on the calibration model (es_ray/metrics/calibration.py:
per-problem logits N(-1, 1.8^2), method x problem sd 0.6, seed shift sd sv, seed x problem sd 0.4, n = 32 samples,
exact pass@k): the no-effect rejection rate stays in [3%, 7.5%] at nominal 5% where seeds carry training variance,
and the printed detectable size is found under Holm's first threshold. The whole grid:
benchmarks/paired_calibration.py (docs/comparison.md, "Calibration")."""

from __future__ import annotations

import numpy as np
import pytest

from es_ray.metrics.bootstrap import interval, separated
from es_ray.metrics.calibration import shift_for, simulate
from es_ray.metrics.paired import (holm, paired_difference, paired_difference_tasks, power, t_quantile,
                                   t_two_sided_p, t_test, welch)


def test_t_distribution_against_known_values():
    assert t_quantile(0.975, 1) == pytest.approx(12.7062047, rel=1e-7)
    assert t_quantile(0.975, 10) == pytest.approx(2.2281389, rel=1e-7)
    assert t_quantile(0.025, 10) == pytest.approx(-2.2281389, rel=1e-7)
    assert float(t_two_sided_p(2.0, 30)) == pytest.approx(0.0546250, rel=1e-5)
    assert float(t_two_sided_p(t_quantile(0.99, 4.3), 4.3)) == pytest.approx(0.02, rel=1e-9)  # real df too


@pytest.mark.parametrize("problems,seeds,sv", [(30, 2, 0.3), (100, 3, 0.15), (100, 2, 0.3), (500, 3, 0.3),
                                               (500, 2, 0.15)])
def test_no_effect_rejects_within_3_to_7_5_percent_with_training_variance(problems, seeds, sv):
    """2-3 seeds with training variance: the bootstrap this replaced rejected 12.8-24.7% here (the issue's audit)."""
    a, b = simulate(np.random.default_rng(problems * 10 + seeds), 1500, problems, seeds, sv)
    for j in range(a.shape[-1]):  # pass@1, 16, 32
        rate = float(np.mean(t_test([(a[..., j], b[..., j])])[3] < 0.05))
        # 30 problems at pass@32 (n = 32: whether any sample is right) leave a handful of problems that are not
        # all 0 or all 1: the test is conservative there (2.3-3.3% over the grid, docs/comparison.md), never above
        low = 0.02 if (problems, j) == (30, 2) else 0.03
        assert low <= rate <= 0.075, (j, rate)


def test_pooling_seeds_as_problems_over_rejects():
    """Training variance is a second level: the same data with the seeds' runs treated as more problems."""
    a, b = simulate(np.random.default_rng(3), 1000, 50, 5, 0.3, ks=(1,))
    rate = float(np.mean(t_test([(a[..., 0], b[..., 0])])[3] < 0.05))
    pooled = float(np.mean(t_test([(a.reshape(1000, 1, -1), b.reshape(1000, 1, -1))])[3] < 0.05))
    assert rate <= 0.075 and pooled > 0.25


def test_the_printed_detectable_size_is_found_under_holm():
    """Pilots print the detectable size at alpha / 40 (a 5-method family's first Holm step); a fresh experiment
    with that true effect rejects at alpha / 40 at least 75% of the time (benchmarks/paired_calibration.py checks
    more cases and the planning numbers)."""
    rng = np.random.default_rng(7)
    alpha = 0.05 / 40
    a, b = simulate(rng, 60, 100, 3, 0.0, ks=(1,))
    hits = []
    for r in range(60):
        det = power([(a[r, ..., 0], b[r, ..., 0])], alpha=alpha).detectable
        x, y = simulate(rng, 1, 100, 3, 0.0, ks=(1,), shift=shift_for(det, 0.0, 1))
        hits.append(float(t_test([(x[0, ..., 0], y[0, ..., 0])])[3]) < alpha)
    assert np.mean(hits) >= 0.75


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
