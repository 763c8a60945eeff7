"""The bootstrap interval over problems: coverage, task-wise resampling, separation."""

from __future__ import annotations

import numpy as np
import pytest

from es_ray.metrics.bootstrap import interval, interval_of_task_means, separated


def test_interval_covers_the_true_mean_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    hits = 0
    for trial in range(200):
        values = rng.binomial(1, 0.3, size=60)
        lo, hi = interval(values, draws=500, seed=trial)
        hits += lo <= 0.3 <= hi
    assert 0.88 <= hits / 200 <= 0.99


def test_interval_of_task_means_resamples_within_tasks():
    easy, hard = np.ones(20), np.zeros(5)
    lo, hi = interval_of_task_means([easy, hard])
    assert lo == hi == pytest.approx(0.5)  # every replicate keeps both tasks: their means never change
    lo, hi = interval(np.concatenate([easy, hard]))
    assert lo < 0.8 < hi  # pooled problems instead: the tasks' share moves


def test_separated_needs_disjoint_intervals():
    assert separated((0.5, 0.6), (0.3, 0.4)) == 1 and separated((0.1, 0.2), (0.3, 0.4)) == -1
    assert separated((0.3, 0.5), (0.4, 0.6)) == 0
    with pytest.raises(ValueError, match="without problems"):
        interval([])
