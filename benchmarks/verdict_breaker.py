"""An adversarial check of es-compare's paired verdict (es_ray/metrics/paired.py): data from generating processes the
calibration model (es_ray/metrics/calibration.py) does not use, and for each the no-effect rejection rate at nominal
alpha, the power at a fixed effect beside the power the report's own figures state for it, and the power a fresh
experiment has at the "could detect X at 80% power" size the report prints (Holm's first threshold, alpha / 40).

    python benchmarks/verdict_breaker.py                                  # every process, P x S grid
    # docs/comparison.md's table: --replicates 1000 --power-replicates 200 --pilots 25 (normal and the rest of
    # the shapes: --replicates 800 --power-replicates 150 --pilots 20 --seed 1), under a minute per process
    python benchmarks/verdict_breaker.py --only floor,hetero_seeds --replicates 1000

Processes (logit of a sample's success for method m, seed s, problem p; c ~ Binomial(n, sigmoid(logit)), exact
pass@k of c of n, k in {1, 16, 32}; B's logits shifted so that E[pass@k of B] = E[pass@k of A] + effect, the shift
found per k on a large common draw, so the null is exact on the pass@k scale whatever the process's asymmetry):

    normal          the calibration's own shape (theta ~ N(-1, 1.8), mb 0.6, sv 0.15, sb 0.4): the reference
    heavy_tails     mb and the seed shift t(3)-distributed (same sd), sv 0.3
    skewed_effects  B's per-problem effect left-skewed (-(Exp(1) - 1) * 0.6: helps most problems a little, breaks a
                    few), A's normal
    seed_x_problem  seed x problem sd 1.0 (2.5x), sv 0.3
    hetero_seeds    A: sv 0, sb 0.2 (a base model: sampling only); B: sv 0.5, sb 0.6
    seed_collapse   B: a seed collapses (shift -2.5) with probability 0.2, else N(0, 0.1); A: sv 0.15
    floor           theta ~ N(-5, 1.5): pass@1 about 2%
    ceiling         theta ~ N(4, 1.5): pass@1 about 95%
    clustered       problems in clusters of 5 sharing theta and mb (sd 0.6 between clusters, 0.1 within)
    unequal_n       A n = 32, B n = 16 (k = 1, 16 only)
    zero_variance   A scores 1{theta + mb > 0} on every seed and sample (greedy-like: no seed or sampling variance)

Prints markdown tables; --json writes every number. Standard errors are binomial Monte-Carlo errors.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from dataclasses import dataclass, field

import numpy as np

from es_ray.metrics.paired import power, t_quantile, t_test

KS = (1, 16, 32)
FAMILY = 40
"""A 5-method report's family: 10 pairs x (3 k + entropy); Holm's first threshold is alpha / FAMILY."""


@dataclass(frozen=True)
class Process:
    name: str
    theta: tuple = (-1.0, 1.8)
    mb: tuple = (0.6, 0.6)
    mb_dist: tuple = ("normal", "normal")
    sv: tuple = (0.15, 0.15)
    u_dist: tuple = ("normal", "normal")
    sb: tuple = (0.4, 0.4)
    n: tuple = (32, 32)
    cluster: int = 1
    greedy_a: bool = False
    ks: tuple = KS
    notes: str = field(default="", compare=False)

    @property
    def symmetric(self) -> bool:
        """A and B drawn alike: the no-effect shift is 0 at every k."""
        return (
            self.mb[0] == self.mb[1]
            and self.mb_dist[0] == self.mb_dist[1]
            and self.sv[0] == self.sv[1]
            and self.u_dist[0] == self.u_dist[1]
            and self.sb[0] == self.sb[1]
            and not self.greedy_a
        )


PROCESSES = {
    p.name: p
    for p in [
        Process("normal"),
        Process("heavy_tails", mb_dist=("t3", "t3"), sv=(0.3, 0.3), u_dist=("t3", "t3")),
        Process("skewed_effects", mb_dist=("normal", "skew")),
        Process("seed_x_problem", sv=(0.3, 0.3), sb=(1.0, 1.0)),
        Process("hetero_seeds", sv=(0.0, 0.5), sb=(0.2, 0.6)),
        Process("seed_collapse", u_dist=("normal", "collapse")),
        Process("floor", theta=(-5.0, 1.5)),
        Process("ceiling", theta=(4.0, 1.5)),
        Process("clustered", cluster=5),
        Process("unequal_n", n=(32, 16), ks=(1, 16)),
        Process("zero_variance", greedy_a=True),
    ]
}


def _draw(rng, dist: str, sd: float, size) -> np.ndarray:
    if sd == 0:
        return np.zeros(size)
    if dist == "normal":
        return rng.normal(0, sd, size=size)
    if dist == "t3":  # t(3) has variance 3: scaled to sd
        return sd * rng.standard_t(3, size=size) / math.sqrt(3.0)
    if dist == "skew":  # mean 0, sd ``sd``, a long left tail
        return -sd * (rng.exponential(1.0, size=size) - 1.0)
    if dist == "collapse":
        return np.where(rng.random(size) < 0.2, -2.5, rng.normal(0, 0.1, size=size))
    raise ValueError(dist)


def problems(rng, proc: Process, reps: int, n_problems: int) -> dict:
    """The problem-level draws both methods share: theta [R, 1, P], and the cluster of each problem."""
    c = proc.cluster
    n_cl = -(-n_problems // c)
    if c == 1:
        theta = rng.normal(*proc.theta, size=(reps, 1, n_problems))
    else:
        theta = np.repeat(rng.normal(*proc.theta, size=(reps, 1, n_cl)), c, axis=-1)[..., :n_problems] + rng.normal(
            0, 0.3, size=(reps, 1, n_problems)
        )
    return {"theta": theta, "reps": reps, "P": n_problems, "n_cl": n_cl}


def logits(rng, proc: Process, shared: dict, seeds: int, side: int) -> np.ndarray:
    """[R, S, P] logits of one method, before B's shift (A greedy: +-inf, so every sample agrees)."""
    r, p = shared["reps"], shared["P"]
    if proc.cluster == 1:
        mb = _draw(rng, proc.mb_dist[side], proc.mb[side], (r, 1, p))
    else:
        c = proc.cluster
        mb = np.repeat(_draw(rng, proc.mb_dist[side], proc.mb[side], (r, 1, shared["n_cl"])), c, axis=-1)[
            ..., :p
        ] + rng.normal(0, 0.1, size=(r, 1, p))
    if side == 0 and proc.greedy_a:
        return np.broadcast_to(np.where(shared["theta"] + mb > 0, np.inf, -np.inf), (r, seeds, p))
    return (
        shared["theta"]
        + mb
        + _draw(rng, proc.u_dist[side], proc.sv[side], (r, seeds, 1))
        + _draw(rng, "normal", proc.sb[side], (r, seeds, p))
    )


