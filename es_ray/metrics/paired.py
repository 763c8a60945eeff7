"""Paired differences between two methods scored on the same problems, with seeds as a random effect (numpy, scipy).

The methods answer the same problems, so the comparison is paired over problems; each method's seeds are its own
independent training runs, so seed s of method A is NOT paired with seed s of method B. The model behind the test
(method m, seed s, problem p; docs/comparison.md):

    y[m, s, p] = mu_m + u[m, s] + b_p + (mb)[m, p] + e[m, s, p]

u: the seed's training shift (training variance sigma_u,m^2), b: the problem's difficulty (it cancels in the paired
difference), mb: how the method does on that problem, e: the seed x problem interaction and the sampling noise of
the n samples. The estimate diff = mean y[B] - mean y[A] has

    Var(diff) = sum_m sigma_u,m^2 / S_m + (2 sigma_mb^2 + sum_m sigma_e,m^2 / S_m) / P

estimated without bias from three kinds of mean squares (crossed random-effects ANOVA, per task t, weights w_t):

    A_m   = var over seeds of method m's per-seed (weighted) mean          df S_m - 1
    R_m,t = method m's seed x problem residual mean square on task t       df (S_m - 1)(P_t - 1)
    Q_t   = var over problems of mean_s y[B] - mean_s y[A] on task t       df P_t - 1
    V     = sum_m A_m / S_m - sum_m,t w_t^2 R_m,t / (S_m P_t) + sum_t w_t^2 Q_t / P_t

V is floored at its problem part sum_t w_t^2 Q_t / P_t (a negative estimated training variance is 0). The reference
is Student's t at the Satterthwaite degrees of freedom of V with each method's seed term at its upper confidence
bound (SEED_BOUND = 95%, the bound the planning numbers use):

    A*_m  = max(A_m / S_m, sum_t w_t^2 R_m,t / (S_m P_t)) (S_m - 1) / chi^2_{S_m - 1}(0.05)
    df    = V*^2 / sum_i (c_i MS_i)^2 / df_i   over the terms of V with A*_m for A_m / S_m (V* their sum)

never fewer than min(S_A, S_B) - 1, and whether or not V sits at its floor (254 A_m for one degree of freedom,
19.5 for two, 5.6 for four). Why: seeds that happen to agree say nothing about the training variance, and a df
estimated from the seed terms as they fell grows exactly when they fell low, so the t tail was thinnest where the
variance was most underestimated: 10-12% at 5% with training variance in one method only (2 seeds), 0.6-2.1% at
5% / 40 (Holm's first threshold) against a nominal 0.125% (benchmarks/paired_calibration.py, docs/comparison.md).
With the bound the level is at most nominal at 5% / 40 and 7.5% at 5% on the calibration grid and with training
variance in one method; the price is paid at 2-3 seeds, where the test is conservative (0-3% at 5%): two seeds of a
method that agree are explained as well by a method effect as by a large training variance whose two draws landed
together, and only more seeds tell them apart. p is two-sided, floored at 2^(1 - P), the smallest p an exact
sign-flip test on P problems can give. With one seed per method there is no training variance to estimate: the test
then compares two checkpoints (this run of A against this run of B), and no method-level claim follows from it.

Power (``power``): the smallest difference this test finds with the given power at level alpha', the test itself
simulated (``_test_power``: its mean squares drawn from their chi-square distributions at the planning variance,
its V, df and threshold computed from each draw); the report takes alpha' = alpha / m, the first step of Holm's
procedure over a family of m tests (what a single real effect among m must clear). The planning variance takes
sigma_u^2 pooled over the two methods from the seed mean squares at their 95% upper confidence bound (each at least
its residual part, as in the df): with 2-5 seeds the point estimate is too unstable to plan on. ``problems_needed``
and ``seeds_needed`` plan from the same components, from PLAN_SEEDS seeds up; with one seed they say it cannot be
estimated.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
from scipy import stats


def t_two_sided_p(t, df):
    """P(|T| >= |t|) for Student's T with ``df`` (any positive real) degrees of freedom, elementwise (scipy.stats)."""
    return 2.0 * stats.t.sf(np.abs(np.asarray(t, dtype=np.float64)), np.asarray(df, dtype=np.float64))


