"""The verdict on the paper's claims (pure numpy/scipy): a primary family declared before training, each claim tested
one-sided in its stated direction, Holm over that family only; what each seed count can say; detectable sizes at
the estimated variance (docs/comparison.md, "The verdict").

A claim is ``METRIC:FIRST>SECOND`` (superiority: H0 d <= 0) or ``METRIC:FIRST>=SECOND`` (non-inferiority with the
margin delta: H0 d <= -delta), d = mean(FIRST) - mean(SECOND) over problems (and seeds); METRIC is ``pass@K``,
``pass@max`` (the largest k evaluated) or ``entropy``. The paper's three (``PAPER_CLAIMS``): coverage at the largest
k, ES above GRPO; entropy, ES above GRPO; Pass@1, GRPO not below ES by more than the margin.

The test of each claim, by the seeds per method S (equal between the methods):

    S = 1     the checkpoint test only: this FIRST run vs this SECOND run, a t over problems; no method claim.
    S = 2-4   the labelled checkpoint test (a t over problems on the seed-averaged scores: these runs vs those), the
              method-level estimate with its interval (es_ray.metrics.paired, valid at every S), and the seeds a
              method-level claim needs at this spread.
    S >= 5    the method-level test (es_ray.metrics.paired: problems and seeds, seeds a random effect).

    p = P(T_df >= (d + delta) / se)   (delta 0 for superiority), floored at 2^-P (an exact sign-flip test's smallest)
    lower bound = d - t_{1 - alpha, df} se   (the one-sided interval; the claim holds where it clears -delta)

and Holm's step-down over the primary family's one-sided p-values. Detectable: the smallest distance from the null
boundary (d + delta) that the verdict's test finds with 80% power, one-sided at Holm's first threshold alpha / m, the
test itself simulated at the estimated variance components (``paired.power(bound=False, sides=1)``: the median
case, not the 95% bound); past the metric's range (FIRST above 100% of pass@k: a distance beyond
1 - mean(SECOND) + delta) it is "not detectable at any size".
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import stats

from es_ray.metrics.paired import holm as _holm
from es_ray.metrics.paired import paired_difference_tasks, power

METHOD_LEVEL_SEEDS = 5
"""The fewest seeds per method at which the verdict is the method-level test (below it: the checkpoint test)."""
PAPER_CLAIMS = ("pass@max:es>grpo", "entropy:es>grpo", "pass@1:grpo>=es")
"""The paper's three claims (docs/design.md): coverage at the largest k, ES above GRPO; entropy, ES above GRPO;
Pass@1, GRPO not below ES by more than verdict.margin."""
GAPS = (0.02, 0.06)
"""The paper's Pass@16 gaps (2 and 6 points): the seeds and problems each would need are printed beside the sizes."""
POWER = 0.8
NO_VARIANCE = (
    "every paired difference is equal (e.g. every completion wrong or every one right): no variance to "
    "test non-inferiority against; more problems or samples (eval.n)"
)
"""Why a non-inferiority claim with se 0 is not tested (claim_test, launch.compare.verdict.stored_section)."""
_CLAIM = re.compile(r"^\s*(pass@(?:\d+|max)|entropy)\s*:\s*([a-z_]+)\s*(>=|>)\s*([a-z_]+)\s*$")


@dataclass(frozen=True)
class Claim:
    metric: str
    """pass@K, pass@max or entropy, as written."""
    first: str
    second: str
    kind: str
    """superiority (first > second) or noninferiority (first >= second - margin)."""

    @property
    def text(self) -> str:
        return f"{self.metric}:{self.first}{'>=' if self.kind == 'noninferiority' else '>'}{self.second}"

    def resolved(self, ks: Sequence[int]) -> str:
        """The metric as the report names it: pass@max -> pass@<largest k>."""
        return f"pass@{max(ks)}" if self.metric == "pass@max" else self.metric


def parse_claim(text: str) -> Claim:
    """``METRIC:A>B`` or ``METRIC:A>=B`` -> Claim; ValueError naming the form otherwise."""
    m = _CLAIM.match(str(text))
    if not m:
        raise ValueError(
            f"{text!r} is not a claim: write METRIC:FIRST>SECOND (superiority) or METRIC:FIRST>=SECOND "
            "(non-inferiority within verdict.margin), METRIC one of pass@K, pass@max, entropy, e.g. "
            "pass@max:es>grpo"
        )
    metric, first, op, second = m.groups()
    if first == second:
        raise ValueError(f"{text!r} compares {first} with itself")
    return Claim(metric, first, second, "noninferiority" if op == ">=" else "superiority")


def default_claims(methods: Sequence[str], ks: Sequence[int]) -> list[str]:
    """The paper's claims for the methods present (none without both es and grpo); Pass@1 becomes the smallest k
    evaluated where k = 1 is not."""
    if not {"es", "grpo"} <= set(methods):
        return []
    return [c.replace("pass@1:", f"pass@{min(ks)}:") for c in PAPER_CLAIMS]


