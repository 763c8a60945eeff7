"""`es-compare ... --plan`: before any spend, the seeds and problems the primary family needs and what they cost.

    es-compare experiment=cpu_demo methods=[base,es,grpo] --plan
    es-compare experiment=paper_easy verdict.pilot=/shared/runs/cmp-pilot --plan

From a pilot (verdict.pilot: an earlier es-compare run.dir; its report.json gives each claim's variance components,
the between-seed spread among them, and each method's device-seconds per training step from the ledger) or, without
one, the stated defaults: the calibration model (es_ray/metrics/calibration.py: logits N(-1, 1.8^2), method x
problem sd 0.6, seed shift sd 0.3, seed x problem sd 0.4, at this run's eval.n and k). Each claim is planned at
80% power one-sided at Holm's first threshold (verdict.alpha / claims), at the paper's gaps (2 and 6 points beyond
the null boundary; a non-inferiority claim at a true difference of 0, its margin from the boundary). Nothing is
trained, evaluated or written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from es_ray.launch.compare.methods import TRAINED, budget_units
from es_ray.launch.compare.verdict import claims
from es_ray.metrics.calibration import simulate

# es_ray.metrics.paired and es_ray.metrics.verdict (scipy) are imported where used: planning a comparison needs
# scipy only for its power figures.

PLAN_SEEDS = (5, 8, 10, 15, 20)
"""Seeds per method the plan prices (5: the fewest at which the verdict is the method-level test)."""
DEFAULT_SV = 0.3
"""The calibration model's seed shift sd (logit) the plan assumes without a pilot."""


def default_power(k: int, n: int, alpha: float):
    """The calibration model's components for pass@k at n samples (one large simulated experiment, fixed seed)."""
    from es_ray.metrics.paired import power

    a, b = simulate(np.random.default_rng(49), 1, 1000, 12, DEFAULT_SV, n=max(n, k), ks=(k,))
    return power([(a[0, ..., 0], b[0, ..., 0])], alpha=alpha, bound=False, sides=1)


def pilot_power(test: dict, alpha: float):
    """A claim's components from a pilot report's verdict test (report.json "verdict")."""
    from es_ray.metrics.paired import Power

    return Power(
        se=test["se"],
        df=test["df"] or math.inf,
        detectable=test.get("detectable"),
        var_problems=test["var_problems"],
        var_residual=tuple(test["var_residual"]),
        var_seeds=test.get("method_var_seeds"),
        problems=test["problems"],
        seeds=test["seeds"],
        alpha=alpha,
        power=0.8,
        mean=test.get("mean"),
        sides=1,
        bounded=False,
    )


def _problems_at(pw, effect: float, seeds: int, limit: int = 10**6) -> int | None:
    """The fewest problems per task at which the one-sided test finds ``effect`` with 80% power at ``seeds``."""
    if pw.reaches(effect, limit, seeds) < pw.power:
        return None
    lo, hi = 2, limit
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if pw.reaches(effect, mid, seeds) >= pw.power else (mid + 1, hi)
    return lo


def per_step_seconds(report: dict) -> dict[str, float]:
    """Each trained method's ledger device-seconds per training step, averaged over the pilot's seeds."""
    out: dict[str, list[float]] = {}
    for by_method in report.get("per_seed", {}).values():
        for m, e in by_method.items():
            for part in (e.get("ledger") or {}).get("parts") or []:
                if part.get("steps"):
                    out.setdefault(part["method"], []).append(part["device_s"] / part["steps"])
    return {m: float(np.mean(v)) for m, v in out.items()}


