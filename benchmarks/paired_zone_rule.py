"""The zone rule an independent review proposed to lift 3 seeds into issue 34's [3%, 7.5%] band, at every rung of
Holm's ladder: its no-effect rejection rate at nominal alpha = 5%, 2.5%, 1.67% and 1.25% (Holm's last four
thresholds in a report, where a verdict's adjusted p is compared with 5%) beside the current test's, on the
calibration grid at 3 seeds and with training variance in one method (benchmarks/paired_calibration.py's model and
hetero cells). The rule (docs/comparison.md, "Calibration"):

    p = min(p_now,  0.01 + p_problems / 2   where both seed ratios are below 1,
                    max(0.01, p_as_fell)    where both are above 1)

seed ratio x_m = (A_m / S) / (R_m / (S P)), p_problems the t test of diff on sqrt(Q / P) with P - 1 df, p_as_fell
the previous rule (the seed terms as they fell; ``paired_calibration.previous_test``).

    python benchmarks/paired_zone_rule.py --replicates 4000     # ~1 min here

Prints one JSON row per cell and k: the zone rule's and the current test's levels in % at each alpha.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired_calibration import KS, previous_test, simulate_hetero  # noqa: E402

from es_ray.metrics.calibration import simulate  # noqa: E402
from es_ray.metrics.paired import _residual_ms, t_test, t_two_sided_p  # noqa: E402

ALPHAS = (0.05, 0.05 / 2, 0.05 / 3, 0.05 / 4)
"""Holm's last four rungs at family-wise 5%."""


def zone_p(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[R, S, P] scores of two methods -> (the zone rule's p, the current test's p), per replicate."""
    s, p = a.shape[-2:]
    p_now = t_test([(a, b)])[3]
    q = (b.mean(-2) - a.mean(-2)).var(-1, ddof=1) / p
    diff = b.mean((-2, -1)) - a.mean((-2, -1))
    with np.errstate(divide="ignore", invalid="ignore"):
        p_problems = t_two_sided_p(np.nan_to_num(diff / np.sqrt(q)), p - 1)
        ratios = [(x.mean(-1).var(-1, ddof=1) / s) / (_residual_ms(x) / (s * p)) for x in (a, b)]
    below = (ratios[0] < 1) & (ratios[1] < 1)
    above = (ratios[0] > 1) & (ratios[1] > 1)
    out = np.where(below, np.minimum(p_now, 0.01 + p_problems / 2), p_now)
    out = np.where(above, np.minimum(out, np.maximum(0.01, previous_test(a, b))), out)
    return np.clip(out, 2.0 ** (1 - p), 1.0), p_now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicates", type=int, default=4000)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    s = args.seeds
    cells = [(p, sv, False) for p, sv in itertools.product((30, 100, 500), (0.0, 0.15, 0.3))]
    cells += [(p, None, True) for p in (100, 500)]
    for p, sv, het in cells:
        rng = np.random.default_rng([7, p, s, int(100 * (sv or 0)), het])
        if het:
            a, bs = simulate_hetero(rng, args.replicates, p, s)
        else:
            a, b = simulate(rng, args.replicates, p, s, sv, ks=KS)
            bs = [b[..., j] for j in range(len(KS))]
        for j, k in enumerate(KS):
            zone, now = zone_p(a[..., j], bs[j])
            print(
                json.dumps(
                    {
                        "P": p,
                        "S": s,
                        "sv": "hetero" if het else sv,
                        "k": k,
                        "alpha_%": [round(100 * al, 2) for al in ALPHAS],
                        "zone_%": [round(100 * float(np.mean(zone < al)), 2) for al in ALPHAS],
                        "now_%": [round(100 * float(np.mean(now < al)), 2) for al in ALPHAS],
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
