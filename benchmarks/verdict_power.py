"""The verdict's power and its printed sizes, on the calibration model (es_ray/metrics/calibration.py):

1. Power for a gap at Pass@k of the primary family (es_ray/metrics/verdict.py: one-sided at 5% / 3, Holm's first
   threshold over the paper's three claims) against today's family (two-sided at 5% / 12: 3 methods x (3 k +
   entropy); 5% / 40: 5 methods), the method-level test of es_ray/metrics/paired.py in both.
2. The detectable size the report prints (80% power at the estimated variance, one-sided at 5% / 3): each pilot
   experiment prints its size; fresh experiments with that true gap are tested; the share rejected is the power the
   printed size delivers (target 75-85%).

    python benchmarks/verdict_power.py                       # the audit's cells, 400 pilots (~10 min, 2 cores)
    python benchmarks/verdict_power.py --pilots 60 --fresh 40 --no-family
    python benchmarks/verdict_power.py --pilots 30 --fresh 40 --no-family --second-falls   # the other direction

Prints markdown tables (docs/comparison.md, "The verdict") and writes --json.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from scipy import stats

from es_ray.metrics.calibration import expected_passk, shift_for, simulate
from es_ray.metrics.paired import power, t_test

PRIMARY = 3
"""The paper's three claims."""
FAMILIES = {
    "primary, one-sided 5%/3": (0.05 / PRIMARY, 1),
    "today 3 methods, 5%/12": (0.05 / 12, 2),
    "today 5 methods, 5%/40": (0.05 / 40, 2),
    "single test, two-sided 5%": (0.05, 2),
}
FAMILY_CELLS = ((500, 3, 0.3, 16, 0.06), (500, 5, 0.3, 16, 0.06), (100, 3, 0.15, 16, 0.06), (100, 5, 0.15, 16, 0.06))
"""(P, S, seed sd, k, gap): the audit's cells (issue 49)."""
CHECK_CELLS = ((100, 5, 0.15, 16), (500, 5, 0.3, 16), (100, 10, 0.15, 16), (200, 5, 0.0, 1))