def claim_problems(claims: Sequence[str], methods: Sequence[str], ks: Sequence[int]) -> list[str]:
    """Why each claim cannot be tested by a run of ``methods`` at ``ks`` (empty: all can)."""
    out = []
    for text in claims:
        try:
            c = parse_claim(text)
        except ValueError as e:
            out.append(str(e))
            continue
        missing = [m for m in (c.first, c.second) if m not in methods]
        if missing:
            out.append(f"{text!r} names {', '.join(missing)}, which the run lacks (methods={list(methods)})")
        if c.metric.startswith("pass@") and c.metric != "pass@max" and int(c.metric[5:]) not in ks:
            out.append(f"{text!r} names {c.metric}, which the run does not evaluate (eval.k={list(ks)})")
    return out


def holm(p: Sequence[float]) -> list[float]:

    return _holm(p)


def one_sided(diff: float, se: float, df: float, shift: float, problems: int, alpha: float) -> tuple[float, float]:
    """(p, lower bound): p = P(T_df >= (diff + shift) / se), floored at 2^-problems; lower = diff - t_{1-alpha} se."""
    df = min(df, 1e12)
    if se > 0:
        p = float(stats.t.sf((diff + shift) / se, df))
        lower = diff - float(stats.t.ppf(1 - alpha, df)) * se
    else:
        p, lower = (0.0 if diff + shift > 0 else 1.0), diff
    return max(p, 2.0**-problems), lower


def size_and_needs(
    pairs, alpha: float, checkpoint: bool, gaps: Sequence[float], shift: float, bounded_range: bool
) -> dict:
    """The verdict test's detectable size (80% power, one-sided at ``alpha``, the estimated variance; None past
    the metric's range) and the problems (at these seeds) and seeds (at these problems) each gap beyond the null
    boundary would need. ``checkpoint``: the t over problems on the seed-averaged scores."""

    use = (
        [(a.mean(0) if a.ndim == 2 else a, b.mean(0) if b.ndim == 2 else b) for a, b in pairs] if checkpoint else pairs
    )
    pw = power(use, alpha=alpha, power=POWER, bound=False, sides=1)
    det = pw.detectable
    # the room the metric leaves, one method moving and the other where it is (as the size's variance assumes,
    # paired.Power._growth): FIRST rising to 100% (1 - mean(SECOND)) or SECOND falling to 0% (mean(FIRST)), plus the
    # shift. Near the ceiling a gap is the second falling: both at 94% leave 6 points above but 94 below, and a size of
    # 7 points is a real world (benchmarks/verdict_audit.py realises it so), not "not detectable at any size"
    second, first = (float(np.mean([np.mean(x[i]) for x in pairs])) for i in (0, 1))
    room = max(1.0 - second, first) + shift
    beyond = det is not None and bounded_range and det > room
    # the size for each way the gap can be made, within the room that way leaves: the one above is the larger of
    # the two, found with 80% power either way and 88-93% where the other way is the real one (near an end)
    by_direction = {}
    if bounded_range and pw.mean is not None and det is not None:
        for key, moves, way_room in (("first_rises", 1, 1.0 - second + shift), ("second_falls", -1, first + shift)):
            d = power(use, alpha=alpha, power=POWER, bound=False, sides=1, moves=moves).detectable
            by_direction[key] = None if d is None or d > way_room else d
    out = {
        "detectable": None if beyond else det,
        "beyond_range": beyond,
        "by_direction": by_direction,
        "alpha": alpha,
        "var_seeds": pw.var_seeds,
        "var_problems": pw.var_problems,
        "var_residual": list(pw.var_residual),
        "mean": pw.mean,
        "needs": {},
    }
    # the method-level test's needs where the seeds give a spread; with one seed, the checkpoint test's problems
    full = power(pairs, alpha=alpha, power=POWER, bound=False, sides=1) if checkpoint else pw
    plan = full if full.var_seeds is not None else pw
    for g in gaps:
        out["needs"][f"{g:g}"] = {
            "problems": plan.problems_needed(g + shift),
            "seeds": full.seeds_needed(g + shift) if full.var_seeds is not None else None,
            "of": "method" if full.var_seeds is not None else "checkpoint",
        }
    out["method_var_seeds"] = full.var_seeds
    return out


