"""es-compare's report: report.json, report.md and the plots, from the stages' own output files.

Everything here is read back from disk (results.json and samples.jsonl of each evaluation, metrics.jsonl and
ledger.json of each training run, drift.json of each drift stage), so a report can be rebuilt at any time from a
comparison directory without running anything.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from es_ray.eval.passk import pass_at_k

LABELS = {"base": "Base", "es": "ES", "grpo": "GRPO", "es_grpo": "ES->GRPO", "grpo_es": "GRPO->ES"}


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def passk_curves(samples: list[dict], n: int) -> dict[str, list[float]]:
    """Per task, mean pass@k over problems for k = 1..n (unbiased estimator), from samples.jsonl rows."""
    correct: dict[str, dict[int, int]] = {}
    for s in samples:
        per = correct.setdefault(s["task"], {})
        per[s["problem"]] = per.get(s["problem"], 0) + int(bool(s["correct"]))
    return {task: [float(np.mean([pass_at_k(n, c, k) for c in per.values()])) for k in range(1, n + 1)]
            for task, per in correct.items()}


def method_ledger(cfg, root: Path, parts: list[tuple[str, str]]) -> dict | None:
    """Sum of the measured ledgers of a method's training runs ([(stage name, es|grpo)]); peaks are maxima."""
    if not parts:
        return None
    out = {"tokens_generated": 0, "tokens_backpropagated": 0, "wall_s": 0.0, "startup_s": 0.0, "device_s": 0.0,
           "device": None, "peak_rss_bytes_max": 0, "peak_gpu_bytes_max": None, "phase_seconds": {}, "parts": []}
    for stage, kind in parts:
        led = _read_json(root / "stages" / stage / "ledger.json")
        if led is None:
            raise FileNotFoundError(f"{root / 'stages' / stage / 'ledger.json'} is missing: the training stage "
                                    f"{stage} did not write its ledger; delete its done.json to run it again")
        out["tokens_generated"] += led["tokens_generated"]
        out["tokens_backpropagated"] += led["tokens_backpropagated"]
        out["wall_s"] += led["wall_s"]
        out["startup_s"] += led["startup_s"] or 0.0
        out["device_s"] += led["device_seconds"]  # measured by the runtime's ledger, the same way for every method
        out["device"] = led["device_kind"].upper()
        out["peak_rss_bytes_max"] = max(out["peak_rss_bytes_max"], led["peak_rss_bytes_max"] or 0)
        if led.get("peak_gpu_bytes_max"):
            out["peak_gpu_bytes_max"] = max(out["peak_gpu_bytes_max"] or 0, led["peak_gpu_bytes_max"])
        for phase, s in led["phase_seconds"].items():
            out["phase_seconds"][phase] = out["phase_seconds"].get(phase, 0.0) + s
        out["parts"].append({"stage": stage, "method": kind, "steps": led["steps"], "wall_s": led["wall_s"],
                             "tokens_generated": led["tokens_generated"],
                             "tokens_backpropagated": led["tokens_backpropagated"],
                             "peak_rss_bytes_max": led["peak_rss_bytes_max"],
                             "peak_gpu_bytes_max": led.get("peak_gpu_bytes_max")})
    return out


def reward_curve(root: Path, parts: list[tuple[str, str]], pool: int, cfg) -> list[tuple[float, float]]:
    """(epochs seen, mean training reward) per iteration/step, the parts of a sequential method end to end."""
    points, offset = [], 0.0
    for stage, kind in parts:
        per_unit = cfg.es.prompts_per_iteration if kind == "es" else cfg.grpo.prompts_per_step
        rows = _read_jsonl(root / "stages" / stage / "metrics.jsonl")
        rows = [r for r in rows if r.get("reward/mean") is not None]
        for i, r in enumerate(rows):
            points.append((offset + (i + 1) * per_unit / pool, float(r["reward/mean"])))
        offset += len(rows) * per_unit / pool
    return points