def plan(cfg, log=print) -> dict:
    """The plan's table (also returned): per claim, seeds at the planned problems and problems at each seed count,
    then the family's choice and the training compute it costs."""
    from es_ray.metrics.verdict import GAPS, parse_claim

    family = claims(cfg)
    ks = [int(k) for k in cfg.eval.k]
    alpha = cfg.verdict.alpha / max(1, len(family))
    pilot = json.loads((Path(cfg.verdict.pilot) / "report.json").read_text()) if cfg.verdict.pilot else None
    tests = {t["claim"]: t for t in ((pilot or {}).get("verdict") or {}).get("tests", []) if "p" in t}
    problems = int(cfg.eval.limit or 0) or (max((pilot or {}).get("problems", {}).values(), default=0) or 100)
    source = (
        f"pilot {cfg.verdict.pilot}"
        if pilot
        else (f"defaults: the calibration model, seed sd {DEFAULT_SV} logit (docs/comparison.md)")
    )
    log(
        f"es-compare --plan: primary family {'; '.join(family) or 'none'}; 80% power one-sided at "
        f"{cfg.verdict.alpha:g} / {len(family)} = {alpha:.3g}; {problems} problems per task; from {source}"
    )
    rows = []
    for text in family:
        c = parse_claim(text)
        metric = c.resolved(ks)
        if text in tests and tests[text].get("method_var_seeds") is not None:
            pw = pilot_power(tests[text], alpha)
        elif metric.startswith("pass@") and not pilot:
            pw = default_power(int(metric[5:]), int(cfg.eval.n), alpha)
        else:
            rows.append({"claim": text, "why": "needs a pilot with at least 2 seeds (verdict.pilot=) to plan"})
            log(f"  {text}: {rows[-1]['why']}")
            continue
        shift = cfg.verdict.margin if c.kind == "noninferiority" else 0.0
        gaps = (
            [0.0]
            if c.kind == "noninferiority"
            else list(GAPS)
            if metric.startswith("pass@")
            else [abs(tests[text]["method"]["diff"])]
        )
        for g in gaps:
            effect = g + shift
            seeds = next((s for s in range(5, 201) if pw.reaches(effect, problems, s) >= pw.power), None)
            at = {s: _problems_at(pw, effect, s) for s in PLAN_SEEDS}
            rows.append({"claim": text, "gap": g, "effect": effect, "seeds": seeds, "problems_at_seeds": at})
            unit = (lambda x: f"{100 * x:g} points") if metric.startswith("pass@") else (lambda x: f"{x:.3g} nats")
            what = "true difference 0, margin " + unit(shift) if c.kind == "noninferiority" else "gap " + unit(g)
            log(
                f"  {text} ({what}): {seeds if seeds else 'more than 200'} seeds at {problems} problems; problems "
                "at " + ", ".join(f"{s} seeds {n:,}" if n else f"{s} seeds out of reach" for s, n in at.items())
            )
    need = [r["seeds"] for r in rows if r.get("seeds") and r.get("gap", 0) != GAPS[0]]
    chosen = max(need) if need else None
    cost = None
    steps = {}
    if chosen is not None:
        pool = cfg.task.train_size or problems
        per_unit = {"es": cfg.es.prompts_per_iteration, "grpo": cfg.grpo.prompts_per_step}
        for m in cfg.methods:
            for part in TRAINED.get(m, ()):
                steps[part] = steps.get(part, 0) + budget_units(
                    cfg.budget.epochs / len(TRAINED[m]), pool, per_unit[part]
                )
        sec = per_step_seconds(pilot) if pilot else {}
        if sec and all(p in sec for p in steps):
            cost = sum(n * sec[p] for p, n in steps.items()) * chosen
    log(
        f"es-compare --plan: the family needs {chosen if chosen else 'an unreachable number of'} seeds per method at "
        f"{problems} problems (the largest over its claims, the 2-point gaps left out)"
        + (
            f"; training {sum(steps.values())} steps per seed, {cost:,.0f} device-s in all from the pilot's ledger"
            if cost is not None
            else f"; training {sum(steps.values())} steps per seed (device-s: give verdict.pilot= "
            "for the ledger's per-step figures)"
            if steps
            else ""
        )
    )
    return {
        "family": family,
        "alpha": alpha,
        "problems": problems,
        "rows": rows,
        "seeds": chosen,
        "steps_per_seed": steps,
        "device_s": cost,
        "source": source,
    }
