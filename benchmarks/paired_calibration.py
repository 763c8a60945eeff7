"""Calibration of es-compare's paired test (es_ray/metrics/paired.py) on the simulation model of
es_ray/metrics/calibration.py: the no-effect rejection rate at nominal 5% and at 5% / 40 (Holm's first threshold in
a 5-method report, where a verdict is called) over the grid P x S x sv x k, and for training variance in one method
only (``--hetero``: A sv 0, seed x problem sd 0.2, a base model's seeds; B sv 0.5, sd 0.6; B's logits shifted per k
so that E[pass@k] is equal), before (``previous_test``: the Satterthwaite df that jumped to the problem terms' df
when V sat at its floor; ``--bootstrap-replicates``: the two-level percentile bootstrap before that) and after
(the seed terms at their upper bound in the df), and the power the printed planning numbers deliver under Holm.

    python benchmarks/paired_calibration.py --replicates 20000 --hetero --no-power   # docs' level table (~15 min)
    python benchmarks/paired_calibration.py --replicates 400 --no-power
    python benchmarks/paired_calibration.py --no-levels --pilots 200                    # the power check

Prints markdown tables (docs/comparison.md, "Calibration") and writes --json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from functools import lru_cache

import numpy as np

from es_ray.metrics.calibration import SD_METHOD_PROBLEM, THETA, expected_passk, passk_table, shift_for, simulate
from es_ray.metrics.paired import power, t_test, t_two_sided_p

KS = (1, 16, 32)
GRID = {"P": (30, 100, 500), "S": (2, 3, 5), "sv": (0.0, 0.15, 0.3)}
FAMILY = 40
"""A 5-method report's family: 10 pairs x (3 k + entropy)."""
ALPHAS = (0.05, 0.05 / FAMILY)
HETERO = {"sv": (0.0, 0.5), "sb": (0.2, 0.6)}
"""Training variance in one method only (verdict_breaker.py's hetero_seeds): A's seeds vary by sampling alone."""


def _null_shift(k: int, sd_a: float, sd_b: float, nodes: int = 120) -> float:
    """B's logit shift making E[pass@k] equal when the two methods' logits have sd ``sd_a`` and ``sd_b``."""
    x, wts = np.polynomial.hermite_e.hermegauss(nodes)

    def expected(mu, sd):
        return float(np.sum(wts * (1 - (1 - 1 / (1 + np.exp(-(mu + sd * x)))) ** k)) / np.sum(wts))

    target, lo, hi = expected(THETA[0], sd_a), -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected(THETA[0] + mid, sd_b) < target else (lo, mid)
    return (lo + hi) / 2


def simulate_hetero(
    rng, replicates: int, problems: int, seeds: int, *, n: int = 32, ks=KS, sv=HETERO["sv"], sb=HETERO["sb"]
) -> tuple[np.ndarray, list]:
    """(a [R, S, P, len(ks)], [b_k [R, S, P] per k]): the calibration model with each method's own seed shift sd
    and seed x problem sd, under no effect on the pass@k scale (B's logits shifted per k)."""
    table = passk_table(n, ks)
    theta = rng.normal(*THETA, size=(replicates, 1, problems))
    sds = [np.sqrt(THETA[1] ** 2 + SD_METHOD_PROBLEM**2 + sv[m] ** 2 + sb[m] ** 2) for m in (0, 1)]
    logits = [
        theta
        + rng.normal(0, SD_METHOD_PROBLEM, size=(replicates, 1, problems))
        + rng.normal(0, sv[m], size=(replicates, seeds, 1))
        + rng.normal(0, sb[m], size=(replicates, seeds, problems))
        for m in (0, 1)
    ]
    a = table[rng.binomial(n, 1 / (1 + np.exp(-logits[0])))]
    b = [
        table[rng.binomial(n, 1 / (1 + np.exp(-(logits[1] + _null_shift(k, *sds)))))][..., j] for j, k in enumerate(ks)
    ]
    return a, b