def held_out_curve(root: Path, parts: list[tuple[str, str]], pool: int, cfg) -> list[tuple[float, float, float]]:
    """(epochs seen, held-out pass@1, held-out entropy) at each eval.every row of the training run(s), the parts
    of a sequential method end to end."""
    points, offset = [], 0.0
    for stage, kind in parts:
        per_unit = cfg.es.prompts_per_iteration if kind == "es" else cfg.grpo.prompts_per_step
        rows = [r for r in _read_jsonl(root / "stages" / stage / "metrics.jsonl") if r.get("reward/mean") is not None]
        for i, r in enumerate(rows):
            if r.get("eval/pass@1") is not None:
                points.append((offset + (i + 1) * per_unit / pool, float(r["eval/pass@1"]), r.get("eval/entropy")))
        offset += len(rows) * per_unit / pool
    return points


def across_seeds(per_seed: dict, ks: list[int]) -> dict:
    """Per method: mean and std over seeds of the average pass@k, the entropy and the drift L2."""
    out = {}
    for method in next(iter(per_seed.values()))["methods"]:
        entries = [rep["methods"][method] for rep in per_seed.values()]

        def stat(values):
            v = [x for x in values if x is not None]
            return {"mean": float(np.mean(v)) if v else None, "std": float(np.std(v, ddof=1)) if len(v) > 1 else 0.0,
                    "values": values}

        out[method] = {"average": {str(k): stat([e["average"][str(k)] for e in entries]) for k in ks},
                       "entropy": stat([e["entropy"]["mean_per_token"] for e in entries]),
                       "drift_l2": stat([(e.get("drift") or {}).get("l2") for e in entries])}
    return out


def intervals(root: Path, cfg, plan: dict) -> dict:
    """95% bootstrap intervals over problems of each method's pass@k, per task and for the average over tasks; a
    problem's pass@k is averaged over the seeds first (the problems are the same for every seed)."""
    from es_ray.eval.bootstrap import interval, interval_of_task_means

    n, ks, tasks = int(cfg.eval.n), [int(k) for k in cfg.eval.k], list(cfg.eval.tasks)
    out = {}
    for method, by_seed in plan.items():
        per_task: dict[str, dict[int, list[list[float]]]] = {t: {} for t in tasks}
        for stages in by_seed.values():
            correct: dict[str, dict[int, int]] = {t: {} for t in tasks}
            for s in _read_jsonl(root / "stages" / _stage(stages, "eval").name / "samples.jsonl"):
                c = correct[s["task"]]
                c[s["problem"]] = c.get(s["problem"], 0) + int(bool(s["correct"]))
            for t in tasks:
                for p, c in correct[t].items():
                    per_task[t].setdefault(p, []).append([pass_at_k(n, c, k) for k in ks])
        if not all(per_task[t] for t in tasks):  # samples.jsonl not kept (eval.save_samples=false)
            continue
        values = {t: np.array([np.mean(v, axis=0) for _, v in sorted(per_task[t].items())]) for t in tasks}
        out[method] = {
            "tasks": {t: {str(k): list(interval(values[t][:, j])) for j, k in enumerate(ks)} for t in tasks},
            "average": {str(k): list(interval_of_task_means([values[t][:, j] for t in tasks]))
                        for j, k in enumerate(ks)},
        }
    return out


COMPARED = (("es", "base"), ("grpo", "base"), ("es", "grpo"), ("es_grpo", "grpo"), ("grpo_es", "es"),
            ("es_grpo", "grpo_es"))


def differences(iv: dict, ks: list[int]) -> list[dict]:
    """For each compared pair and k: both intervals of the average pass@k and whether they separate."""
    from es_ray.eval.bootstrap import separated

    out = []
    for a, b in COMPARED:
        if a in iv and b in iv:
            for k in ks:
                ia, ib = iv[a]["average"][str(k)], iv[b]["average"][str(k)]
                out.append({"a": a, "b": b, "k": k, "a_interval": ia, "b_interval": ib,
                            "separated": separated(tuple(ia), tuple(ib))})
    return out