def _sigmoid(x):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def passk_table(n: int, ks) -> np.ndarray:
    """[n + 1, len(ks)]: the unbiased pass@k, 1 - C(n - c, k) / C(n, k), of c correct of n (independent of
    es_ray.metrics.passk on purpose)."""
    return np.array(
        [[1.0 - math.comb(n - c, k) / math.comb(n, k) if k <= n else np.nan for k in ks] for c in range(n + 1)]
    )


def scores(rng, proc: Process, logit: np.ndarray, side: int) -> np.ndarray:
    n = proc.n[side]
    return passk_table(n, proc.ks)[rng.binomial(n, _sigmoid(logit))]


class EffectCurve:
    """E[pass@k of B at shift x] - E[pass@k of A], on one large common draw (400,000 problem x seed cells)."""

    def __init__(self, proc: Process, seed: int = 12345):
        rng = np.random.default_rng(seed)
        # 100,000 one-problem replicates x 4 seeds: every cell has its own seed shift, so the seed distribution
        # (a collapse with probability 0.2, say) is sampled 400,000 times, not 4
        shared = problems(rng, proc, 100_000, 1)
        self.a = _sigmoid(logits(rng, proc, shared, 4, 0))
        self.b = logits(rng, proc, shared, 4, 1)
        self.grid = np.linspace(-8, 8, 97)
        self.curves = {}
        for k in proc.ks:
            base = float(np.mean(1 - (1 - self.a) ** k))
            self.curves[k] = (
                base,
                np.array([float(np.mean(1 - (1 - _sigmoid(self.b + x)) ** k)) - base for x in self.grid]),
            )

    def base(self, k: int) -> float:
        return self.curves[k][0]

    def shift(self, k: int, effect):
        """The shift of B's logits giving ``effect`` (NaN beyond reach)."""
        curve = self.curves[k][1]
        e = np.asarray(effect, dtype=np.float64)
        out = np.interp(e, curve, self.grid)
        return np.where((e < curve[0]) | (e > curve[-1]), np.nan, out)


