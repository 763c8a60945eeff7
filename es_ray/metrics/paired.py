"""Paired differences between two methods scored on the same problems, with their power (pure numpy).

The methods of a comparison answer the same problems, so their per-problem scores are strongly correlated and
problem difficulty dominates each method's own interval; two marginal intervals that overlap say little. Here
the per-problem difference d[s, p] = b[s, p] - a[s, p] (seed s, problem p) is resampled instead:

    diff   = mean_{s,p} d[s, p]
    draw   = mean over a resample of the problems (and, with more than one seed, of the seeds: the seeds' runs
             are a second level of noise, training variance, that a bootstrap of problems alone ignores)
    [low, high] = the (1 - level) / 2 and (1 + level) / 2 percentiles of the draws
    p      = min(1, 2 min(share of draws <= 0, share of draws >= 0))   (two-sided; p < 1 - level iff 0 lies
             outside the interval), floored at 2^(1 - P), the smallest p an exact sign-flip test on P problems
             can give (a few problems resample into few distinct draws), and at 1 / draws

Over tasks (``paired_difference_tasks``) each task is a stratum: its problems are resampled within it, the seeds
once for all tasks (one seed's run answers every task), and the tasks' differences are averaged with the weights
the report gives them (equal by default: the report's "average" is the mean over tasks).

Power (``power``): with the observed variance of the per-problem differences (averaged over seeds) var_p and of
the per-seed differences (averaged over problems) var_s, the standard error of diff is
se = sqrt(sum_t w_t^2 var_p,t / P_t + var_s / S), and the smallest difference a two-sided test at alpha finds
with the given power is (z_{1 - alpha/2} + z_power) se. The problems (or seeds) an effect delta needs solve the
same equation for P (or S).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Sequence

import numpy as np

DRAWS = 2000


@dataclass(frozen=True)
class Paired:
    diff: float
    """mean of b - a over seeds and problems (the report's weighting over tasks)."""
    low: float
    high: float
    """the bootstrap interval of diff at ``level``."""
    p: float
    """two-sided bootstrap p-value of diff = 0."""
    level: float
    problems: int
    seeds: int


def _as_pair(a, b, where: str = "") -> np.ndarray:
    """b - a as a (seeds, problems) float array, refusing what cannot be paired."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired scores need the same shape (the same seeds and problems){where}: got {a.shape} and "
                         f"{b.shape}")
    if a.ndim == 1:
        a, b = a[None, :], b[None, :]
    if a.ndim != 2:
        raise ValueError(f"paired scores are (seeds, problems) or (problems,) arrays{where}, got shape {a.shape}")
    if a.shape[1] < 2:
        raise ValueError(f"a paired difference needs at least two common problems{where}, got {a.shape[1]}")
    if a.shape[0] < 1:
        raise ValueError(f"a paired difference needs at least one seed{where}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError(f"paired scores contain NaN or infinite values{where}: score every problem of every seed")
    return b - a


def _weights(weights, n: int) -> np.ndarray:
    w = np.full(n, 1.0 / n) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (n,) or (w < 0).any() or not w.sum() > 0:
        raise ValueError(f"task weights must be {n} non-negative numbers with a positive sum, got {weights}")
    return w / w.sum()


def paired_difference(a, b, *, level: float = 0.95, draws: int = DRAWS, seed: int = 0) -> Paired:
    """Paired bootstrap of mean(b - a); ``a``, ``b``: (seeds, problems) per-problem scores (1-D: one seed)."""
    return paired_difference_tasks([(a, b)], level=level, draws=draws, seed=seed)


def paired_difference_tasks(pairs: Sequence[tuple], weights=None, *, level: float = 0.95, draws: int = DRAWS,
                            seed: int = 0) -> Paired:
    """Stratified paired bootstrap over tasks: ``pairs`` [(a_t, b_t)] per task, each (seeds, problems_t) with the
    same seeds; diff = sum_t w_t mean(b_t - a_t)."""
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if not pairs:
        raise ValueError("a paired difference needs at least one task")
    d = [_as_pair(a, b, f" (task {i})" if len(pairs) > 1 else "") for i, (a, b) in enumerate(pairs)]
    seeds = d[0].shape[0]
    if any(x.shape[0] != seeds for x in d):
        raise ValueError(f"every task needs the same seeds, got {[x.shape[0] for x in d]} seeds per task")
    w = _weights(weights, len(d))
    rng = np.random.default_rng(seed)
    # Draw j uses seed s c_s[j, s] times, so its per-problem differences are c_s[j] @ d / S; the problems are then
    # resampled by index (the same seeds for every task: one seed's run answers them all).
    c_s = (rng.multinomial(seeds, np.full(seeds, 1.0 / seeds), size=draws).astype(np.float64) if seeds > 1
           else np.ones((draws, 1)))
    boot = np.zeros(draws)
    for wt, x in zip(w, d):
        idx = rng.integers(0, x.shape[1], size=(draws, x.shape[1]))
        boot += wt * np.take_along_axis(c_s @ x, idx, axis=1).mean(axis=1) / seeds
    diff = float(sum(wt * x.mean() for wt, x in zip(w, d)))
    tail = (1.0 - level) / 2.0
    low, high = (float(v) for v in np.quantile(boot, [tail, 1.0 - tail]))
    # Floored at the smallest two-sided p an exact sign-flip test on these problems can give (2^(1 - P)): a
    # handful of problems resamples into few distinct draws, which would otherwise all fall on one side of 0;
    # and at 1 / draws, the resolution of the draws themselves.
    floor = max(2.0 ** (1 - min(x.shape[1] for x in d)), 1.0 / draws)
    pval = min(1.0, max(floor, 2.0 * min(float(np.mean(boot <= 0)), float(np.mean(boot >= 0)))))
    return Paired(diff=diff, low=low, high=high, p=pval, level=level, problems=sum(x.shape[1] for x in d),
                  seeds=seeds)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error at alpha: reject where adjusted p < alpha)."""
    p = np.asarray(pvalues, dtype=np.float64)
    if p.size == 0:
        return []
    if not (np.isfinite(p).all() and ((p >= 0) & (p <= 1)).all()):
        raise ValueError(f"p-values must lie in [0, 1], got {list(pvalues)}")
    order = np.argsort(p, kind="stable")
    m = p.size
    adjusted = np.maximum.accumulate((m - np.arange(m)) * p[order])
    out = np.empty(m)
    out[order] = np.minimum(1.0, adjusted)
    return out.tolist()


@dataclass(frozen=True)
class Power:
    se: float
    """standard error of the paired difference (problems and seeds)."""
    detectable: float | None
    """smallest |difference| found with ``power`` by a two-sided test at ``alpha`` with these problems and seeds
    (None where every paired difference is equal: no variance to size it from)."""
    var_problems: float
    """variance over problems of the per-problem difference (averaged over seeds; weighted over tasks)."""
    var_seeds: float
    """variance over seeds of the per-seed difference (averaged over problems); 0 with one seed."""
    problems: int
    seeds: int
    alpha: float
    power: float

    @property
    def z(self) -> float:
        nd = NormalDist()
        return nd.inv_cdf(1 - self.alpha / 2) + nd.inv_cdf(self.power)

    def problems_needed(self, effect: float) -> int | None:
        """Problems (scaled like this run's, per task) that find ``effect`` with this power at the run's seeds;
        None where the seeds' variance alone keeps it out of reach (more seeds are needed)."""
        room = (abs(effect) / self.z) ** 2 - self.var_seeds / self.seeds
        if room <= 0 or self.detectable is None:
            return None
        return max(2, math.ceil(self.var_problems / room))

    def seeds_needed(self, effect: float) -> int | None:
        """Seeds that find ``effect`` at this run's problems; None where the problems' variance alone keeps it out
        of reach, or with one seed (its seed variance is unknown)."""
        if self.seeds < 2 or self.detectable is None:
            return None
        room = (abs(effect) / self.z) ** 2 - self.var_problems / self.problems
        if room <= 0:
            return None
        return max(2, math.ceil(self.var_seeds / room)) if self.var_seeds > 0 else 2


def power(pairs: Sequence[tuple], weights=None, *, alpha: float = 0.05, power: float = 0.8) -> Power:
    """The smallest detectable paired difference from the observed variances (see the module docstring);
    ``pairs`` as for ``paired_difference_tasks`` (one (a, b) pair for one task)."""
    d = [_as_pair(a, b) for a, b in pairs]
    w = _weights(weights, len(d))
    seeds = d[0].shape[0]
    # var_problems is kept per problem of a task of average size, so problems_needed scales every task alike.
    var_mean_p = float(sum(wt ** 2 * x.mean(axis=0).var(ddof=1) / x.shape[1] for wt, x in zip(w, d)))
    mean_problems = sum(x.shape[1] for x in d) / len(d)
    per_seed = sum(wt * x.mean(axis=1) for wt, x in zip(w, d))
    var_s = float(per_seed.var(ddof=1)) if seeds > 1 else 0.0
    se = math.sqrt(var_mean_p + var_s / seeds)
    out = Power(se=se, detectable=0.0, var_problems=var_mean_p * mean_problems, var_seeds=var_s,
                problems=round(mean_problems), seeds=seeds, alpha=alpha, power=power)
    return Power(**{**out.__dict__, "detectable": out.z * se if se > 0 else None})