@lru_cache(maxsize=65536)
def t_quantile(q: float, df: float) -> float:
    """The q-quantile (0 < q < 1) of Student's t with ``df`` degrees of freedom (scipy.stats)."""
    return float(stats.t.ppf(q, df))


@dataclass(frozen=True)
class Paired:
    diff: float
    """mean of b - a over seeds and problems (the report's weighting over tasks)."""
    low: float
    high: float
    """the t interval of diff at ``level``."""
    p: float
    """two-sided p-value of diff = 0."""
    level: float
    problems: int
    seeds: int
    """seeds per method (the fewer of the two where they differ)."""
    seeds_a: int
    seeds_b: int
    se: float
    df: float
    """Satterthwaite degrees of freedom of the t reference (the seed terms at their upper bound)."""
    var_training: float
    """the estimated training (seed) share of se^2, sum_m sigma_u,m^2 / S_m (0 with one seed per method)."""

    @property
    def checkpoints_only(self) -> bool:
        """One seed of a method: its training variance is unknown, the test compares these two runs only."""
        return min(self.seeds_a, self.seeds_b) < 2


def _as_scores(x, where: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2 or x.shape[0] < 1:
        raise ValueError(f"paired scores are (seeds, problems) or (problems,) arrays{where}, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"paired scores contain NaN or infinite values{where}: score every problem of every seed")
    return x


def _as_pair(a, b, where: str = "") -> tuple[np.ndarray, np.ndarray]:
    """(a, b) as (seeds_a, problems) and (seeds_b, problems) float arrays, refusing what cannot be paired."""
    a, b = _as_scores(a, where), _as_scores(b, where)
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"paired scores need the same problems{where}: got {a.shape[1]} and {b.shape[1]} problems "
            f"(shapes {a.shape} and {b.shape})"
        )
    if a.shape[1] < 2:
        raise ValueError(f"a paired difference needs at least two common problems{where}, got {a.shape[1]}")
    return a, b


def _weights(weights, n: int) -> np.ndarray:
    w = np.full(n, 1.0 / n) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (n,) or (w < 0).any() or not w.sum() > 0:
        raise ValueError(f"task weights must be {n} non-negative numbers with a positive sum, got {weights}")
    return w / w.sum()


def _residual_ms(x: np.ndarray) -> np.ndarray:
    """[..., S, P] -> [...] the seed x problem residual mean square (two-way ANOVA without replication)."""
    s, p = x.shape[-2:]
    res = x - x.mean(-1, keepdims=True) - x.mean(-2, keepdims=True) + x.mean((-2, -1), keepdims=True)
    return (res**2).sum((-2, -1)) / ((s - 1) * (p - 1))


def components(pairs: Sequence[tuple], w: np.ndarray) -> dict:
    """The mean squares of the crossed model (module docstring) for [(a_t, b_t)] with [..., S, P_t] arrays (leading
    batch axes broadcast: the calibration runs thousands of replicates at once). Returns diff, V (floored), df (each
    seed term at its upper bound, ``_seed_bound``), and the parts the power needs: seed terms A_m / S_m, residual
    mean squares R_m,t, problem terms Q_t."""
    s_a, s_b = pairs[0][0].shape[-2], pairs[0][1].shape[-2]
    diff = sum(wt * (b.mean((-2, -1)) - a.mean((-2, -1))) for wt, (a, b) in zip(w, pairs))
    q = [(b.mean(-2) - a.mean(-2)).var(-1, ddof=1) for a, b in pairs]
    problem_part = sum(wt**2 * qt / a.shape[-1] for wt, qt, (a, _) in zip(w, q, pairs))
    terms = [(wt**2 * qt / a.shape[-1], a.shape[-1] - 1) for wt, qt, (a, _) in zip(w, q, pairs)]  # (c_i MS_i, df_i)
    df_terms = list(terms)  # the same with each seed term at its upper bound
    seed_terms, seed_ms, resid = [], [], []
    for side, s in ((0, s_a), (1, s_b)):
        if s < 2:
            resid.append(None)
            continue
        per_seed = sum(wt * x[side].mean(-1) for wt, x in zip(w, pairs))
        a_m = per_seed.var(-1, ddof=1) / s
        r_mt = [_residual_ms(x[side]) for x in pairs]
        r_terms = [
            (-(wt**2) * r / (s * x[side].shape[-1]), (s - 1) * (x[side].shape[-1] - 1))
            for wt, r, x in zip(w, r_mt, pairs)
        ]
        seed_terms.append(a_m + sum(c for c, _ in r_terms))
        seed_ms.append((a_m, -sum(c for c, _ in r_terms)))
        resid.append(r_mt)
        terms += [(a_m, s - 1)] + r_terms
        # E[A_m / S_m] >= its residual part (estimated on (S - 1)(P - 1) df): the bound starts from the larger
        df_terms += [(np.maximum(a_m, -sum(c for c, _ in r_terms)) * _seed_bound(s - 1), s - 1)] + r_terms
    v_raw = sum(c for c, _ in terms)
    v = np.maximum(v_raw, problem_part)
    v_bound = sum(c for c, _ in df_terms)
    den = sum(c**2 / d for c, d in df_terms)
    with np.errstate(divide="ignore", invalid="ignore"):
        df = np.where(den > 0, v_bound**2 / np.where(den > 0, den, 1.0), np.inf)
    df = np.maximum(np.where(v_bound > 0, df, 1.0), max(1, min(s_a, s_b) - 1))
    training = sum(seed_terms) if seed_terms else 0.0 * v
    return {
        "diff": diff,
        "v": v,
        "df": df,
        "training": np.maximum(training, 0.0),
        "q": q,
        "resid": resid,
        "seed_ms": seed_ms,
        "seeds": (s_a, s_b),
    }


def t_test(pairs: Sequence[tuple], weights=None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Vectorised test: [(a_t, b_t)] with [..., S, P_t] arrays -> (diff, se, df, p) with the leading batch shape."""
    w = _weights(weights, len(pairs))
    c = components(pairs, w)
    se = np.sqrt(c["v"])
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(se > 0, c["diff"] / np.where(se > 0, se, 1.0), 0.0)
    p = np.where(se > 0, t_two_sided_p(t, np.minimum(c["df"], 1e12)), np.where(c["diff"] == 0, 1.0, 0.0))
    floor = 2.0 ** (1 - min(a.shape[-1] for a, _ in pairs))
    return c["diff"], se, c["df"], np.clip(p, floor, 1.0)


def paired_difference(a, b, *, level: float = 0.95) -> Paired:
    """The paired test of mean(b - a); ``a`` (seeds_a, problems), ``b`` (seeds_b, problems) (1-D: one seed)."""
    return paired_difference_tasks([(a, b)], level=level)


def paired_difference_tasks(pairs: Sequence[tuple], weights=None, *, level: float = 0.95) -> Paired:
    """The test over tasks: ``pairs`` [(a_t, b_t)] per task, a_t (seeds_a, problems_t), b_t (seeds_b, problems_t),
    each method's seeds the same runs on every task (one seed's run answers them all); diff = sum_t w_t
    mean(b_t - a_t), tasks weighted equally unless ``weights``."""
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if not pairs:
        raise ValueError("a paired difference needs at least one task")
    arr = [_as_pair(a, b, f" (task {i})" if len(pairs) > 1 else "") for i, (a, b) in enumerate(pairs)]
    for side, name in ((0, "first"), (1, "second")):
        if len({x[side].shape[0] for x in arr}) > 1:
            raise ValueError(
                f"every task needs the same seeds of the {name} method, got "
                f"{[x[side].shape[0] for x in arr]} seeds per task"
            )
    w = _weights(weights, len(arr))
    diff, se, df, p = (float(v) for v in t_test(arr, w))
    half = t_quantile(0.5 + level / 2, df) * se
    c = components(arr, w)
    s_a, s_b = arr[0][0].shape[0], arr[0][1].shape[0]
    return Paired(
        diff=diff,
        low=diff - half,
        high=diff + half,
        p=p,
        level=level,
        problems=sum(x[0].shape[1] for x in arr),
        seeds=min(s_a, s_b),
        seeds_a=s_a,
        seeds_b=s_b,
        se=se,
        df=df,
        var_training=float(c["training"]),
    )


def welch(a, b, *, level: float = 0.95) -> Paired:
    """mean(b) - mean(a) of two independent samples (one value per seed's run, e.g. drift L2), Welch's t."""
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    if min(a.size, b.size) < 2:
        raise ValueError(f"Welch's test needs at least two runs of each method, got {a.size} and {b.size}")
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    v = va + vb
    diff = float(b.mean() - a.mean())
    df = v**2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1)) if v > 0 else math.inf
    se = math.sqrt(v)
    p = float(t_two_sided_p(diff / se, min(df, 1e12))) if se > 0 else (1.0 if diff == 0 else 0.0)
    half = t_quantile(0.5 + level / 2, min(df, 1e12)) * se
    return Paired(
        diff=diff,
        low=diff - half,
        high=diff + half,
        p=p,
        level=level,
        problems=0,
        seeds=min(a.size, b.size),
        seeds_a=a.size,
        seeds_b=b.size,
        se=se,
        df=float(df),
        var_training=v,
    )


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


def _seed_bound(dof: float) -> float:
    """The factor that takes a mean square on ``dof`` degrees of freedom to its SEED_BOUND upper confidence bound,
    dof / chi^2_{dof}(1 - SEED_BOUND): 254 for one degree of freedom, 19.5 for two, 5.6 for four."""
    return dof / float(stats.chi2.ppf(1 - SEED_BOUND, dof))


SEED_BOUND = 0.95
"""The upper confidence level at which the planning numbers take the training variance."""
PLAN_SEEDS = 10
"""The fewest seeds per method from which problems_needed / seeds_needed plan: below it the training variance cannot
be estimated well enough to plan on: in benchmarks/paired_calibration.py's check (the power a fresh experiment has at
the printed figure) problems_needed delivered 38% at 3 seeds and 36-74% at 5, seeds_needed 61% and 71-73%, short of
75% (with the previous power multiplier); at 10 seeds, with the test simulated, 89% and 83% (100 problems, sv 0.15,
pass@16). The detectable size is still given, at the bound (99-100% where printed, 3-5 seeds)."""


@dataclass(frozen=True)
class Power:
    se: float
    """standard error of the paired difference (problems and seeds)."""
    df: float
    detectable: float | None
    """smallest |difference| found with ``power`` by the test at ``alpha`` with these problems and seeds (None where
    every paired difference is equal: no variance to size it from)."""
    var_problems: float
    """2 sigma_mb^2 (weighted over tasks, per problem of a task of average size): the method x problem part."""
    var_residual: tuple[float, float]
    """sigma_e^2 of each method (seed x problem interaction and sampling noise; weighted like var_problems)."""
    var_seeds: float | None
    """sigma_u^2 pooled over the two methods at its SEED_BOUND upper confidence bound (None with one seed: it cannot
    be estimated)."""
    problems: int
    seeds: int
    alpha: float
    power: float
    mean: float | None = None
    """the mean score where every score lies in [0, 1] (pass@k), else None: a difference of d from it raises the
    moving method's residual variance by g = (m + d)(1 - m - d) / (m (1 - m)) where that exceeds 1 (``_growth``), and
    its seed and method x problem variances by g^2 (they act through the metric's slope, ``_reach``)."""
    sides: int = 2
    """2: the two-sided test; 1: the one-sided test in the claimed direction (the verdict's primary family)."""
    bounded: bool = True
    """True: var_seeds at its SEED_BOUND upper bound and the least favourable split of it between the methods (an
    upper bound on the size, 2-4x the median at 3-5 seeds); False: at its point estimate, each method carrying its
    pooled share, so ``detectable`` is the size the test finds with ``power`` at the estimated variance (the
    verdict's figures, es_ray/metrics/verdict.py)."""
    moves: int = 0
    """Which way the moving method's score goes from ``mean`` (``_growth``): +1 up (the first method rising), -1 down
    (the second falling), 0 whichever brings the larger variance (a size found with ``power`` either way, and more
    often where the other one moves: 88-93% near a [0, 1] metric's ends)."""

    def _growth(self, effect: float) -> float:
        """How much the second method's variance components grow at ``effect`` from the mean: a score in [0, 1]
        varies like a proportion, m (1 - m), so near 0 a real difference brings variance the no-effect figures lack
        (pass@1 near 2%: the printed size was found 45-65% of the time without it)."""
        m = self.mean
        if m is None or not 0 < m < 1:
            return 1.0
        # which method moves is not known: near 1 the gap can be the second falling from the ceiling (pass@32 at
        # 94%: a 4-point gap with the second at 90% has 1.5x the variance; the printed size was found 58% of the
        # time without it, benchmarks/verdict_audit.py), near 0 the first rising from the floor; the larger of the two
        moved = [min(m + abs(effect), 1.0)] * (self.moves >= 0) + [max(m - abs(effect), 0.0)] * (self.moves <= 0)
        return max(1.0, max(s * (1 - s) for s in moved) / (m * (1 - m)))

    @property
    def can_plan(self) -> bool:
        """Whether the training variance is estimated from enough seeds (PLAN_SEEDS) to plan problems or seeds."""
        return (
            self.var_seeds is not None
            and self.detectable is not None
            and (self.seeds >= PLAN_SEEDS or not self.bounded)
        )

    def _plan(self, problems: float, seeds: int) -> tuple[float, float]:
        """(se, df) expected at ``problems`` per task and ``seeds`` per method, from the components."""
        u = self.var_seeds or 0.0
        p_term = (self.var_problems + sum(self.var_residual) / seeds) / problems
        seed_terms = [(u + r / problems) / seeds for r in self.var_residual] if seeds > 1 else []
        res_terms = [r / (seeds * problems) for r in self.var_residual] if seeds > 1 else []
        v = p_term + sum(seed_terms) - sum(res_terms)
        # the df the test will use: its seed terms at their upper bound (``components``)
        bound = [t * _seed_bound(seeds - 1) for t in seed_terms] if seeds > 1 else []
        v_bound = p_term + sum(bound) - sum(res_terms)
        den = (
            p_term**2 / (problems - 1)
            + sum(t**2 / (seeds - 1) for t in bound)
            + sum(t**2 / ((seeds - 1) * (problems - 1)) for t in res_terms)
        )
        return math.sqrt(max(v, p_term)), max(seeds - 1, v_bound**2 / den if den > 0 else math.inf)

    def _reach(self, problems: float, seeds: int):
        """effect -> the probability that the test (its own V, df and threshold) rejects at ``alpha`` with
        ``problems`` and ``seeds``, from the components (``_test_power``; one seed: this run's se and df)."""
        if seeds < 2 or self.var_seeds is None:
            if self.var_seeds is not None:
                se, df = self._plan(problems, seeds)
            else:  # this run's problems scaled to ``problems`` (the checkpoint test: a t over problems)
                se = self.se * math.sqrt(self.problems / problems)
                df = max(1.0, self.df * (problems - 1) / max(1, self.problems - 1))
            crit = t_quantile(1 - self.alpha / self.sides, min(df, 1e12))
            return lambda effect: (
                _reach_t(effect / (se * math.sqrt((1 + self._growth(effect)) / 2)), crit, df, self.sides)
                if se > 0
                else float(effect != 0)
            )
        r_a, r_b = self.var_residual

        def reach(effect: float) -> float:
            g = self._growth(effect)
            # the seed shift and the method x problem interaction act through the metric's slope, which moves as
            # m (1 - m) does: their variances grow by its square (the delta method); the residual holds the samples'
            # binomial noise, which grows by g itself
            g2 = g * g
            # which method carries the training variance is not known (a base model's seeds vary by sampling
            # alone): the split of the same total that the test finds least often
            return min(
                _test_power(
                    float(self.var_problems * (1 + g2) / 2),
                    float(r_a),
                    float(r_b * g),
                    float(self.var_seeds * w_a),
                    float(self.var_seeds * (2 - w_a) * g2),
                    float(problems),
                    int(seeds),
                    float(self.alpha),
                    self.sides,
                )(effect)
                for w_a in ((1.0, 0.0, 2.0) if self.bounded else (1.0,))
            )

        return reach

    def reaches(self, effect: float, problems: float, seeds: int) -> float:
        """The power of the test at ``effect`` with ``problems`` per task and ``seeds`` per method."""
        return self._reach(problems, seeds)(abs(effect))

    def _detects(self, effect: float, problems: float, seeds: int) -> bool:
        return self._reach(problems, seeds)(abs(effect)) >= self.power

    def problems_needed(self, effect: float, limit: int = 10**7) -> int | None:
        """Problems per task (scaled like this run's) that find ``effect`` with this power at the run's seeds; None
        where the training variance is unknown (one seed) or alone keeps it out of reach at these seeds."""
        checkpoint = not self.bounded and self.var_seeds is None and self.detectable is not None
        if not (self.can_plan or checkpoint) or not self._detects(effect, limit, self.seeds):
            return None
        lo, hi = 2, limit
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self._detects(effect, mid, self.seeds) else (mid + 1, hi)
        return lo

    def seeds_needed(self, effect: float, limit: int = 1000) -> int | None:
        """Seeds per method that find ``effect`` at this run's problems; None with one seed (the training variance
        cannot be estimated from it) or where the problems' variance alone keeps it out of reach."""
        if not self.can_plan:
            return None
        return next((s for s in range(2, limit + 1) if self._detects(effect, self.problems, s)), None)


POWER_DRAWS = 4000
"""Draws of the test's mean squares behind each power figure (``_test_power``; fixed, so figures repeat)."""


def _t_crit(alpha: float, df) -> np.ndarray:
    """t_{1 - alpha/2, df} elementwise (scipy.stats)."""
    return stats.t.ppf(1 - alpha / 2, np.asarray(df, dtype=np.float64))


def _reach_t(lam: float, crit: float, df: float, sides: int = 2) -> float:
    """P(|T| > crit) (``sides`` 1: P(T > crit)) for T = (Z + lam) / sqrt(chi^2_df / df), over 400 quantiles of
    chi^2_df."""
    u = (np.arange(400) + 0.5) / 400
    scale = np.ones_like(u) if df > 1e6 else np.sqrt(stats.chi2.ppf(u, df) / df)
    upper = stats.norm.cdf(lam - crit * scale)
    return float(np.mean(upper if sides == 1 else upper + stats.norm.cdf(-lam - crit * scale)))


@lru_cache(maxsize=1024)
def _test_power(
    mb: float, r_a: float, r_b: float, u_a: float, u_b: float, problems: float, seeds: int, alpha: float, sides: int = 2
):
    """effect -> the probability that the paired test rejects at ``alpha`` (two-sided) in a fresh experiment with
    ``problems`` per task and ``seeds`` per method, where 2 sigma_mb^2 = ``mb``, sigma_e,m^2 = ``r_a``, ``r_b`` and
    sigma_u,m^2 = ``u_a``, ``u_b``: the test's own mean squares drawn POWER_DRAWS times from their scaled chi-square
    distributions (independent under the normal model), V, df and threshold computed from each draw exactly as
    ``components`` does, the difference normal around ``effect`` with the true variance."""
    rng = np.random.default_rng(20261205)
    d_q, d_s, d_r = problems - 1, seeds - 1, (seeds - 1) * (problems - 1)
    q = (mb + (r_a + r_b) / seeds) / problems * rng.chisquare(d_q, POWER_DRAWS) / d_q
    true_v = (mb + (r_a + r_b) / seeds) / problems + (u_a + u_b) / seeds
    v_raw, v_bound, den = q.copy(), q.copy(), q**2 / d_q
    for r, u in ((r_a, u_a), (r_b, u_b)):
        a_m = (u + r / problems) / seeds * rng.chisquare(d_s, POWER_DRAWS) / d_s
        r_m = r / (seeds * problems) * rng.chisquare(d_r, POWER_DRAWS) / d_r
        b_m = np.maximum(a_m, r_m) * _seed_bound(d_s)
        v_raw, v_bound = v_raw + a_m - r_m, v_bound + b_m - r_m
        den = den + b_m**2 / d_s + r_m**2 / d_r
    with np.errstate(divide="ignore", invalid="ignore"):
        df = np.where((den > 0) & (v_bound > 0), v_bound**2 / np.where(den > 0, den, 1.0), 1.0)
    df = np.maximum(df, max(1, d_s))
    threshold = _t_crit(alpha * (2 if sides == 1 else 1), df) * np.sqrt(np.maximum(v_raw, q))
    sd = math.sqrt(true_v)
    if not sd > 0:
        return lambda effect: float(effect != 0)
    if sides == 1:  # the claimed direction only
        return lambda effect: float(np.mean(stats.norm.cdf((effect - threshold) / sd)))
    return lambda effect: float(
        np.mean(stats.norm.cdf((effect - threshold) / sd) + stats.norm.cdf((-effect - threshold) / sd))
    )


def _detectable(reach, power: float, scale: float) -> float:
    """The smallest effect with reach(effect) >= power (bisection; ``scale`` a first guess at its size)."""
    lo, hi = 0.0, max(scale, 1e-12)
    for _ in range(200):  # doubling: every threshold is finite, so reach -> 1
        if reach(hi) >= power:
            break
        lo, hi = hi, hi * 2.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if reach(mid) < power else (lo, mid)
    return hi


def power(
    pairs: Sequence[tuple],
    weights=None,
    *,
    alpha: float = 0.05,
    power: float = 0.8,
    bound: bool = True,
    sides: int = 2,
    moves: int = 0,
) -> Power:
    """The smallest difference the test finds with ``power`` at level ``alpha`` (pass the threshold the verdict
    uses: alpha / m under Holm), and the components ``problems_needed``/``seeds_needed`` plan from; ``pairs`` as for
    ``paired_difference_tasks``. ``bound``: the training variance at its upper bound (``Power.bounded``), else at its
    point estimate; ``sides``: 1 for the one-sided test; ``moves``: which way the gap moves a [0, 1] score
    (``Power.moves``)."""
    arr = [_as_pair(a, b) for a, b in pairs]
    w = _weights(weights, len(arr))
    c = components(arr, w)
    se, df = float(np.sqrt(c["v"])), float(c["df"])
    s_a, s_b = c["seeds"]
    mean_p = sum(x[0].shape[1] for x in arr) / len(arr)
    # Per problem of a task of average size, so the plan scales every task alike.
    resid = [
        0.0 if r is None else float(sum(wt**2 * rt * mean_p / x[0].shape[1] for wt, rt, x in zip(w, r, arr)))
        for r in c["resid"]
    ]
    q = float(sum(wt**2 * qt * mean_p / x[0].shape[1] for wt, qt, x in zip(w, c["q"], arr)))
    mb = max(0.0, q - resid[0] / s_a - resid[1] / s_b)
    if min(s_a, s_b) < 2:
        var_seeds = None
    elif not bound:  # the point estimate, pooled: E[sum_m A_m / S_m - residual parts] = sigma_u^2 sum_m 1 / S_m
        var_seeds = max(0.0, sum(float(a_m) - float(r_m) for a_m, r_m in c["seed_ms"])) / (1 / s_a + 1 / s_b)
    else:  # pooled over both methods: the sum of the seed mean squares (each at least its residual part, as in
        # the test's df) at its upper confidence bound on Satterthwaite's df (S_A + S_B - 2 when the two are alike,
        # S - 1 when one method carries it all), less the residual parts
        ms = [max(float(a_m), float(r_m)) for a_m, r_m in c["seed_ms"]]
        dof = max(
            min(s_a, s_b) - 1,
            sum(ms) ** 2 / (ms[0] ** 2 / (s_a - 1) + ms[1] ** 2 / (s_b - 1)) if sum(ms) > 0 else s_a + s_b - 2,
        )
        seed_ms = sum(ms) * _seed_bound(dof)
        var_seeds = max(0.0, seed_ms - sum(float(r_m) for _, r_m in c["seed_ms"])) / (1 / s_a + 1 / s_b)
    bounded = all(((a >= 0) & (a <= 1)).all() and ((b >= 0) & (b <= 1)).all() for a, b in arr)
    mean = float(sum(wt * (a.mean() + b.mean()) / 2 for wt, (a, b) in zip(w, arr))) if bounded else None
    out = Power(
        se=se,
        df=df,
        detectable=None,
        var_problems=mb,
        var_residual=(resid[0], resid[1]),
        var_seeds=var_seeds,
        problems=round(mean_p),
        seeds=min(s_a, s_b),
        alpha=alpha,
        power=power,
        mean=mean,
        sides=sides,
        bounded=bound,
        moves=moves,
    )
    if se <= 0:
        return out
    # With seeds: at the planning variance (training variance at its upper bound), so the printed size is one the
    # test finds with this power however low the seeds happened to land; with one seed: this run's own se.
    plan_se = out._plan(mean_p, min(s_a, s_b))[0] if var_seeds is not None else se
    return dataclasses.replace(out, detectable=_detectable(out._reach(mean_p, min(s_a, s_b)), power, 4 * plan_se))