def previous_test(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[..., S, P] -> p of the test before this calibration (one task): the same V, floored at the problem part,
    with the Satterthwaite df of the unbounded terms, switched to the problem part's df where V sat at the floor."""
    s, p = a.shape[-2:]
    q = (b.mean(-2) - a.mean(-2)).var(-1, ddof=1) / p
    terms = [(q, p - 1)]
    for x in (a, b):
        res = x - x.mean(-1, keepdims=True) - x.mean(-2, keepdims=True) + x.mean((-2, -1), keepdims=True)
        r = (res**2).sum((-2, -1)) / ((s - 1) * (p - 1))
        terms += [(x.mean(-1).var(-1, ddof=1) / s, s - 1), (-r / (s * p), (s - 1) * (p - 1))]
    v_raw = sum(c for c, _ in terms)
    with np.errstate(divide="ignore", invalid="ignore"):
        df = np.where(v_raw < q, p - 1, v_raw**2 / sum(c**2 / d for c, d in terms))
        t = (b.mean((-2, -1)) - a.mean((-2, -1))) / np.sqrt(np.maximum(v_raw, q))
    return np.clip(t_two_sided_p(np.nan_to_num(t), np.maximum(df, max(1, s - 1))), 2.0 ** (1 - p), 1.0)


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
        out[r] = min(
            1.0, max(2.0 ** (1 - p), 1.0 / draws, 2.0 * min(float(np.mean(boot <= 0)), float(np.mean(boot >= 0))))
        )
    return out


def _levels(p_values) -> dict:
    return {f"{alpha:g}": float(np.mean(p_values < alpha)) for alpha in ALPHAS}


def level_grid(
    replicates: int, bootstrap_replicates: int, draws: int, seed: int, hetero: bool, chunk: int = 4_000_000
) -> list[dict]:
    """Per cell and k, the no-effect rejection rate at each of ALPHAS: now, previous, bootstrap (optional)."""
    rows = []
    cells = [(p, s, sv, False) for p, s, sv in itertools.product(GRID["P"], GRID["S"], GRID["sv"])]
    cells += [(p, s, None, True) for p, s in itertools.product(GRID["P"], GRID["S"])] if hetero else []
    for p, s, sv, het in cells:
        t0 = time.perf_counter()
        rng = np.random.default_rng([seed, p, s, int(100 * (sv or 0)), het])
        now, prev = ([[] for _ in KS] for _ in range(2))
        boot = None
        for start in range(0, replicates, max(1, chunk // (s * p))):
            r = min(max(1, chunk // (s * p)), replicates - start)
            if het:
                a, bs = simulate_hetero(rng, r, p, s)
            else:
                a, b = simulate(rng, r, p, s, sv, ks=KS)
                bs = [b[..., j] for j in range(len(KS))]
            for j in range(len(KS)):
                now[j].append(t_test([(a[..., j], bs[j])])[3])
                prev[j].append(previous_test(a[..., j], bs[j]))
            if bootstrap_replicates and start == 0 and not het:
                boot = [
                    float(
                        np.mean(
                            bootstrap_before(
                                bs[j][:bootstrap_replicates] - a[:bootstrap_replicates, ..., j], rng, draws
                            )
                            < 0.05
                        )
                    )
                    for j in range(len(KS))
                ]
        row = {
            "P": p,
            "S": s,
            "sv": "hetero" if het else sv,
            "replicates": replicates,
            "now": {str(k): _levels(np.concatenate(now[j])) for j, k in enumerate(KS)},
            "previous": {str(k): _levels(np.concatenate(prev[j])) for j, k in enumerate(KS)},
            "bootstrap": dict(zip(map(str, KS), boot)) if boot else None,
        }
        rows.append(row)
        print(json.dumps(row), f"({time.perf_counter() - t0:.1f} s)", flush=True)
    return rows


@lru_cache(maxsize=None)
def _effect_curve(sv: float, k: int) -> tuple[np.ndarray, np.ndarray]:
    grid = np.linspace(0, 8, 321)
    return grid, np.array([expected_passk(g, sv, k) for g in grid]) - expected_passk(0.0, sv, k)


def _shift(effect: float, sv: float, k: int) -> float:
    """shift_for by interpolation on one curve per (sv, k) (shift_for bisects 100 times per call)."""
    grid, curve = _effect_curve(sv, k)
    return float(np.interp(effect, curve, grid)) if effect < curve[-1] else shift_for(effect, sv, k)


def _rejects(rng, problems: int, seeds: int, sv: float, k: int, effect: float, alpha: float) -> bool:
    a, b = simulate(rng, 1, problems, seeds, sv, ks=(k,), shift=_shift(effect, sv, k))
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

        row = {
            "P": p,
            "S": s,
            "sv": sv,
            "k": k,
            "detectable": {"power": float(np.mean(det)) if det else None, "answered": len(det) / pilots},
            "problems_needed": {f"{g:g}": rate(prob[g]) for g in gaps},
            "seeds_needed": {f"{g:g}": rate(seeds[g]) for g in gaps},
        }
        out.append(row)
        print(f"power {row} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return out


def _base(sv: float, k: int) -> float:
    return expected_passk(0.0, sv, k)


def markdown(rows: list[dict], power_rows: list[dict]) -> str:
    a, b = (f"{x:g}" for x in ALPHAS)
    lines = [
        "| P | S | sv | previous, 5%: pass@1 / 16 / 32 | now, 5% | previous, 5%/40 (nominal 0.125%) | now, 5%/40 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:

        def cells(which, alpha, digits):
            return " / ".join(f"{100 * r[which][str(k)][alpha]:.{digits}f}" for k in KS)

        sv = r["sv"] if isinstance(r["sv"], str) else f"{r['sv']:g}"
        lines.append(
            f"| {r['P']} | {r['S']} | {sv} | {cells('previous', a, 1)} | {cells('now', a, 1)} | "
            f"{cells('previous', b, 2)} | {cells('now', b, 2)} |"
        )
    if power_rows:
        lines += [
            "",
            "| P | S | sv | k | power at printed detectable (answered) | at problems_needed, 6 points | "
            "at seeds_needed, 6 points |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in power_rows:

            def cell(x):
                return "-" if x["power"] is None else f"{100 * x['power']:.0f}% ({100 * x['answered']:.0f}%)"

            lines.append(
                f"| {r['P']} | {r['S']} | {r['sv']:g} | {r['k']} | {cell(r['detectable'])} | "
                f"{cell(r['problems_needed']['0.06'])} | {cell(r['seeds_needed']['0.06'])} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicates", type=int, default=4000, help="no-effect replicates per cell")
    ap.add_argument("--hetero", action="store_true", help="add the cells with training variance in one method only")
    ap.add_argument("--bootstrap-replicates", type=int, default=0, help="replicates per cell for the old bootstrap")
    ap.add_argument("--draws", type=int, default=1000, help="bootstrap draws of the old test")
    ap.add_argument("--pilots", type=int, default=200, help="pilots per power case")
    ap.add_argument(
        "--cases",
        default="100,3,0.15,16;100,5,0.3,16;198,3,0.15,32;500,3,0,1;100,2,0.15,16;100,5,0,1;"
        "500,5,0.15,1;100,10,0.15,16",
        help="power cases P,S,sv,k separated by ';'",
    )
    ap.add_argument("--no-power", action="store_true")
    ap.add_argument("--no-levels", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args()
    rows = (
        []
        if args.no_levels
        else level_grid(args.replicates, args.bootstrap_replicates, args.draws, args.seed, args.hetero)
    )
    cases = [(int(p), int(s), float(sv), int(k)) for p, s, sv, k in (c.split(",") for c in args.cases.split(";"))]
    power_rows = [] if args.no_power else power_check(args.pilots, args.seed + 1, cases)
    print(markdown(rows, power_rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"levels": rows, "power": power_rows}, f, indent=2)


if __name__ == "__main__":
    main()
