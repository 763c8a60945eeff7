"""An independent audit of the verdict's primary family (es_ray/metrics/verdict.py) by simulation, with its own
generator (not es_ray.metrics.calibration): logit-normal problems, a method x problem interaction, a seed shift and a
seed x problem interaction on the logit scale, n Bernoulli samples per problem and the unbiased pass@k; entropy a
per-problem mean paired by problem. The verdict's test is called as a black box: es_ray.metrics.paired.t_test (the
statistic claim_test uses: the method-level test at S >= 5, the seed-averaged checkpoint test below) and
es_ray.metrics.verdict.one_sided / holm; claim_test itself for the printed sizes and seeds (checked equal to the
vectorised path on a few replicates first).

1. Level: the one-sided rejection rate at alpha under the null at its boundary (superiority: the same population
   mean; non-inferiority: GRPO's mean pass@1 exactly `margin` below ES's), by S, P, seed sd and metric. At S < 5 the
   test is the checkpoint test (no method claim): its level is shown under both the method null (seed sd > 0: not
   what it tests) and the checkpoint null (seed sd 0).
2. Holm's family-wise error over the paper's three claims, all at their boundaries at once.
3. Direction: claims whose truth is the opposite way.
4. The printed detectable size (claim_test, 80% at alpha / 3) in a cell the author did not try: fresh experiments
   with that true gap, the share found.
5. The seeds a method-level claim needs (claim_test at S = 3): fresh experiments at N and N - 1 seeds with the
   estimate as the truth.

    python benchmarks/verdict_audit.py              # ~3-5 min on 2 shared cores
    python benchmarks/verdict_audit.py --reps 400   # quicker, wider Monte Carlo errors
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
from scipy import special

from es_ray.metrics.paired import t_test
from es_ray.metrics.verdict import claim_test, family_verdict, one_sided, parse_claim

ALPHA = 0.05
MARGIN = 0.02
B_MEAN, B_SD, MB_SD, SP_SD = -1.0, 1.5, 0.3, 0.2
"""problem logit difficulty N(B_MEAN, B_SD), method x problem N(0, MB_SD), seed x problem N(0, SP_SD)."""
GH_X, GH_W = np.polynomial.hermite_e.hermegauss(80)
GH_W = GH_W / GH_W.sum()


def mean_passk(k: int, seed_sd: float, a: float = 1.0, c: float = 0.0) -> float:
    """E[pass@k] in the population for logits a * x + c, x ~ N(B_MEAN, total sd) (Gauss-Hermite)."""
    sd = math.sqrt(B_SD**2 + MB_SD**2 + seed_sd**2 + SP_SD**2)
    p = special.expit(a * (B_MEAN + sd * GH_X) + c)
    return float(GH_W @ (1 - (1 - p) ** k))


def shift_to(target: float, k: int, seed_sd: float, a: float = 1.0) -> float:
    """The logit shift c giving E[pass@k](a, c) - E[pass@k](1, 0) = target."""
    base = mean_passk(k, seed_sd)
    lo, hi = -10.0, 10.0
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_passk(k, seed_sd, a, mid) - base < target else (lo, mid)
    return (lo + hi) / 2


def pass_at(c: np.ndarray, n: int, k: int) -> np.ndarray:
    """The unbiased pass@k from c correct of n."""
    if k == 1:
        return c / n
    out = np.ones(c.shape)
    ok = n - c >= k
    out[ok] = 1 - np.exp(
        special.gammaln(n - c[ok] + 1)
        - special.gammaln(n - c[ok] - k + 1)
        + special.gammaln(n - k + 1)
        - special.gammaln(n + 1)
    )
    return out


def draw(rng, reps, problems, seeds, seed_sd, n, ks, shift=0.0, scale=1.0):
    """(es, grpo) dicts k -> [reps, seeds, problems] pass@k, plus 'entropy' (nats, per-problem mean); GRPO's logits
    are scale * x + shift of ES's population (its own interaction draws)."""
    b = rng.normal(B_MEAN, B_SD, (reps, 1, problems))
    out = []
    for m, (a, c) in enumerate(((1.0, 0.0), (scale, shift))):
        x = (
            b
            + rng.normal(0, MB_SD, (reps, 1, problems))
            + rng.normal(0, seed_sd, (reps, seeds, 1))
            + rng.normal(0, SP_SD, (reps, seeds, problems))
        )
        cnt = rng.binomial(n, special.expit(a * x + c)).astype(float)
        d = {k: pass_at(cnt, n, k) for k in ks}
        # entropy: a problem effect shared by the methods, a seed shift, the samples' noise; equal means
        d["entropy"] = (
            0.8
            + 0.2 * np.tanh(b)
            + rng.normal(0, 0.05, (reps, 1, problems))
            + rng.normal(0, 0.3 * seed_sd, (reps, seeds, 1))
            + rng.normal(0, 0.1, (reps, seeds, problems))
        )
        out.append(d)
    return out


