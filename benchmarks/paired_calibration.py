"""Calibration of es-compare's paired test (es_ray/metrics/paired.py) on the simulation model of
es_ray/metrics/calibration.py: the no-effect rejection rate at nominal 5% over the grid P x S x sv x k, before (the
two-level percentile bootstrap it replaced) and after (crossed random effects, Satterthwaite t), and the power the
printed planning numbers deliver under Holm.

    python benchmarks/paired_calibration.py                      # the whole grid and the power check (~10 min)
    python benchmarks/paired_calibration.py --replicates 400 --no-power

Prints markdown tables (docs/comparison.md, "Calibration") and writes --json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np

from es_ray.metrics.calibration import shift_for, simulate
from es_ray.metrics.paired import power, t_test

KS = (1, 16, 32)
GRID = {"P": (30, 100, 500), "S": (2, 3, 5), "sv": (0.0, 0.15, 0.3)}
FAMILY = 40
"""A 5-method report's family: 10 pairs x (3 k + entropy)."""


def bootstrap_before(d: np.ndarray, rng: np.random.Generator, draws: int) -> np.ndarray:
    """[R, S, P] differences -> [R] two-sided p of the bootstrap es-compare used before (seeds resampled from the S
    seed rows with a multinomial, problems by index, percentile p floored at 2^(1 - P) and 1 / draws). Method A's
    seed s and B's seed s were paired into one row, as that code did."""
    r_n, s, p = d.shape
    out = np.empty(r_n)
    for r in range(r_n):
        c_s = rng.multinomial(s, np.full(s, 1.0 / s), size=draws).astype(np.float64) if s > 1 else np.ones((draws, 1))
        idx = rng.integers(0, p, size=(draws, p))
        boot = np.take_along_axis(c_s @ d[r], idx, axis=1).mean(axis=1) / s
        out[r] = min(1.0, max(2.0 ** (1 - p), 1.0 / draws,
                              2.0 * min(float(np.mean(boot <= 0)), float(np.mean(boot >= 0)))))
    return out


def level_grid(replicates: int, before_replicates: int, draws: int, seed: int) -> list[dict]:
    rows = []
    rng = np.random.default_rng(seed)
    for p, s, sv in itertools.product(GRID["P"], GRID["S"], GRID["sv"]):
        t0 = time.perf_counter()
        a, b = simulate(rng, replicates, p, s, sv, ks=KS)
        after = [float(np.mean(t_test([(a[..., j], b[..., j])])[3] < 0.05)) for j in range(len(KS))]
        before = [float(np.mean(bootstrap_before(b[:before_replicates, ..., j] - a[:before_replicates, ..., j], rng,
                                                 draws) < 0.05)) for j in range(len(KS))] if before_replicates else None
        rows.append({"P": p, "S": s, "sv": sv, "after": dict(zip(map(str, KS), after)),
                     "before": dict(zip(map(str, KS), before)) if before else None})
        print(f"P={p} S={s} sv={sv}: after {after} before {before} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return rows


def _rejects(rng, problems: int, seeds: int, sv: float, k: int, effect: float, alpha: float) -> bool:
    a, b = simulate(rng, 1, problems, seeds, sv, ks=(k,), shift=shift_for(effect, sv, k))
    return bool(t_test([(a[0, ..., 0], b[0, ..., 0])])[3] < alpha)


def power_check(pilots: int, seed: int, cases, gaps=(0.06,)) -> list[dict]:
    """For each case (P, S, sv, k): pilots print detectable / problems_needed / seeds_needed at alpha / FAMILY;
    a fresh experiment at each printed figure (effect = detectable; P = problems_needed or S = seeds_needed with
    effect = gap) rejects at alpha / FAMILY how often? The share of pilots that print no number is reported too."""
    rng = np.random.default_rng(seed)
    alpha = 0.05 / FAMILY
    out = []
    for p, s, sv, k in cases:
        t0 = time.perf_counter()
        det, prob, seeds = [], {g: [] for g in gaps}, {g: [] for g in gaps}
        a, b = simulate(rng, pilots, p, s, sv, ks=(k,))
        for r in range(pilots):
            pw = power([(a[r, ..., 0], b[r, ..., 0])], alpha=alpha)
            if pw.detectable is not None and pw.detectable < 1 - 0.001 - _base(sv, k):
                det.append(_rejects(rng, p, s, sv, k, pw.detectable, alpha))
            for g in gaps:
                n_p, n_s = pw.problems_needed(g), pw.seeds_needed(g)
                prob[g].append(None if n_p is None or n_p > 20000 else _rejects(rng, n_p, s, sv, k, g, alpha))
                seeds[g].append(None if n_s is None or n_s > 60 else _rejects(rng, p, n_s, sv, k, g, alpha))

        def rate(x):
            v = [y for y in x if y is not None]
            return {"power": float(np.mean(v)) if v else None, "answered": len(v) / len(x)}

        row = {"P": p, "S": s, "sv": sv, "k": k, "detectable": {"power": float(np.mean(det)) if det else None,
                                                               "answered": len(det) / pilots},
               "problems_needed": {f"{g:g}": rate(prob[g]) for g in gaps},
               "seeds_needed": {f"{g:g}": rate(seeds[g]) for g in gaps}}
        out.append(row)
        print(f"power {row} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return out


def _base(sv: float, k: int) -> float:
    from es_ray.metrics.calibration import expected_passk

    return expected_passk(0.0, sv, k)


def markdown(rows: list[dict], power_rows: list[dict]) -> str:
    lines = ["| P | S | sv | before pass@1 / 16 / 32 (%) | after pass@1 / 16 / 32 (%) |", "|---|---|---|---|---|"]
    for r in rows:
        before = " / ".join(f"{100 * r['before'][str(k)]:.1f}" for k in KS) if r["before"] else "-"
        after = " / ".join(f"{100 * r['after'][str(k)]:.1f}" for k in KS)
        lines.append(f"| {r['P']} | {r['S']} | {r['sv']:g} | {before} | {after} |")
    if power_rows:
        lines += ["", "| P | S | sv | k | power at printed detectable (answered) | at problems_needed, 6 points | "
                  "at seeds_needed, 6 points |", "|---|---|---|---|---|---|---|"]
        for r in power_rows:
            def cell(x):
                return "-" if x["power"] is None else f"{100 * x['power']:.0f}% ({100 * x['answered']:.0f}%)"
            lines.append(f"| {r['P']} | {r['S']} | {r['sv']:g} | {r['k']} | {cell(r['detectable'])} | "
                         f"{cell(r['problems_needed']['0.06'])} | {cell(r['seeds_needed']['0.06'])} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicates", type=int, default=4000, help="no-effect replicates per cell (after)")
    ap.add_argument("--before-replicates", type=int, default=500, help="replicates per cell for the old bootstrap")
    ap.add_argument("--draws", type=int, default=1000, help="bootstrap draws of the old test")
    ap.add_argument("--pilots", type=int, default=200, help="pilots per power case")
    ap.add_argument("--no-power", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args()
    rows = level_grid(args.replicates, args.before_replicates, args.draws, args.seed)
    cases = [(100, 3, 0.15, 16), (100, 5, 0.3, 16), (198, 3, 0.15, 32), (500, 3, 0.0, 1), (100, 2, 0.15, 16)]
    power_rows = [] if args.no_power else power_check(args.pilots, args.seed + 1, cases)
    print(markdown(rows, power_rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"levels": rows, "power": power_rows}, f, indent=2)


if __name__ == "__main__":
    main()