def experiments(rng, proc: Process, reps: int, n_problems: int, seeds: int, shift_b) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) [R, S, P, len(ks)] with B's logits shifted by ``shift_b`` ([R] or a scalar) for the k that asks."""
    shared = problems(rng, proc, reps, n_problems)
    la, lb = logits(rng, proc, shared, seeds, 0), logits(rng, proc, shared, seeds, 1)
    sh = np.asarray(shift_b, dtype=np.float64).reshape(-1, 1, 1) if np.ndim(shift_b) else shift_b
    return scores(rng, proc, la, 0), scores(rng, proc, lb + sh, 1)


def stated_power(effect: float, se: float, df: float, alpha: float, rng, draws: int = 20000) -> float:
    """The power a t-test with this se and df has at ``effect`` (noncentral t by Monte Carlo: Z + lambda over
    sqrt(chi2_df / df), both tails): what the report's se and df state for that effect."""
    if not se > 0:
        return float("nan")
    crit = t_quantile(1 - alpha / 2, min(df, 1e12))
    z = rng.standard_normal(draws) + effect / se
    scale = np.sqrt(rng.chisquare(min(df, 1e6), draws) / min(df, 1e6))
    return float(np.mean(np.abs(z) / scale > crit))


def rate(hits) -> tuple[float, float, int]:
    h = np.asarray(hits, dtype=np.float64)
    h = h[np.isfinite(h)]
    if h.size == 0:
        return float("nan"), float("nan"), 0
    m = float(h.mean())
    return m, math.sqrt(max(m * (1 - m), 1.0 / h.size) / h.size), int(h.size)


def cell(proc: Process, curve: EffectCurve, n_problems: int, seeds: int, args, rng) -> list[dict]:
    alpha, first = args.alpha, args.alpha / FAMILY
    rows = []
    null_shift = {k: float(curve.shift(k, 0.0)) for k in proc.ks}
    # no effect: one draw for every k where the null shift is 0 at every k, one per k otherwise
    groups = [proc.ks] if proc.symmetric else [(k,) for k in proc.ks]
    null = {}
    for g in groups:
        a, b = experiments(
            rng, proc, args.replicates, n_problems, seeds, null_shift[g[0]] if not proc.symmetric else 0.0
        )
        for k in g:
            j = proc.ks.index(k)
            null[k] = (a[..., j], b[..., j])
    for k in proc.ks:
        a, b = null[k]
        p = t_test([(a, b)])[3]
        lvl, lvl_se, _ = rate(p < alpha)
        tail, tail_se, _ = rate(p < first)
        # power at a fixed effect: 5 points, or half the room to 100% where pass@k is near 1
        effect = min(args.effect, (1 - curve.base(k)) / 2)
        if effect < 0.005:  # pass@k at 100% on nearly every problem: no effect to find
            rows.append(
                {
                    "process": proc.name,
                    "P": n_problems,
                    "S": seeds,
                    "k": k,
                    "alpha": alpha,
                    "level": lvl,
                    "level_se": lvl_se,
                    "level_first": tail,
                    "level_first_se": tail_se,
                    "effect": effect,
                    "power": float("nan"),
                    "power_se": float("nan"),
                    "stated_power": float("nan"),
                    "testable": float("nan"),
                    "power_at_printed": float("nan"),
                    "power_at_printed_se": float("nan"),
                    "printed_reachable": 0.0,
                    "median_printed": float("nan"),
                }
            )
            continue
        sh = float(curve.shift(k, effect))
        x, y = experiments(rng, proc, args.power_replicates, n_problems, seeds, sh)
        j = proc.ks.index(k)
        px = t_test([(x[..., j], y[..., j])])[3]
        real, real_se, _ = rate(px < first)
        stated, printed, testable = [], [], []
        for r in range(args.pilots):
            pw = power([(x[r, ..., j], y[r, ..., j])], alpha=first)
            if pw.se > 0:
                plan_se, plan_df = pw._plan(pw.problems, pw.seeds) if pw.var_seeds is not None else (pw.se, pw.df)
                stated.append(stated_power(effect, plan_se, plan_df, first, rng))
            # the report's "testable": detectable under 100 points and the p floor below the threshold
            pw0 = power([(a[r], b[r])], alpha=first)
            ok = pw0.detectable is not None and pw0.detectable < 1.0 and 2.0 ** (1 - n_problems) < first
            testable.append(ok)
            printed.append(pw0.detectable if ok else np.nan)
        # a fresh experiment at each printed detectable size (pilots: the no-effect draws)
        printed = np.array(printed)
        shifts = curve.shift(k, np.nan_to_num(printed, nan=-1.0))
        reach = np.isfinite(printed) & np.isfinite(shifts)
        hits = np.full(printed.size, np.nan)
        if reach.any():
            u, v = experiments(rng, proc, int(reach.sum()), n_problems, seeds, shifts[reach])
            hits[reach] = t_test([(u[..., j], v[..., j])])[3] < first
        at_x, at_x_se, n_x = rate(hits)
        row = {
            "process": proc.name,
            "P": n_problems,
            "S": seeds,
            "k": k,
            "alpha": alpha,
            "level": lvl,
            "level_se": lvl_se,
            "level_first": tail,
            "level_first_se": tail_se,
            "effect": effect,
            "power": real,
            "power_se": real_se,
            "stated_power": float(np.mean(stated)) if stated else float("nan"),
            "testable": float(np.mean(testable)),
            "power_at_printed": at_x,
            "power_at_printed_se": at_x_se,
            "printed_reachable": n_x / args.pilots,
            "median_printed": float(np.nanmedian(printed)) if np.isfinite(printed).any() else float("nan"),
        }
        rows.append(row)
    return rows