def es_null(root: Path, stage: str, total: dict, thresholds) -> dict:
    """The null model's drift for an ES run (es_ray.eval.null_drift) from the run's own config.json and metrics:
    the drift its step sizes give whatever the rewards were."""
    from es_ray.eval.null_drift import null_drift

    run_cfg = _read_json(root / "stages" / stage / "config.json")
    es = run_cfg["es"]
    rows = _read_jsonl(root / "stages" / stage / "metrics.jsonl")
    zero = sum(1 for r in rows if r.get("es/zero_update"))
    return null_drift(lr=es["lr"], sigma=es["sigma"], population=es["population"], iterations=len(rows),
                      parameters=total["nonzero"], thresholds=thresholds, shaping=es["shaping"],
                      optimizer=es["optimizer"], estimator=es["estimator"], weight_decay=es["weight_decay"],
                      anchor_decay=es["anchor_decay"], zero_steps=zero)


def collect(root: Path, cfg, plan: dict, pool: int) -> dict:
    """The first seed's full report (tables and plots), plus mean +- std over every seed, bootstrap intervals over
    problems (seeds pooled) and the differences those intervals support. ``plan``: {method: {seed: stages}}."""
    seeds = list(cfg.seeds)
    per_seed = {s: collect_seed(root, cfg, {m: plan[m][s] for m in plan}, pool) for s in seeds}
    rep = per_seed[seeds[0]]
    rep["seeds"] = seeds
    rep["across_seeds"] = across_seeds(per_seed, rep["k"])
    rep["intervals"] = intervals(root, cfg, plan)
    rep["differences"] = differences(rep["intervals"], rep["k"])
    return rep


def _stage(stages: list, kind: str):
    return next((s for s in stages if s.kind == kind), None)


def collect_seed(root: Path, cfg, plan: dict, pool: int) -> dict:
    """One seed's report: ``plan`` is {method: stages of that seed}."""
    ks = [int(k) for k in cfg.eval.k]
    methods, tasks = {}, list(cfg.eval.tasks)
    drift_l2 = {}
    for method, stages in plan.items():
        parts = [(s.name, "es" if s.kind == "train_es" else "grpo") for s in stages if s.kind.startswith("train")]
        eval_dir = root / "stages" / _stage(stages, "eval").name
        ev = _read_json(eval_dir / "results.json")
        if ev is None:
            raise FileNotFoundError(f"{eval_dir / 'results.json'} is missing")
        dr = _read_json(root / "stages" / _stage(stages, "drift").name / "drift.json") if parts else None
        per_task = {t: {str(k): ev["tasks"][t]["pass@k"].get(str(k)) for k in ks} for t in tasks}
        average = {str(k): float(np.mean([per_task[t][str(k)] for t in tasks])) for k in ks}
        ent = ev.get("entropy") or {}
        entry = {
            "label": LABELS[method], "pass@k": per_task, "average": average,
            "entropy": {"mean_per_token": ent.get("mean_per_token"),
                        "per_task": {t: (ev["tasks"][t].get("entropy") or {}).get("mean_per_token") for t in tasks},
                        "histogram": ent.get("histogram")},
            "mean_reward": {t: ev["tasks"][t]["mean_reward"] for t in tasks},
            "ledger": method_ledger(cfg, root, parts),
            "reward_curve": reward_curve(root, parts, pool, cfg),
            "held_out_curve": held_out_curve(root, parts, pool, cfg),
            "checkpoint": ev["model_dir"],
        }
        if dr is not None:
            tot = dr["total"]
            entry["drift"] = {"l2": tot["l2"], "relative_l2": tot["relative_l2"],
                              "share_nonzero": tot["share_nonzero"], "share_below": tot["share_below"],
                              "max_abs": tot["max_abs"],
                              "by_module_type": {k: {"l2": v["l2"], "relative_l2": v["relative_l2"]}
                                                 for k, v in dr["by_module_type"].items()},
                              "histogram_log10": tot.get("histogram_log10"), "histogram_edges": dr["histogram_edges"]}
            if dr.get("cast"):  # what a GPU engine would hold: updates below bf16's resolution vanish there
                ct = dr["cast"]["total"]
                entry["drift"]["cast"] = {"dtype": dr["cast"]["dtype"], "l2": ct["l2"],
                                          "relative_l2": ct["relative_l2"], "share_nonzero": ct["share_nonzero"],
                                          "share_below": ct["share_below"], "max_abs": ct["max_abs"]}
            if [kind for _, kind in parts] == ["es"]:
                entry["drift"]["null"] = es_null(root, parts[0][0], tot, cfg.drift_thresholds)
            drift_l2[method] = tot["l2"]
        samples = _read_jsonl(eval_dir / "samples.jsonl")
        entry["passk_curve"] = passk_curves(samples, int(cfg.eval.n)) if samples else {}
        methods[method] = entry
    ratio = (drift_l2["es"] / drift_l2["grpo"]) if drift_l2.get("grpo") and "es" in drift_l2 else None
    base_entropy = methods.get("base", {}).get("entropy", {}).get("mean_per_token")
    return {
        "run_dir": str(root), "pool": pool, "budget_epochs": cfg.budget.epochs, "tasks": tasks, "k": ks,
        "budget": {"unit": cfg.budget.unit, "epochs": cfg.budget.epochs, "tokens": cfg.budget.tokens,
                   "device_seconds": cfg.budget.device_seconds},
        "eval": {"n": cfg.eval.n, "temperature": cfg.eval.temperature, "top_p": cfg.eval.top_p,
                 "max_new_tokens": cfg.eval.max_new_tokens, "limit": cfg.eval.limit, "seed": cfg.run.seed},
        "thresholds": list(cfg.drift_thresholds), "entropy_before": base_entropy,
        "drift_l2_ratio_es_over_grpo": ratio, "methods": methods,
    }


