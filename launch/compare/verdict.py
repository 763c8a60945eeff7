"""es-compare's verdict: the primary family declared in the config before training (verdict.primary), tested
one-sided with Holm over that family only (es_ray.metrics.verdict), and its report.md section; everything else in
the report is exploratory (docs/comparison.md, "The verdict")."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from es_ray.core.config import ConfigError
from es_ray.launch.compare.methods import LABELS

# es_ray.metrics.verdict and es_ray.metrics.paired (scipy) are imported where used: the comparison's config
# (VerdictConfig) is read from here and composes without scipy.


@dataclass
class VerdictConfig:
    """The claims the verdict tests, declared before training (docs/comparison.md, "The verdict")."""

    primary: list[str] = field(default_factory=list)
    """The primary family, each METRIC:FIRST>SECOND (superiority) or METRIC:FIRST>=SECOND (non-inferiority within
    verdict.margin), METRIC pass@K, pass@max (the largest eval.k) or entropy. Empty: the paper's three claims for
    the methods run: pass@max:es>grpo, entropy:es>grpo, pass@1:grpo>=es (pass@1: the smallest eval.k)."""
    margin: float = 0.02
    """The non-inferiority margin, in the metric's units (pass@k as a fraction: 0.02 = 2 points): FIRST>=SECOND
    holds where FIRST - SECOND is shown above -margin."""
    alpha: float = 0.05
    """Family-wise error rate of the primary family (Holm over its claims only)."""
    pilot: str = ""
    """`es-compare ... --plan`: an earlier es-compare run.dir whose report.json gives the seed spread, the problem
    variance and the per-step compute; empty: the stated defaults (the calibration model, docs/comparison.md)."""


def claims(cfg) -> list[str]:
    """The primary family of a CompareConfig: verdict.primary, or the paper's claims for the methods run."""
    from es_ray.metrics.verdict import default_claims

    ks = [int(k) for k in cfg.eval.k]
    return list(cfg.verdict.primary) or default_claims(cfg.methods, ks)


def seeds_by_method(cfg) -> dict[str, list[int]]:
    """The run seeds of each method (one list for every method in this schema)."""
    return {m: list(cfg.seeds) for m in cfg.methods}


def validate_verdict(cfg) -> None:
    """Refuse, before any training, a primary claim the run cannot test, a margin <= 0, an alpha outside (0, 1) and
    seeds that differ between the methods: one line naming the key to change."""
    from es_ray.metrics.verdict import claim_problems

    v = cfg.verdict
    if not v.margin > 0:
        raise ConfigError(
            f"verdict.margin={v.margin}: give a non-inferiority margin > 0 in the metric's units, e.g. "
            "verdict.margin=0.02 (2 points of pass@k)"
        )
    if not 0 < v.alpha < 1:
        raise ConfigError(f"verdict.alpha={v.alpha}: give a family-wise error rate in (0, 1), e.g. 0.05")
    bad = claim_problems(list(v.primary), list(cfg.methods), [int(k) for k in cfg.eval.k])
    if bad:
        raise ConfigError(
            f"verdict.primary: {bad[0]}; set verdict.primary=[...] to claims the run can test, or [] "
            "for the paper's claims"
        )
    check_seeds(seeds_by_method(cfg))


def check_seeds(by_method: dict[str, list[int]]) -> None:
    """Every method trained on the same seeds (the primary family compares them seed count for seed count)."""
    sets = {m: sorted(s) for m, s in by_method.items() if m != "base"}
    if len({tuple(s) for s in sets.values()}) > 1:
        raise ConfigError(
            "seeds differ between the methods ("
            + ", ".join(f"{m} {s}" for m, s in sets.items())
            + "): give every method the same seeds=[...]"
        )


def primary_section(pp: dict, cfg, ks: list[int], tasks: list[str]) -> dict:
    """The primary family's tests from the per-problem scores (launch.compare.report.scores)."""
    from es_ray.metrics.verdict import METHOD_LEVEL_SEEDS, claim_test, family_verdict, parse_claim

    family = claims(cfg)
    v = cfg.verdict
    out = {
        "claims": family,
        "alpha": v.alpha,
        "margin": v.margin,
        "tests": [],
        "method_level_seeds": METHOD_LEVEL_SEEDS,
        "declared": bool(cfg.verdict.primary),
    }
    for text in family:
        c = parse_claim(text)
        m1, m2 = pp["methods"].get(c.first), pp["methods"].get(c.second)
        if m1 is None or m2 is None:
            out["tests"].append({"claim": text, "why": "no per-problem samples (eval.save_samples=false)"})
            continue
        if c.metric == "entropy":
            pairs = []
            for t in tasks:
                ok = np.isfinite(m1["entropy"][t]).all(axis=0) & np.isfinite(m2["entropy"][t]).all(axis=0)
                pairs.append((m2["entropy"][t][:, ok], m1["entropy"][t][:, ok]))
        else:
            j = ks.index(int(c.resolved(ks)[5:]))
            pairs = [(m2["pass"][t][..., j], m1["pass"][t][..., j]) for t in tasks]
        if min(a.shape[-1] for a, _ in pairs) < 2:
            out["tests"].append({"claim": text, "why": "fewer than two problems scored by every seed"})
            continue
        out["tests"].append(claim_test(c, pairs, margin=v.margin, alpha=v.alpha, family=len(family), ks=ks))
    tested = [t for t in out["tests"] if "p" in t]
    family_verdict(tested, v.alpha)
    return out