def one_sided_p(diff, se, df, problems: int) -> np.ndarray:
    """P(T_df >= diff / se), floored at 2^-problems, elementwise (es_ray.metrics.verdict.one_sided)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(
            se > 0, stats.t.sf(diff / np.where(se > 0, se, 1.0), np.minimum(df, 1e12)), np.where(diff > 0, 0.0, 1.0)
        )
    return np.maximum(p, 2.0**-problems)


def rejections(a, b, alpha: float, sides: int) -> np.ndarray:
    """[R, S, P] pairs -> [R] bool: does the method-level test reject (b above a) at alpha."""
    diff, se, df, p2 = t_test([(a, b)])
    if sides == 2:
        return (p2 < alpha) & (diff > 0)
    return one_sided_p(diff, se, df, a.shape[-1]) < alpha


def family_power(rng, problems: int, seeds: int, sv: float, k: int, gap: float, replicates: int) -> dict:
    a, b = simulate(rng, replicates, problems, seeds, sv, ks=(k,), shift=shift_for(gap, sv, k))
    a, b = a[..., 0], b[..., 0]
    return {name: float(np.mean(rejections(a, b, alpha, sides))) for name, (alpha, sides) in FAMILIES.items()}


def fall_shift(effect: float, sv: float, k: int) -> float:
    """The (negative) logit shift of method B that makes E[pass@k of A] - E[pass@k of B] = ``effect``."""
    base = expected_passk(0.0, sv, k)
    lo, hi = -50.0, 0.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if base - expected_passk(mid, sv, k) < effect else (mid, hi)
    return (lo + hi) / 2


def printed_size_check(
    rng,
    problems: int,
    seeds: int,
    sv: float,
    k: int,
    pilots: int,
    fresh: int,
    alpha: float = 0.05 / PRIMARY,
    second_falls: bool = False,
) -> dict:
    """Each pilot prints its detectable size (power(bound=False, sides=1)); ``fresh`` new experiments at that gap
    are tested one-sided at alpha. Returns the median printed size and the share of fresh experiments rejected.
    The gap is made by the first method rising, or with ``second_falls`` by the second falling (the direction the
    size is printed for where the two differ, es_ray/metrics/paired.py Power._growth)."""
    sizes, hits, beyond = [], [], 0
    top = 1 - expected_passk(0.0, sv, k)
    a, b = simulate(rng, pilots, problems, seeds, sv, ks=(k,))
    for r in range(pilots):
        det = power([(a[r, ..., 0], b[r, ..., 0])], alpha=alpha, bound=False, sides=1).detectable
        if det is None or det >= top:
            beyond += 1
            continue
        sizes.append(det)
        if second_falls:  # first = A (where it is), second = B (falls by det)
            fa, fb = simulate(rng, fresh, problems, seeds, sv, ks=(k,), shift=fall_shift(det, sv, k))
            hits.append(float(np.mean(rejections(fb[..., 0], fa[..., 0], alpha, 1))))
            continue
        fa, fb = simulate(rng, fresh, problems, seeds, sv, ks=(k,), shift=shift_for(det, sv, k))
        hits.append(float(np.mean(rejections(fa[..., 0], fb[..., 0], alpha, 1))))
    return {
        "P": problems,
        "S": seeds,
        "sv": sv,
        "k": k,
        "pilots": pilots,
        "fresh": fresh,
        "median_size": float(np.median(sizes)) if sizes else None,
        "power": float(np.mean(hits)) if hits else None,
        "se": float(np.std(hits) / np.sqrt(len(hits))) if len(hits) > 1 else None,
        "unsized": beyond,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicates", type=int, default=4000, help="experiments per family-power cell")
    ap.add_argument("--pilots", type=int, default=400, help="pilot experiments per printed-size cell")
    ap.add_argument("--fresh", type=int, default=50, help="fresh experiments at each pilot's printed size")
    ap.add_argument("--no-family", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument(
        "--second-falls",
        action="store_true",
        help="make each printed gap real by the second method falling, not the first rising",
    )
    ap.add_argument("--seed", type=int, default=49)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    out = {"family": [], "check": []}
    if not args.no_family:
        print("| P | S | seed sd | gap at Pass@k | " + " | ".join(FAMILIES) + " |")
        print("|---|---|---|---|" + "---|" * len(FAMILIES))
        for p, s, sv, k, gap in FAMILY_CELLS:
            t0 = time.perf_counter()
            row = family_power(
                np.random.default_rng([args.seed, p, s, int(100 * sv)]), p, s, sv, k, gap, args.replicates
            )
            out["family"].append({"P": p, "S": s, "sv": sv, "k": k, "gap": gap, **row})
            print(
                f"| {p} | {s} | {sv} | {100 * gap:g} points at Pass@{k} | "
                + " | ".join(f"{100 * row[f]:.1f}%" for f in FAMILIES)
                + f" |  ({time.perf_counter() - t0:.0f} s)"
            )
    if not args.no_check:
        print("\n| P | S | seed sd | k | median printed size | power delivered at it (target 75-85%) | unsized |")
        print("|---|---|---|---|---|---|---|")
        for p, s, sv, k in CHECK_CELLS:
            t0 = time.perf_counter()
            row = printed_size_check(
                np.random.default_rng([args.seed, 1, p, s]),
                p,
                s,
                sv,
                k,
                args.pilots,
                args.fresh,
                second_falls=args.second_falls,
            )
            out["check"].append(row)
            print(
                f"| {p} | {s} | {sv} | {k} | {100 * row['median_size']:.1f} points | {100 * row['power']:.1f}% "
                f"(+- {100 * row['se']:.1f}) | {row['unsized']} of {row['pilots']} |  "
                f"({time.perf_counter() - t0:.0f} s)"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