def verdict_p(second: np.ndarray, first: np.ndarray, shift: float) -> np.ndarray:
    """The one-sided p of claim_test for [reps, S, P] scores: the method-level test at S >= 5, else the checkpoint
    test on the seed-averaged scores (t_test + one_sided, as claim_test calls them)."""
    s, problems = first.shape[-2:]
    if s < 5:
        second, first = second.mean(-2, keepdims=True), first.mean(-2, keepdims=True)
    diff, se, df, _ = t_test([(second, first)])
    return np.array(
        [one_sided(float(d), float(e), float(f), shift, problems, ALPHA)[0] for d, e, f in zip(diff, se, df)]
    )


def mc(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 1e-12) / n)


def check_equal(rng) -> None:
    """The vectorised path gives claim_test's p on a few replicates (so the audit tests the verdict's test)."""
    for s in (1, 3, 6):
        es, grpo = draw(rng, 2, 40, s, 0.15, 16, (1,))
        ps = verdict_p(es[1], grpo[1], MARGIN)
        for r in range(2):
            t = claim_test(
                parse_claim("pass@1:grpo>=es"), [(es[1][r], grpo[1][r])], margin=MARGIN, alpha=ALPHA, family=3, ks=[1]
            )
            assert math.isclose(t["p"], ps[r], rel_tol=1e-9, abs_tol=1e-15), (s, t["p"], ps[r])


def level_table(rng, reps: int) -> list[str]:
    rows = ["| claim | S | P | seed sd | n | nominal | rejected (± MC) | test |", "|---|---|---|---|---|---|---|---|"]
    for sd in (0.0, 0.15, 0.3):
        for problems in (100, 500):
            for s in (1, 3, 5, 8):
                for claim, k, n in (
                    ("pass@16:es>grpo", 16, 16),
                    ("pass@16:es>grpo", 16, 32),
                    ("pass@1:grpo>=es", 1, 16),
                ):
                    shift = 0.0 if k == 16 else shift_to(-MARGIN, 1, sd)
                    es, grpo = draw(rng, reps, problems, s, sd, n, (k,), shift=shift)
                    first, second = (es, grpo) if claim.startswith("pass@16") else (grpo, es)
                    p = verdict_p(second[k], first[k], MARGIN if ">=" in claim else 0.0)
                    r = float(np.mean(p < ALPHA))
                    flag = "" if r <= ALPHA + 2 * mc(ALPHA, reps) else (" **over**" if s >= 5 else " (method null)")
                    rows.append(
                        f"| {claim} | {s} | {problems} | {sd} | {n} | {ALPHA} | {r:.3f} ± {mc(r, reps):.3f}"
                        f"{flag} | {'method' if s >= 5 else 'checkpoint'} |"
                    )
    return rows


def family_scale(k_hi: int, sd: float) -> tuple[float, float]:
    """GRPO's (scale, shift): mean pass@k_hi equal to ES's and mean pass@1 exactly MARGIN below (both boundaries)."""
    best = None
    for a in np.linspace(0.6, 1.6, 201):
        c = shift_to(0.0, k_hi, sd, a)
        gap = mean_passk(1, sd, a, c) - mean_passk(1, sd)
        if best is None or abs(gap + MARGIN) < best[0]:
            best = (abs(gap + MARGIN), a, c)
    return best[1], best[2]


def family_table(rng, reps: int) -> list[str]:
    rows = ["| S | P | seed sd | nominal FWER | Holm FWER (± MC) | any raw p < alpha |", "|---|---|---|---|---|---|"]
    for s, problems, sd in ((5, 100, 0.15), (8, 500, 0.3), (5, 500, 0.0), (3, 100, 0.0)):
        a, c = family_scale(16, sd)
        es, grpo = draw(rng, reps, problems, s, sd, 32, (1, 16), shift=c, scale=a)
        ps = np.stack(
            [
                verdict_p(grpo[16], es[16], 0.0),
                verdict_p(grpo["entropy"], es["entropy"], 0.0),
                verdict_p(es[1], grpo[1], MARGIN),
            ],
            1,
        )
        hits = [any(t["holds"] for t in family_verdict([{"p": float(x)} for x in row], ALPHA)) for row in ps]
        r, raw = float(np.mean(hits)), float(np.mean((ps < ALPHA).any(1)))
        rows.append(f"| {s} | {problems} | {sd} | {ALPHA} | {r:.3f} ± {mc(r, reps):.3f} | {raw:.3f} |")
    return rows


def direction_table(rng, reps: int) -> list[str]:
    rows = ["| claim | truth | S | P | rejected (± MC) |", "|---|---|---|---|---|"]
    for s in (1, 5):
        es, grpo = draw(rng, reps, 200, s, 0.15, 16, (1, 16), shift=shift_to(0.03, 16, 0.15))  # GRPO 3 points up
        r = float(np.mean(verdict_p(grpo[16], es[16], 0.0) < ALPHA))
        rows.append(f"| pass@16:es>grpo | GRPO 3 points above | {s} | 200 | {r:.3f} ± {mc(r, reps):.3f} |")
        es, grpo = draw(rng, reps, 200, s, 0.15, 16, (1,), shift=shift_to(-0.04, 1, 0.15))  # GRPO 4 points down
        r = float(np.mean(verdict_p(es[1], grpo[1], MARGIN) < ALPHA))
        rows.append(f"| pass@1:grpo>=es (margin 2) | GRPO 4 points below | {s} | 200 | {r:.3f} ± {mc(r, reps):.3f} |")
    return rows


