"""es-compare's report data: report.json (per method and seed: pass@k, entropy, drift with its null model and
bf16 view, the measured ledger, curves; across seeds: mean +- std, bootstrap intervals, differences), written
with report.md (launch.compare_markdown) and the plots (launch.compare_plots), from the stages' own output files.

Everything here is read back from disk (results.json and samples.jsonl of each evaluation, metrics.jsonl and
ledger.json of each training run, drift.json of each drift stage), so a report can be rebuilt at any time from a
comparison directory without running anything.
"""

from __future__ import annotations

import json
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


def training_rows(root: Path, parts: list[tuple[str, str]], pool: int, cfg) -> list[tuple[float, dict]]:
    """(epochs seen, metrics row) per iteration/step of a method's training run(s), the parts of a sequential
    method end to end: read once, for both curves."""
    out, offset = [], 0.0
    for stage, kind in parts:
        per_unit = cfg.es.prompts_per_iteration if kind == "es" else cfg.grpo.prompts_per_step
        rows = [r for r in _read_jsonl(root / "stages" / stage / "metrics.jsonl") if r.get("reward/mean") is not None]
        out += [(offset + (i + 1) * per_unit / pool, r) for i, r in enumerate(rows)]
        offset += len(rows) * per_unit / pool
    return out


def reward_curve(rows: list[tuple[float, dict]]) -> list[tuple[float, float]]:
    """(epochs seen, mean training reward) per iteration/step."""
    return [(x, float(r["reward/mean"])) for x, r in rows]


def held_out_curve(rows: list[tuple[float, dict]]) -> list[tuple[float, float, float]]:
    """(epochs seen, held-out pass@1, held-out entropy) at each eval.every row."""
    return [(x, float(r["eval/pass_at_1"]), r.get("eval/entropy")) for x, r in rows
            if r.get("eval/pass_at_1") is not None]


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
        rows = training_rows(root, parts, pool, cfg)
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
            "reward_curve": reward_curve(rows),
            "held_out_curve": held_out_curve(rows),
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


def write_report(root: Path, cfg, plan: dict, pool: int) -> dict:
    rep = collect(root, cfg, plan, pool)
    from launch.compare_markdown import markdown
    from launch.compare_plots import plots

    rep["plots"] = plots(rep, root)
    (root / "report.json").write_text(json.dumps(rep, indent=2))
    (root / "report.md").write_text(markdown(rep))
    return rep