def seeds_for_claim(pairs, alpha: float, effect: float) -> dict:
    """The fewest seeds (at least METHOD_LEVEL_SEEDS) at which the method-level test finds ``effect`` (the distance
    of this estimate from the null boundary) with 80% power at these problems: ``at_estimate`` at the spread these
    2-4 seeds estimate, ``at_bound`` at its SEED_BOUND (95%) upper confidence bound (es_ray.metrics.paired: pooled
    over the two methods), with the between-seed variances both use (``var_seeds``, ``var_seeds_bound``). Two to
    four seeds per method estimate a spread on 2-6 degrees of freedom, so the estimate's N can be several times too
    few (its upper bound is 4-20x the estimate's variance); the pair says how far. None where the estimate is not in
    the claimed direction or no seed count up to 200 reaches it."""

    pw = power(pairs, alpha=alpha, power=POWER, bound=False, sides=1)
    out = {"at_estimate": None, "at_bound": None, "var_seeds": pw.var_seeds, "var_seeds_bound": None}
    if pw.var_seeds is None:
        return out
    hi = power(pairs, alpha=alpha, power=POWER, bound=True, sides=1).var_seeds
    out["var_seeds_bound"] = hi
    if not effect > 0:
        return out
    # the bound's variance with the estimate's single split (both methods alike): the seeds it needs, not a worst case
    for key, pw_at in (("at_estimate", pw), ("at_bound", dataclasses.replace(pw, var_seeds=hi))):
        s = pw_at.seeds_needed(effect, limit=200)
        out[key] = None if s is None else max(METHOD_LEVEL_SEEDS, s)
    return out


def claim_test(
    claim: Claim, pairs, *, margin: float, alpha: float, family: int, ks: Sequence[int], level: float = 0.95
) -> dict:
    """One primary claim: ``pairs`` [(second_t, first_t)] per task, (seeds, problems_t) arrays (entropy: nats;
    pass@k: [0, 1]). Returns the verdict test's one-sided p (Holm is applied over the family by ``family_verdict``),
    its lower bound, the method-level estimate and interval, the detectable size and the seeds and problems the
    paper's gaps need."""

    metric = claim.resolved(ks)
    shift = margin if claim.kind == "noninferiority" else 0.0
    seeds = min(np.atleast_2d(pairs[0][0]).shape[0], np.atleast_2d(pairs[0][1]).shape[0])
    checkpoint = seeds < METHOD_LEVEL_SEEDS
    method = paired_difference_tasks(pairs, level=level)
    avg = [(np.atleast_2d(a).mean(0), np.atleast_2d(b).mean(0)) for a, b in pairs]
    ckpt = paired_difference_tasks(avg, level=level)
    test = ckpt if checkpoint else method
    problems = sum(np.shape(a)[-1] for a, _ in pairs)
    if shift > 0 and not test.se > 0:
        # every paired difference equal (every completion wrong, or every one right): the floor 2^-P is the exact
        # sign-flip test's, valid where the null makes the methods exchangeable (superiority), not at a boundary
        # shifted by the margin, and the t has no variance: a non-inferiority p of 2^-P would be invented
        return {"claim": claim.text, "why": NO_VARIANCE}
    p, lower = one_sided(test.diff, test.se, test.df, shift, problems, alpha)
    alpha_first = alpha / family
    is_pass = metric.startswith("pass@")
    sizes = size_and_needs(
        [(np.atleast_2d(a), np.atleast_2d(b)) for a, b in pairs],
        alpha_first,
        checkpoint,
        GAPS if is_pass else (),
        shift,
        is_pass,
    )
    out = {
        "claim": claim.text,
        "metric": metric,
        "first": claim.first,
        "second": claim.second,
        "kind": claim.kind,
        "margin": shift,
        "seeds": seeds,
        "problems": problems,
        "level": "checkpoint" if checkpoint else "method",
        "diff": test.diff,
        "se": test.se,
        "df": test.df if math.isfinite(test.df) else None,
        "p": p,
        "lower": lower,
        "alpha": alpha,
        "method": {
            "diff": method.diff,
            "low": method.low,
            "high": method.high,
            "se": method.se,
            "df": method.df if math.isfinite(method.df) else None,
        },
        "checkpoint": {
            "diff": ckpt.diff,
            "low": ckpt.low,
            "high": ckpt.high,
            "se": ckpt.se,
            "df": ckpt.df if math.isfinite(ckpt.df) else None,
        },
        **sizes,
    }
    if 2 <= seeds < METHOD_LEVEL_SEEDS:
        need = seeds_for_claim(
            [(np.atleast_2d(a), np.atleast_2d(b)) for a, b in pairs], alpha_first, method.diff + shift
        )
        out["seeds_for_claim"], out["seeds_for_claim_bound"] = need["at_estimate"], need["at_bound"]
        out["method_var_seeds_bound"] = need["var_seeds_bound"]
    return out


def family_verdict(tests: list[dict], alpha: float) -> list[dict]:
    """Holm over the primary family: each test gains p_holm and holds (the claim's H0 rejected at alpha)."""
    for t, adj in zip(tests, holm([t["p"] for t in tests])):
        t["p_holm"] = adj
        t["holds"] = adj < alpha
    return tests