SIZE_CELLS = ((200, 6, 0.2, 32), (100, 5, 0.2, 32), (500, 8, 0.3, 32), (300, 8, 0.1, 1))
"""(P, S, seed sd, k): the near-ceiling cells (pass@32 at 93-94%, n = 32) and one pass@1 cell."""


def size_table(rng, pilots: int, fresh: int, cells=SIZE_CELLS) -> list[str]:
    """The gap made real two ways: GRPO (second) falling by it, or ES (first) rising by it (near a ceiling the two
    differ: the falling one gains variance; a size past the room above the mean can only be GRPO falling, and is
    left out of the second column, which counts the pilots it covers)."""
    rows = [
        "| cell | mean pass@k | pilots x fresh | printed size (median) | not detectable | power, GRPO falls "
        "(± MC) | power, ES rises (± MC; pilots) | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for problems, s, sd, k in cells:
        n = max(k, 16)
        claim = parse_claim(f"pass@{k}:es>grpo")
        top = 1 - mean_passk(k, sd)
        pilot = draw(rng, pilots, problems, s, sd, n, (k,))
        down, up, sizes = [], [], []
        for r in range(pilots):
            t = claim_test(claim, [(pilot[1][k][r], pilot[0][k][r])], margin=MARGIN, alpha=ALPHA, family=3, ks=[k])
            det = t["detectable"]
            if det is None:  # past the metric's range
                continue
            sizes.append(det)
            es, grpo = draw(rng, fresh, problems, s, sd, n, (k,), shift=shift_to(-det, k, sd))
            down.append(np.mean(verdict_p(grpo[k], es[k], 0.0) < ALPHA / 3))
            if det < 0.98 * top:  # ES can rise by it
                grpo, es = draw(rng, fresh, problems, s, sd, n, (k,), shift=shift_to(det, k, sd))
                up.append(np.mean(verdict_p(grpo[k], es[k], 0.0) < ALPHA / 3))
        ups = f"{np.mean(up):.3f} ± {np.std(up) / math.sqrt(len(up)):.3f}; {len(up)}" if up else "-"
        rows.append(
            f"| P={problems} S={s} sd={sd} pass@{k} n={n} | {100 * (1 - top):.1f}% | {pilots} x {fresh} | "
            f"{100 * np.median(sizes):.1f} points | {pilots - len(sizes)} | {np.mean(down):.3f} ± "
            f"{np.std(down) / math.sqrt(len(down)):.3f} | {ups} | 0.75-0.85 |"
        )
    return rows


def seeds_table(rng, pilots: int, fresh: int) -> list[str]:
    rows = ["| pilot | estimate | needs S >= N | power at N-1 | power at N |", "|---|---|---|---|---|"]
    claim, problems, sd, k = parse_claim("pass@16:es>grpo"), 200, 0.15, 16
    done = 0
    for r in range(pilots * 4):
        es, grpo = draw(rng, 1, problems, 3, sd, 16, (k,), shift=shift_to(-0.03, k, sd))
        t = claim_test(claim, [(grpo[k][0], es[k][0])], margin=MARGIN, alpha=ALPHA, family=3, ks=[k])
        need = t.get("seeds_for_claim")
        if need is None or need > 30:
            continue
        est = t["method"]["diff"]
        power = []
        for s in (need - 1, need):
            fe, fg = draw(rng, fresh, problems, s, sd, 16, (k,), shift=shift_to(-est, k, sd))
            power.append(float(np.mean(verdict_p(fg[k], fe[k], 0.0) < ALPHA / 3)) if s >= 5 else float("nan"))
        rows.append(
            f"| {done} | {100 * est:+.1f} points | {need} | {power[0]:.3f} ± {mc(power[0], fresh):.3f} | "
            f"{power[1]:.3f} ± {mc(power[1], fresh):.3f} |"
        )
        done += 1
        if done == pilots:
            break
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=1000)
    ap.add_argument("--pilots", type=int, default=16)
    ap.add_argument("--fresh", type=int, default=200)
    ap.add_argument("--seed", type=int, default=4949)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    t0 = time.time()
    check_equal(rng)
    for title, rows in (
        ("Level (one-sided, alpha 5%)", level_table(rng, args.reps)),
        ("Holm over the paper's three claims, all at their boundaries", family_table(rng, args.reps)),
        ("Direction", direction_table(rng, args.reps)),
        ("Printed detectable size (80% at 5% / 3)", size_table(rng, args.pilots, args.fresh)),
        (
            "Seeds a method-level claim needs (S = 3 pilots, P 200, sd 0.15)",
            seeds_table(rng, max(4, args.pilots // 2), args.fresh),
        ),
    ):
        print(f"\n### {title}\n")
        print("\n".join(rows), flush=True)
    print(f"\n{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