# -- report.md ------------------------------------------------------------------------------------------------------


def _u(t: dict, x) -> str:
    """A difference in the claim's unit: points (pass@k) or nats."""
    if x is None:
        return "-"
    return f"{100 * x:+.1f} points" if t["metric"].startswith("pass@") else f"{x:+.3f} nats"


def claim_words(t: dict) -> str:
    first, second = LABELS.get(t["first"], t["first"]), LABELS.get(t["second"], t["second"])
    rel = (
        f"{first} above {second}"
        if t["kind"] == "superiority"
        else f"{first} not below {second} by more than {_u(t, t['margin']).lstrip('+')}"
    )
    return f"{t['metric']}: {rel}"


def _subject(t: dict) -> str:
    first, second = LABELS.get(t["first"], t["first"]), LABELS.get(t["second"], t["second"])
    if t["seeds"] == 1:
        return f"this {first} run vs this {second} run"
    return f"these {t['seeds']} {first} runs vs these {t['seeds']} {second} runs (seed-averaged)"


def verdict_line(t: dict) -> str:
    """The claim's verdict, labelled by what its seeds can carry."""
    if "p" not in t and "method" in t:
        return "no verdict: the checkpoint test needs the per-problem scores (not kept; below)"
    if "p" not in t:
        return f"not tested: {t['why']}"
    if t["level"] == "method":
        return "holds (method level)" if t["holds"] else "not shown (method level)"
    return (
        f"holds for {_subject(t)} (checkpoint test; no method claim)"
        if t["holds"]
        else f"not shown for {_subject(t)} (checkpoint test; no method claim)"
    )


def _size(t: dict) -> str:
    if t["beyond_range"]:
        return "not detectable at any size"
    if t["detectable"] is None:
        return "-"
    size, ways = _u(t, t["detectable"]).lstrip("+"), t.get("by_direction") or {}
    said = {key: "beyond the range" if v is None else _u(t, v).lstrip("+") for key, v in ways.items()}
    if len(set(said.values())) < 2:  # mid-range: both ways print alike
        return size
    # near an end the way that costs less is found with 80% power at its own, smaller size
    # (es_ray.metrics.verdict.size_and_needs); the size above is the larger, found with 80% power either way
    return (
        f"{size} ({LABELS.get(t['first'], t['first'])} rising {said['first_rises']}; "
        f"{LABELS.get(t['second'], t['second'])} falling {said['second_falls']})"
    )


def _needs(t: dict) -> str:
    out = []
    for g, n in t["needs"].items():
        p = f"{n['problems']:,} problems" if n["problems"] is not None else "more seeds first"
        s = (
            f"{n['seeds']} seeds"
            if n["seeds"] is not None
            else ("unknown seeds (one seed: no spread)" if t["seeds"] == 1 else "no seed count")
        )
        out.append(f"{100 * float(g):g} points: {p} at {t['seeds']} seed(s), or {s} at {t['problems']} problems")
    return "; ".join(out) or "-"


def head_lines(rep: dict) -> list[str]:
    """The report's first lines: the primary family, the seeds and the problems."""
    v = rep.get("verdict") or {}
    seeds = rep.get("seeds", [])
    probs = ", ".join(f"{t} {n}" for t, n in (rep.get("problems") or {}).items()) or "none"
    fam = "; ".join(v.get("claims", [])) or "none (the run lacks es or grpo)"
    how = "declared in verdict.primary" if v.get("declared") else "the paper's claims (verdict.primary default)"
    s = len(seeds)
    level = (
        "one seed: checkpoint tests only (this run vs that run), no method claim"
        if s == 1
        else f"{s} seeds: checkpoint tests on the seed-averaged scores, no method claim (the method-level test needs "
        f"at least {v.get('method_level_seeds', 5)})"
        if s < v.get("method_level_seeds", 5)
        else f"{s} seeds: the method-level test"
    )
    return [
        f"**Primary family** ({how}; one-sided, Holm at {v.get('alpha', 0.05):g} over these "
        f"{len(v.get('claims', []))} only): {fam}.",
        "",
        f"**Seeds** per method: {s} ({seeds}); {level}. **Problems** per task: {probs}.",
    ]


