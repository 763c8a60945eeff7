"""A null model of ES weight drift: what an ES run's L2 distance and "functional sparsity" would be whatever the
rewards were (pure: math only).

One ES step with SGD is ``lr / (N sigma) * sum_i z_i eps_i`` (one-point estimator, eps_i standard normal, the
shaped fitness z_i fixed before the noise is drawn). Each coordinate of the step is then Normal(0, s1^2) with

    s1^2 = (lr / (N sigma))^2 * sum_i z_i^2

and it does not depend on which member did well: z-scoring gives sum z^2 = N exactly (any rewards that are not all
equal), centered ranks without ties give sum z^2 = N (N + 1) / (12 (N - 1)). Across iterations the noises are
independent, so after T steps each weight has moved by Normal(0, T s1^2) (a random walk) and, over d weights,

    L2 ~= sqrt(d T) s1,        P(0 < |delta| < t) = erf(t / (sqrt(2 T) s1)).

Where it does not apply (``null_drift`` returns None and says why): Adam (the step is normalised per coordinate,
so its size is set by lr, not by the noise), antithetic pairs (sum z^2 of the pair differences depends on the
rewards), weight or anchored decay (a pull toward 0 or theta_0 that the walk lacks), and iterations whose
rewards were all equal (a zero step; pass ``zero_steps`` to discount them).
"""

from __future__ import annotations

import math
from typing import Sequence


def sum_z_squared(shaping: str, population: int) -> float | None:
    """sum_i z_i^2 of one iteration's shaped fitness, when it does not depend on the rewards."""
    n = population
    if shaping == "zscore":
        return float(n)
    if shaping == "centered_rank":
        return n * (n + 1) / (12.0 * (n - 1))  # ranks/(N-1) - 1/2, no ties
    return None


def null_drift(
    *,
    lr: float,
    sigma: float,
    population: int,
    iterations: int,
    parameters: int,
    thresholds: Sequence[float],
    shaping: str = "zscore",
    optimizer: str = "sgd",
    estimator: str = "one_point",
    weight_decay: float = 0.0,
    anchor_decay: float = 0.0,
    zero_steps: int = 0,
) -> dict:
    """The null prediction for a run's settings: {"l2", "step_std", "share_below": {t: share}} or
    {"l2": None, "why": ...} where the model does not apply."""
    why = []
    if optimizer != "sgd":
        why.append(f"es.optimizer={optimizer}: the step is normalised per coordinate")
    if estimator != "one_point":
        why.append(f"es.estimator={estimator}: sum z^2 of the pairs depends on the rewards")
    if weight_decay or anchor_decay:
        why.append("es.weight_decay / es.anchor_decay pull the weights back")
    sz = sum_z_squared(shaping, population)
    if sz is None:
        why.append(f"es.shaping={shaping}: sum z^2 is not fixed")
    if why:
        return {
            "l2": None,
            "step_std": None,
            "share_below": {f"{t:g}": None for t in thresholds},
            "why": "; ".join(why),
        }
    steps = max(0, iterations - zero_steps)
    s1 = lr / (population * sigma) * math.sqrt(sz)
    total_std = s1 * math.sqrt(steps)
    share = {f"{t:g}": (math.erf(t / (math.sqrt(2.0) * total_std)) if total_std > 0 else None) for t in thresholds}
    return {
        "l2": total_std * math.sqrt(parameters),
        "step_std": s1,
        "total_std": total_std,
        "steps": steps,
        "share_below": share,
        "why": None,
    }


def null_drift_from_log(
    records: Sequence[dict],
    *,
    parameters: int,
    thresholds: Sequence[float],
    optimizer: str = "sgd",
    weight_decay: float = 0.0,
    anchor_decay: float = 0.0,
) -> dict:
    """The null prediction from the seed log's rows (dicts with lr, sigma, members, fitness), as ``null_drift``."""
    why = []
    if optimizer != "sgd":
        why.append(f"es.optimizer={optimizer}: the step is normalised per coordinate")
    if weight_decay or anchor_decay:
        why.append("es.weight_decay / es.anchor_decay pull the weights back")
    if why:
        return {
            "l2": None,
            "step_std": None,
            "share_below": {f"{t:g}": None for t in thresholds},
            "why": "; ".join(why),
        }
    var, steps = 0.0, 0
    for row in records:
        coeff: dict[int, float] = {}
        for index, noise_id, sign in row["members"]:
            coeff[noise_id] = coeff.get(noise_id, 0.0) + sign * float(row["fitness"][index])
        sum_c2 = sum(c * c for c in coeff.values())
        var += (float(row["lr"]) / (len(row["members"]) * float(row["sigma"]))) ** 2 * sum_c2
        steps += sum_c2 > 0
    total_std = math.sqrt(var)
    share = {f"{t:g}": (math.erf(t / (math.sqrt(2.0) * total_std)) if total_std > 0 else None) for t in thresholds}
    return {
        "l2": total_std * math.sqrt(parameters),
        "step_std": total_std / math.sqrt(steps) if steps else 0.0,
        "total_std": total_std,
        "steps": steps,
        "share_below": share,
        "why": None,
        "source": "seed log",
    }
