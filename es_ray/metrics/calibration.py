"""The simulation model the paired test is calibrated on (pure numpy): per-problem pass@k of two methods trained with
independent seeds, as in docs/comparison.md ("Calibration").

    logit[m, s, p] = theta_p + (mb)[m, p] + u[m, s] + (sb)[m, s, p] + shift_m
    theta_p ~ N(-1, 1.8^2)   (mb) ~ N(0, 0.6^2)   u ~ N(0, sv^2)   (sb) ~ N(0, 0.4^2)
    c ~ Binomial(n, sigmoid(logit)),   score = exact pass@k(n, c, k)

u is the seed's training shift (sv = 0: no training variance), shift_m the method's effect (0 under the null).
Used by tests/metrics/test_eval_paired.py (a subset that fits CI) and benchmarks/paired_calibration.py (the whole grid).
"""

from __future__ import annotations

import numpy as np

from es_ray.metrics.passk import pass_at_k

THETA = (-1.0, 1.8)
"""Mean and sd of the per-problem logit."""
SD_METHOD_PROBLEM, SD_SEED_PROBLEM = 0.6, 0.4


def passk_table(n: int, ks) -> np.ndarray:
    """[n + 1, len(ks)]: exact pass@k of a problem with c = 0..n correct of n samples."""
    return np.array([[pass_at_k(n, c, k) for k in ks] for c in range(n + 1)])


def simulate(
    rng: np.random.Generator,
    replicates: int,
    problems: int,
    seeds: int,
    sv: float,
    *,
    n: int = 32,
    ks=(1, 16, 32),
    shift: float = 0.0,
    seeds_b: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(a, b): [replicates, seeds, problems, len(ks)] pass@k of methods A and B on the same problems; B's logits are
    shifted by ``shift``; ``seeds_b`` seeds of B (default ``seeds``)."""
    table = passk_table(n, ks)
    theta = rng.normal(*THETA, size=(replicates, 1, problems))
    out = []
    for s, sh in ((seeds, 0.0), (seeds_b or seeds, shift)):
        logit = (
            theta
            + rng.normal(0, SD_METHOD_PROBLEM, size=(replicates, 1, problems))
            + rng.normal(0, sv, size=(replicates, s, 1))
            + rng.normal(0, SD_SEED_PROBLEM, size=(replicates, s, problems))
            + sh
        )
        out.append(table[rng.binomial(n, 1.0 / (1.0 + np.exp(-logit)))])
    return out[0], out[1]


def expected_passk(shift: float, sv: float, k: int, nodes: int = 80) -> float:
    """E[pass@k] of one method at logit shift ``shift`` (Gauss-Hermite over the logit's normal distribution;
    the unbiased estimator's expectation is 1 - (1 - p)^k)."""
    x, wts = np.polynomial.hermite_e.hermegauss(nodes)
    sd = np.sqrt(THETA[1] ** 2 + SD_METHOD_PROBLEM**2 + sv**2 + SD_SEED_PROBLEM**2)
    p = 1.0 / (1.0 + np.exp(-(THETA[0] + shift + sd * x)))
    return float(np.sum(wts * (1.0 - (1.0 - p) ** k)) / np.sum(wts))


def shift_for(effect: float, sv: float, k: int) -> float:
    """The logit shift of method B that makes E[pass@k of B] - E[pass@k of A] = ``effect`` (bisection)."""
    base = expected_passk(0.0, sv, k)
    if not 0 <= effect < 1 - base:
        raise ValueError(f"an effect of {effect} is out of reach from E[pass@{k}] = {base:.3f}")
    lo, hi = 0.0, 50.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_passk(mid, sv, k) - base < effect else (lo, mid)
    return (lo + hi) / 2