def verdict_section(rep: dict) -> list[str]:
    """The primary family's table, the sizes and needs, and what the seed count can say."""
    v = rep.get("verdict") or {}
    tests = v.get("tests") or []
    if not tests:
        return []
    lines = [
        "",
        "## Verdict on the primary family",
        "",
        "Each claim one-sided in its stated direction (non-inferiority against verdict.margin), Holm over the "
        "primary family only. Detectable: the smallest distance from the claim's null boundary the verdict's "
        "test finds with 80% power at Holm's first threshold, at the estimated variance (the test simulated; "
        "not a bound; near either end of a pass@k each way the gap can be made gets its own, in brackets). "
        "Needed: for a 2 and a 6 point gap beyond the null boundary, at 80% power and the same "
        "threshold.",
        "",
        "| claim | test | estimate [95% interval] | one-sided lower bound | p | Holm p | verdict | "
        "detectable | needed for 2 / 6 points |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in tests:
        if "p" not in t and "method" in t:  # from a report's summaries: the method-level estimate, no verdict
            m = t["method"]
            lines.append(
                f"| {claim_words(t)} | method level (estimate only) | {_u(t, m['diff'])} [{_u(t, m['low'])}, "
                f"{_u(t, m['high'])}] | {_u(t, t['lower'])} | {t['method_p']:.2g} (method level) | - | "
                f"{verdict_line(t)} | - | - |"
            )
            continue
        if "p" not in t:
            lines.append(f"| {t['claim']} | - | - | - | - | - | {verdict_line(t)} | - | - |")
            continue
        test = t["checkpoint"] if t["level"] == "checkpoint" else t["method"]
        kind = (
            "checkpoint: t over problems" + (" on seed-averaged scores" if t["seeds"] > 1 else "")
            if t["level"] == "checkpoint"
            else "method level: problems and seeds"
        )
        lines.append(
            f"| {claim_words(t)} | {kind} | {_u(t, test['diff'])} [{_u(t, test['low'])}, "
            f"{_u(t, test['high'])}] | {_u(t, t['lower'])} | {t['p']:.2g} | {t['p_holm']:.2g} | "
            f"{verdict_line(t)} | {_size(t)} | {_needs(t)} |"
        )
    why = next((t["why"] for t in tests if "p" not in t and "method" in t), None)
    if why:
        lines += [
            "",
            f"Not kept: {why}. The estimates, intervals and one-sided bounds are the method-level test's "
            "(valid at every seed count); at fewer than 5 seeds they are no verdict.",
        ]
    lines += [""] + seeds_lines(rep, tests)
    return lines


def seeds_lines(rep: dict, tests: list[dict]) -> list[str]:
    """What this seed count can say: the method-level estimates and, at 2-4 seeds, the seeds a claim needs."""
    out = []
    for t in (x for x in tests if "method" in x):
        s, m = t["seeds"], t["method"]
        if s == 1:
            out.append(
                f"- {claim_words(t)}: one seed per method, this run vs that run only; a method-level claim "
                "needs at least 5 seeds per method and their spread."
            )
        elif t["level"] == "checkpoint":
            sd = (t.get("method_var_seeds") or 0.0) ** 0.5
            out.append(
                f"- {claim_words(t)}: method-level estimate {_u(t, m['diff'])} [{_u(t, m['low'])}, "
                f"{_u(t, m['high'])}] over {s} seeds, between-seed sd {_u(t, sd).lstrip('+')} (per method, "
                f"estimated from {s} seeds per method); {seeds_needed_words(t, s, sd)}."
            )
    return out + ([""] if out else [])


def seeds_needed_words(t: dict, s: int, sd: float) -> str:
    """The seeds a method-level claim needs, said as what it is: N at the spread the 2-4 seeds estimate, beside the
    N at that spread's 95% upper bound (es_ray.metrics.verdict.seeds_for_claim), since 2-4 seeds estimate it on
    2-6 degrees of freedom."""
    m, need = t["method"], t.get("seeds_for_claim")
    if m["diff"] + t["margin"] <= 0:
        return "the method-level estimate is not in the claimed direction: no seed count makes it a claim"
    est = (
        f"S >= {need} seeds at the estimated spread"
        if need is not None
        else f"no seed count up to 200 at {t['problems']} problems at the estimated spread (more problems first)"
    )
    words = f"a method-level claim needs {est}, if the estimate were the truth"
    var_hi = t.get("method_var_seeds_bound")
    if var_hi is None:
        return (
            words + f"; a spread from {s} seeds can be several times larger (its bound needs the per-problem "
            "scores, not kept here)"
        )
    hi, sd_hi = t.get("seeds_for_claim_bound"), _u(t, var_hi**0.5).lstrip("+")
    return words + (
        f"; at the spread's 95% upper bound from {s} seeds (sd {sd_hi}) S >= {hi}"
        if hi is not None
        else f"; at the spread's 95% upper bound from {s} seeds (sd {sd_hi}) no seed count up to 200 at "
        f"{t['problems']} problems"
    )


def exploratory_note() -> str:
    return (
        "Exploratory: every pair of methods at every k and on entropy, with estimates and 95% intervals only; "
        "nothing here is a verdict (the verdict is the primary family's, above)."
    )


# -- a report.json written before the primary family, without per-problem scores ------------------------------------


def stored_section(rep: dict, family: list[str], margin: float, alpha: float) -> dict:
    """The primary family from a report.json that kept only its paired tests' summaries (diff, se, df, the training
    share of se^2; not the per-problem scores): the method-level estimate, interval and one-sided bound of each
    claim, and the seeds a method-level claim needs at this spread (the problem variance taken as all method x
    problem variance: the residual part is not separable from the summary). The checkpoint test and the detectable
    sizes need the per-problem scores and are left out, saying so.

    The one-sided p is floored at 2^-P (es_ray.metrics.verdict.one_sided; P the stored problems over all tasks, as
    claim_test counts them): the smallest p an exact sign-flip test on P problems gives. The floor only raises a p,
    so it never makes the test less conservative, and it binds only where the t's p is below it (every difference
    positive, se 0, or a t in the hundreds). It is not a p of its own at a non-inferiority boundary: with se 0 (every
    paired difference equal) the null shifted by the margin is no sign-flip null, and a p of 2^-P would be support
    the data cannot give; such a claim is not tested, as claim_test does."""
    from es_ray.metrics.paired import Power
    from es_ray.metrics.verdict import METHOD_LEVEL_SEEDS, NO_VARIANCE, one_sided, parse_claim

    out = {
        "claims": family,
        "alpha": alpha,
        "margin": margin,
        "tests": [],
        "method_level_seeds": METHOD_LEVEL_SEEDS,
        "declared": False,
        "from_summaries": True,
    }
    for text in family:
        c = parse_claim(text)
        metric = c.resolved(rep["k"])
        t = find_test(rep, c.first, c.second, metric)
        if t is None:
            out["tests"].append({"claim": text, "why": "not in the stored report"})
            continue
        shift = margin if c.kind == "noninferiority" else 0.0
        if shift > 0 and not t["se"] > 0:
            out["tests"].append({"claim": text, "why": NO_VARIANCE})
            continue
        s, per_task = t["seeds_a"], t["problems"] / len(rep["tasks"])
        p, lower = one_sided(t["diff"], t["se"], t["df"] or math.inf, shift, t["problems"], alpha)
        u = t["var_training"] * s / 2  # sum_m sigma_u^2 / S over two methods of S seeds each, pooled
        pw = Power(
            se=t["se"],
            df=t["df"] or math.inf,
            detectable=None,
            var_problems=max(0.0, t["se"] ** 2 - t["var_training"]) * per_task,
            var_residual=(0.0, 0.0),
            var_seeds=u if s > 1 else None,
            problems=round(per_task),
            seeds=s,
            alpha=alpha / len(family),
            power=0.8,
            sides=1,
            bounded=False,
        )
        effect = t["diff"] + shift
        need = (
            next((n for n in range(METHOD_LEVEL_SEEDS, 201) if pw.reaches(effect, per_task, n) >= 0.8), None)
            if effect > 0 and s > 1
            else None
        )
        out["tests"].append(
            {
                "claim": text,
                "metric": metric,
                "first": c.first,
                "second": c.second,
                "kind": c.kind,
                "margin": shift,
                "seeds": s,
                "problems": t["problems"],
                "level": "checkpoint" if s < METHOD_LEVEL_SEEDS else "method",
                "method": {"diff": t["diff"], "low": t["low"], "high": t["high"], "se": t["se"], "df": t["df"]},
                "method_p": p,
                "lower": lower,
                "method_var_seeds": u if s > 1 else None,
                "seeds_for_claim": need,
                "why": "the per-problem scores were not kept in this report.json (each evaluation's samples.jsonl "
                "stayed in the run directory): the checkpoint test and the detectable sizes need them",
            }
        )
    return out


def find_test(rep: dict, a: str, b: str, metric: str) -> dict | None:
    """The comparison of a and b on a metric, oriented a - b (a stored b - a is flipped)."""
    for t in rep["comparisons"]["tests"]:
        if t["metric"] == metric and (t["a"], t["b"]) in ((a, b), (b, a)):
            if t["a"] == a:
                return t
            return {
                **t,
                "a": a,
                "b": b,
                "diff": -t["diff"],
                "low": -t["high"],
                "high": -t["low"],
                "seeds_a": t.get("seeds_b", t["seeds"]),
                "seeds_b": t.get("seeds_a", t["seeds"]),
            }
    return None
