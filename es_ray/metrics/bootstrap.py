"""Uncertainty of a mean over problems, by the percentile bootstrap (pure numpy).

``interval(values_p)``: resample the P problems with replacement B times and take the 2.5 / 97.5 percentiles of the
resampled means. ``interval_of_task_means([values_p per task])``: the same for the average over tasks, each task's
problems resampled within the task (so every replicate keeps every task). These intervals describe one method;
two methods scored on the same problems are compared paired (``es_ray.metrics.paired``). ``separated`` (do two
marginal intervals not overlap?) is the rule that replaced: kept to show in the tests how rarely it sees a real
difference between correlated methods.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

DRAWS = 2000


def interval(values_p: Sequence[float], draws: int = DRAWS, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    return interval_of_task_means([values_p], draws, level, seed)


def interval_of_task_means(
    values_tp: Sequence[Sequence[float]], draws: int = DRAWS, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile interval of mean_t(mean_p values[t][p]), problems resampled within each task."""
    rng = np.random.default_rng(seed)
    means = np.zeros(draws)
    for values in values_tp:
        v = np.asarray(values, dtype=np.float64)
        if v.size == 0:
            raise ValueError("a task without problems has no mean to bootstrap")
        means += v[rng.integers(0, v.size, size=(draws, v.size))].mean(axis=1)
    means /= len(values_tp)
    alpha = (1.0 - level) / 2.0
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1.0 - alpha))


def separated(a: tuple[float, float], b: tuple[float, float]) -> int:
    """+1 if interval a lies above b, -1 if below, 0 if they overlap."""
    if a[0] > b[1]:
        return 1
    if a[1] < b[0]:
        return -1
    return 0