def _p(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"


def _f(x, fmt="{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _gib(b) -> str:
    return "-" if not b else f"{b / 2**30:.2f}"


def markdown(rep: dict) -> str:
    ks, tasks, methods = rep["k"], rep["tasks"], rep["methods"]
    e = rep["eval"]
    kk = "/".join(f"Pass@{k}" for k in ks)
    lines = ["# es-compare report", "",
             f"Training budget: {_budget(rep['budget'])} per method (unit {rep['budget']['unit']}; pool of "
             f"{rep['pool']} prompts; at most {rep['budget_epochs']:g} epochs; sequential methods: half each). "
             "Evaluation: "
             f"n = {e['n']} samples per problem, temperature {e['temperature']}, top_p {e['top_p']}, "
             f"max_new_tokens {e['max_new_tokens']}, limit {e['limit'] or 'none'}, seed {e['seed']}.", "",
             f"## {kk} (%)", "",
             "| method | " + " | ".join(tasks) + " | average |", "|---|" + "---|" * (len(tasks) + 1)]
    for m in methods.values():
        cells = [" / ".join(_p(m["pass@k"][t][str(k)]) for k in ks) for t in tasks]
        cells.append(" / ".join(_p(m["average"][str(k)]) for k in ks))
        lines.append(f"| {m['label']} | " + " | ".join(cells) + " |")
    lines += uncertainty_markdown(rep)
    lines += ["", "## Token entropy (nats per generated token, teacher-forced, of the sampled distribution at "
              f"T = {e['temperature']})", "",
              "| method | all tasks | change vs base | " + " | ".join(tasks) + " |",
              "|---|---|---|" + "---|" * len(tasks)]
    before = rep["entropy_before"]
    for m in methods.values():
        now = m["entropy"]["mean_per_token"]
        delta = "-" if before is None or now is None else f"{now - before:+.3f}"
        lines.append(f"| {m['label']} | {_f(now)} | {delta} | "
                     + " | ".join(_f(m["entropy"]["per_task"][t]) for t in tasks) + " |")
    th = rep["thresholds"]
    lines += ["", "## Drift from the base weights", "",
              "| method | L2 | relative L2 | changed | " + " | ".join(f"\\|d\\| < {t:g}" for t in th)
              + " | max \\|d\\| |",
              "|---|---|---|---|" + "---|" * len(th) + "---|"]
    for m in methods.values():
        d = m.get("drift")
        if d is None:
            continue
        lines.append(f"| {m['label']} | {d['l2']:.4g} | {_f(d['relative_l2'], '{:.3e}')} | "
                     f"{_p(d['share_nonzero'])}% | "
                     + " | ".join(f"{_p(d['share_below'][f'{t:g}'])}%" for t in th) + f" | {d['max_abs']:.3g} |")
        c = d.get("cast")
        if c is not None:
            lines.append(f"| {m['label']} (weights in {c['dtype']}) | {c['l2']:.4g} | {_f(c['relative_l2'], '{:.3e}')} "
                         f"| {_p(c['share_nonzero'])}% | "
                         + " | ".join(f"{_p(c['share_below'][f'{t:g}'])}%" for t in th) + f" | {c['max_abs']:.3g} |")
        null = d.get("null")
        if null is not None:
            if null["l2"] is None:
                lines.append(f"| {m['label']}: null model | - | - | - | " + " | ".join("-" for _ in th)
                             + f" | not applicable: {null['why']} |")
            else:
                lines.append(f"| {m['label']}: null model (rewards ignored) | {null['l2']:.4g} | - | - | "
                             + " | ".join(f"{_p(null['share_below'][f'{t:g}'])}%" for t in th) + " | - |")
    ratio = rep["drift_l2_ratio_es_over_grpo"]
    lines += ["", f"L2 ratio ES / GRPO: {_f(ratio, '{:.2f}')}. The thresholds columns are the share of changed "
              "parameters whose change is below each threshold (functional sparsity). Rows '(weights in bfloat16)' "
              "measure the same two checkpoints cast to the dtype a GPU engine holds: an update below half a ulp of "
              "its weight (|w| / 256 in bf16) vanishes there, so sparsity on fp32 weights can overstate what the "
              "engine sees.", "",
              "Null model: with z-scored (or ranked) fitness an SGD step of ES moves every weight by Normal(0, "
              "(lr / (N sigma))^2 sum z^2) whatever the rewards, so T steps are a random walk (es_ray/eval/null_drift.py). "
              "A measured L2 or sparsity share close to the null's is set by the step sizes, not by what ES learned.",
              ""] + null_verdict(methods, th) + ["",
              "## Compute ledger (measured)", "",
              f"Budget matched in {rep['budget']['unit']} ({_budget(rep['budget'])} per method).", "",
              "| method | tokens generated | tokens back-propagated | wall s | device-s | peak RSS per process GiB "
              "| peak GPU GiB | held-out pass@1 gained per 1000 device-s |", "|---|---|---|---|---|---|---|---|"]
    base_p1 = methods.get("base", {}).get("average", {}).get(str(ks[0]))
    for m in methods.values():
        led = m["ledger"]
        if led is None:
            continue
        gain = (None if base_p1 is None or not led["device_s"] else
                1000 * (m["average"][str(ks[0])] - base_p1) / led["device_s"])
        lines.append(f"| {m['label']} | {led['tokens_generated']:,} | {led['tokens_backpropagated']:,} | "
                     f"{led['wall_s']:.0f} | {led['device_s']:.0f} {led['device']} | "
                     f"{_gib(led['peak_rss_bytes_max'])} | {_gib(led['peak_gpu_bytes_max'])} | "
                     f"{_f(None if gain is None else 100 * gain, '{:+.2f}')} points |")
    lines += ["", compute_answer(methods)]
    lines += ["", "device-s: for every actor, the devices it held (GPUs, or CPU cores on a CPU-only actor) times the "
              "seconds it was held, summed (es_ray.runtime.ledger, the same code for every method). Peak memory: the "
              "largest peak resident set of any actor process of the run (and its peak GPU allocation).", "",
              "Plots: " + ", ".join(f"`{p}`" for p in rep.get("plots", [])), ""]
    lines += verdict_markdown(rep)
    return "\n".join(lines)


def _iv(x) -> str:
    return f"[{_p(x[0])}, {_p(x[1])}]"


def uncertainty_markdown(rep: dict) -> list[str]:
    """Mean +- std over seeds with the bootstrap interval, and the differences the intervals support."""
    ks, seeds, iv = rep["k"], rep["seeds"], rep["intervals"]
    lines = ["", f"## Uncertainty: average {'/'.join(f'Pass@{k}' for k in ks)} over tasks (%)", "",
             f"Mean +- std over seeds {seeds} (the first seed's run is the one the other tables show), and the 95% "
             "bootstrap interval over problems with the seeds pooled.", "",
             "| method | " + " | ".join(f"Pass@{k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]
    for method, m in rep["methods"].items():
        acr = rep["across_seeds"][method]["average"]
        cells = [f"{_p(acr[str(k)]['mean'])} +- {_p(acr[str(k)]['std'])} "
                 + (_iv(iv[method]["average"][str(k)]) if method in iv else "") for k in ks]
        lines.append(f"| {m['label']} | " + " | ".join(cells) + " |")
    if rep["differences"]:
        lines += ["", "Differences (called only when the two 95% intervals do not overlap):", "",
                  "| compared | k | first | second | verdict |", "|---|---|---|---|---|"]
        for d in rep["differences"]:
            a, b = LABELS[d["a"]], LABELS[d["b"]]
            verdict = {1: f"{a} higher", -1: f"{b} higher", 0: "not separable (intervals overlap)"}[d["separated"]]
            lines.append(f"| {a} vs {b} | {d['k']} | {_iv(d['a_interval'])} | {_iv(d['b_interval'])} | {verdict} |")
    return lines


def _difference(rep: dict, a: str, b: str, k: int) -> tuple[str, str]:
    """(numbers, verdict) of the interval comparison of methods a and b at pass@k."""
    d = next((x for x in rep["differences"] if x["a"] == a and x["b"] == b and x["k"] == k), None)
    if d is None:
        return "-", "not run"
    la, lb = LABELS[a], LABELS[b]
    nums = f"{la} {_iv(d['a_interval'])} vs {lb} {_iv(d['b_interval'])}"
    return nums, {1: f"{la} higher (intervals separate)", -1: f"{lb} higher (intervals separate)",
                  0: "no separable difference"}[d["separated"]]


def _spread(rep: dict, method: str, key: str) -> str:
    st = rep["across_seeds"].get(method, {}).get(key)
    if not st or st["mean"] is None:
        return "-"
    return f"{st['mean']:.3g} +- {st['std']:.2g} over {len(st['values'])} seed(s)"


def verdict_markdown(rep: dict) -> list[str]:
    """What this run shows of each effect the paper reports, with its numbers and whether the intervals separate."""
    ks, m = rep["k"], rep["methods"]
    small, large = ks[0], ks[-1]
    rows = []
    nums, verdict = _difference(rep, "es", "grpo", large)
    rows.append(("coverage at large k (paper: ES above GRPO at Pass@16/32)", f"Pass@{large}: {nums}", verdict))
    nums, verdict = _difference(rep, "es", "grpo", small)
    rows.append((f"Pass@{small} (paper: GRPO at or above ES)", f"Pass@{small}: {nums}", verdict))
    ent = {k: (m.get(k) or {}).get("entropy", {}).get("mean_per_token") for k in ("base", "es", "grpo")}
    if all(v is not None for v in ent.values()):
        e_es, e_grpo = ent["es"] - ent["base"], ent["grpo"] - ent["base"]
        sds = [rep["across_seeds"][k]["entropy"]["std"] for k in ("es", "grpo")]
        clear = len(rep["seeds"]) > 1 and abs(e_es - e_grpo) > 2 * max(sds)
        rows.append(("entropy (paper: GRPO collapses it, ES keeps it near the base)",
                     f"change vs base: ES {e_es:+.3f}, GRPO {e_grpo:+.3f} nats (ES {_spread(rep, 'es', 'entropy')}; "
                     f"GRPO {_spread(rep, 'grpo', 'entropy')})",
                     ("ES keeps more entropy than GRPO" if e_es > e_grpo else "GRPO keeps more entropy than ES")
                     + (" (gap above 2 std over seeds)" if clear else
                        " (not separable: one seed, or within 2 std over seeds)")))
    ratio = rep["drift_l2_ratio_es_over_grpo"]
    null = ((m.get("es") or {}).get("drift") or {}).get("null")
    rows.append(("L2 distance (paper: ES 40.7-44.1x GRPO)", f"ES / GRPO = {_f(ratio, '{:.1f}')}x; ES L2 "
                 f"{_spread(rep, 'es', 'drift_l2')}, null model {_f((null or {}).get('l2'), '{:.4g}')}",
                 "ES moves farther" if ratio and ratio > 1 else "ES does not move farther" if ratio else "-"))
    sparsity = null_verdict(m, rep["thresholds"])
    rows.append(("functional sparsity (paper: most ES updates tiny)", sparsity[0] if sparsity else "-",
                 "set by the step sizes (null model)" if sparsity and "alone give" in sparsity[0] else
                 "differs from the null model" if sparsity else "-"))
    nums, verdict = _difference(rep, "es_grpo", "grpo_es", large)
    rows.append(("sequential order (paper: ES->GRPO best at hard-math Pass@32)", f"Pass@{large}: {nums}", verdict))
    rows.append(("compute (left open by the paper)", compute_answer(m), "-"))
    lines = ["## Verdict: the paper's effects in this run", "",
             "| effect | this run | verdict |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    lines += ["", "A difference is called only where the 95% bootstrap intervals over problems separate (or, for "
              "entropy, the gap exceeds twice the spread over seeds); with one seed and few problems most gaps are "
              "within the noise, and the verdict says so.", ""]
    return lines


def _budget(b: dict) -> str:
    return {"epochs": f"{b['epochs']:g} epochs", "tokens": f"{b['tokens']:,} tokens",
            "device_seconds": f"{b['device_seconds']:g} device-s"}[b["unit"]]


def compute_answer(methods: dict) -> str:
    """The paper's open question for this run: does ES's lower memory also mean less compute?"""
    es, grpo = (methods.get(m, {}).get("ledger") for m in ("es", "grpo"))
    if not es or not grpo:
        return "Compute: run both es and grpo to compare their cost."
    mem = [(x["peak_gpu_bytes_max"] or x["peak_rss_bytes_max"]) for x in (es, grpo)]
    kind = "GPU" if es["peak_gpu_bytes_max"] and grpo["peak_gpu_bytes_max"] else "resident"
    mem_ratio = mem[1] / mem[0] if mem[0] else None
    dev_ratio = grpo["device_s"] / es["device_s"] if es["device_s"] else None
    tok_ratio = es["tokens_generated"] / grpo["tokens_generated"] if grpo["tokens_generated"] else None
    less_memory = mem_ratio is not None and mem_ratio > 1
    less_compute = dev_ratio is not None and dev_ratio > 1
    return (f"Compute (this run): GRPO's largest peak {kind} memory is {_f(mem_ratio, '{:.2f}')}x ES's; GRPO used "
            f"{_f(dev_ratio, '{:.2f}')}x ES's device-seconds while ES generated {_f(tok_ratio, '{:.2f}')}x GRPO's "
            "tokens. " + ("ES's lower memory came with less compute here." if less_memory and less_compute else
                          "ES's lower memory did not mean less compute here." if less_memory else
                          "ES did not use less memory here."))


def null_verdict(methods: dict, th) -> list[str]:
    """One line per ES run: does its drift exceed the null model's (10% on L2, 2 points on a sparsity share)?"""
    out = []
    for m in methods.values():
        null = (m.get("drift") or {}).get("null")
        if not null or null["l2"] is None:
            continue
        d = m["drift"]
        l2_ratio = d["l2"] / null["l2"] if null["l2"] else None
        gaps = [abs(d["share_below"][f"{t:g}"] - null["share_below"][f"{t:g}"]) for t in th
                if d["share_below"][f"{t:g}"] is not None and null["share_below"][f"{t:g}"] is not None]
        beyond = (l2_ratio is not None and abs(l2_ratio - 1) > 0.10) or any(g > 0.02 for g in gaps)
        out.append(f"{m['label']}: measured L2 / null L2 = {_f(l2_ratio, '{:.3f}')}, largest sparsity-share gap "
                   f"{_p(max(gaps) if gaps else None)} points: "
                   + ("the drift differs from what the step sizes alone give." if beyond else
                      "the drift and the sparsity are what the step sizes alone give (not evidence of learning)."))
    return out


def plots(rep: dict, root: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    methods = rep["methods"]
    for task in rep["tasks"]:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for m in methods.values():
            curve = m["passk_curve"].get(task)
            if curve:
                ax.plot(range(1, len(curve) + 1), [100 * v for v in curve], marker=".", label=m["label"])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k")
        ax.set_ylabel("pass@k (%)")
        ax.set_title(task)
        ax.legend(fontsize=8)
        out.append(_save(fig, root / f"passk_{task}.png"))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for m in methods.values():
        if m["reward_curve"]:
            xs, ys = zip(*m["reward_curve"])
            ax.plot(xs, ys, label=m["label"])
    ax.set_xlabel("epochs over the training pool")
    ax.set_ylabel("mean training reward")
    ax.legend(fontsize=8)
    out.append(_save(fig, root / "reward_curves.png"))
    if any(m["held_out_curve"] for m in methods.values()):
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
        for m in methods.values():
            if m["held_out_curve"]:
                xs, p1, ent = zip(*m["held_out_curve"])
                a1.plot(xs, p1, marker=".", label=m["label"])
                if all(e is not None for e in ent):
                    a2.plot(xs, ent, marker=".", label=m["label"])
        a1.set_xlabel("epochs over the training pool")
        a1.set_ylabel("held-out pass@1 (sampled)")
        a2.set_xlabel("epochs over the training pool")
        a2.set_ylabel("held-out token entropy (nats)")
        a1.legend(fontsize=8)
        out.append(_save(fig, root / "training_curves.png"))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for m in methods.values():
        h = m["entropy"]["histogram"]
        if h:
            edges, counts = np.asarray(h["edges"]), np.asarray(h["counts"], dtype=np.float64)
            if counts.sum() > 0:
                ax.plot((edges[:-1] + edges[1:]) / 2, counts / counts.sum(), label=m["label"])
    ax.set_xlabel("token entropy (nats)")
    ax.set_ylabel("share of generated tokens")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    out.append(_save(fig, root / "entropy.png"))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for m in methods.values():
        d = m.get("drift")
        if d and d.get("histogram_log10") and d.get("histogram_edges"):
            edges = np.asarray(d["histogram_edges"])
            ax.step((edges[:-1] + edges[1:]) / 2, d["histogram_log10"], where="mid", label=m["label"])
    for t in rep["thresholds"]:
        ax.axvline(math.log10(t), color="grey", lw=0.8, ls="--")
    ax.set_xlabel("log10 |delta| (changed parameters)")
    ax.set_ylabel("parameters")
    ax.legend(fontsize=8)
    out.append(_save(fig, root / "update_histograms.png"))
    return out


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


def write_report(root: Path, cfg, plan: dict, pool: int) -> dict:
    rep = collect(root, cfg, plan, pool)
    rep["plots"] = plots(rep, root)
    (root / "report.json").write_text(json.dumps(rep, indent=2))
    (root / "report.md").write_text(markdown(rep))
    return rep