def fmt(x, se=None, pct=True) -> str:
    if x is None or not np.isfinite(x):
        return "-"
    s = f"{100 * x:.1f}" if pct else f"{x:.3g}"
    return s + (f" ± {100 * se:.1f}" if se is not None and np.isfinite(se) else "")


def markdown(rows: list[dict]) -> str:
    out = [
        "| process | S | P | k | level at 5% (± s.e.) | level at 5%/40 | effect (points) | realised power at "
        "5%/40 (± s.e.) | stated power | testable | power at printed 80% size (± s.e.) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        flag = " **!**" if r["level"] - r["alpha"] > 3 * r["level_se"] else ""
        out.append(
            f"| {r['process']} | {r['S']} | {r['P']} | {r['k']} | {fmt(r['level'], r['level_se'])}{flag} | "
            f"{fmt(r['level_first'], r['level_first_se'])} | {100 * r['effect']:.1f} | "
            f"{fmt(r['power'], r['power_se'])} | {fmt(r['stated_power'])} | {fmt(r['testable'])} | "
            f"{fmt(r['power_at_printed'], r['power_at_printed_se'])} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated processes (default: all)")
    ap.add_argument("--problems", default="10,100,500")
    ap.add_argument("--seeds", default="2,3,5")
    ap.add_argument("--replicates", type=int, default=2000, help="no-effect replicates per cell")
    ap.add_argument("--power-replicates", type=int, default=400)
    ap.add_argument("--pilots", type=int, default=60, help="replicates whose stated power / printed size is checked")
    ap.add_argument("--effect", type=float, default=0.05)
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(PROCESSES)
    rows = []
    for name in names:
        proc = PROCESSES[name]
        t0 = time.perf_counter()
        curve = EffectCurve(proc)
        for p, s in itertools.product(map(int, args.problems.split(",")), map(int, args.seeds.split(","))):
            rng = np.random.default_rng([args.seed, list(PROCESSES).index(name), p, s])
            got = cell(proc, curve, p, s, args, rng)
            rows += got
            for r in got:
                print(json.dumps(r), flush=True)
        print(f"# {name}: {time.perf_counter() - t0:.0f} s", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    print(markdown(rows))


if __name__ == "__main__":
    main()
