"""es-compare's report data: report.json (per method and seed: pass@k, entropy, drift with its null model and
bf16 view, the measured ledger and the budget as reached, curves; across seeds: means, mean +- std, descriptive
bootstrap intervals, the primary family's verdict (launch.compare.verdict) and, exploratory, the paired
differences of every pair of methods, es_ray.metrics.paired), written with report.md (launch.compare.markdown) and the
plots (launch.compare.plots), from the stages' own output files.

Everything here is read back from disk (results.json and samples.jsonl of each evaluation, metrics.jsonl and
ledger.json of each training run, drift.json of each drift stage), so a report can be rebuilt at any time from a
comparison directory without running anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from es_ray.metrics.bootstrap import interval, interval_of_task_means
from es_ray.metrics.null_drift import null_drift, null_drift_from_log
from es_ray.metrics.passk import pass_at_k
from es_ray.held_out import BASE_POINT
from es_ray.runtime.names import ES_ZERO_UPDATE, HELD_OUT_ENTROPY, HELD_OUT_PASS1, REWARD_MEAN
from es_ray.launch.compare.analyses import forgetting_section, interpolation_section, kl_section, objectives
from es_ray.launch.compare.markdown import markdown
from es_ray.launch.compare.methods import COMPARED, LABELS, grpo_placement_text, runs_grpo
from es_ray.launch.compare.sensitivity import step_sizes
from es_ray.launch.compare.plots import plots
from es_ray.launch.compare.verdict import primary_section
from es_ray.launch.compare.truncation import truncated_share

# es_ray.metrics.paired (scipy) is imported where a test is computed: the report's other sections need no scipy.


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
    return {
        task: [float(np.mean([pass_at_k(n, c, k) for c in per.values()])) for k in range(1, n + 1)]
        for task, per in correct.items()
    }


def method_ledger(cfg, root: Path, parts: list[tuple[str, str]]) -> dict | None:
    """Sum of the measured ledgers of a method's training runs ([(stage name, es|grpo)]); peaks are maxima.
    ``device_s`` counts the training steps only; start-up, checkpoint writes and held-out scoring are apart."""
    if not parts:
        return None
    out = {
        "tokens_generated": 0,
        "tokens_backpropagated": 0,
        "wall_s": 0.0,
        "startup_s": 0.0,
        "device_s": 0.0,
        "device_s_held": 0.0,
        "device_s_apart": {},
        "device": None,
        "peak_rss_bytes_max": 0,
        "peak_gpu_bytes_max": None,
        "phase_seconds": {},
        "parts": [],
    }
    for stage, kind in parts:
        led = _read_json(root / "stages" / stage / "ledger.json")
        if led is None:
            raise FileNotFoundError(
                f"{root / 'stages' / stage / 'ledger.json'} is missing: the training stage "
                f"{stage} did not write its ledger; delete its done.json to run it again"
            )
        # measured by the runtime's ledger, the same way for every method (a ledger written before training
        # device-seconds were kept apart counts everything held)
        training = led.get("device_seconds_training", led["device_seconds"])
        out["tokens_generated"] += led["tokens_generated"]
        out["tokens_backpropagated"] += led["tokens_backpropagated"]
        out["wall_s"] += led["wall_s"]
        out["startup_s"] += led["startup_s"] or 0.0
        out["device_s"] += training
        out["device_s_held"] += led["device_seconds"]
        for k, v in (led.get("device_seconds_apart") or {}).items():
            out["device_s_apart"][k] = out["device_s_apart"].get(k, 0.0) + v
        out["device"] = led["device_kind"].upper()
        out["peak_rss_bytes_max"] = max(out["peak_rss_bytes_max"], led["peak_rss_bytes_max"] or 0)
        if led.get("peak_gpu_bytes_max"):
            out["peak_gpu_bytes_max"] = max(out["peak_gpu_bytes_max"] or 0, led["peak_gpu_bytes_max"])
        for phase, sec in led["phase_seconds"].items():
            out["phase_seconds"][phase] = out["phase_seconds"].get(phase, 0.0) + sec
        out["parts"].append(
            {
                "stage": stage,
                "method": kind,
                "steps": led["steps"],
                "wall_s": led["wall_s"],
                "tokens_generated": led["tokens_generated"],
                "device_s": training,
                "tokens_backpropagated": led["tokens_backpropagated"],
                "stop_reason": led.get("stop_reason"),
                "finished": led["finished"],
                "peak_rss_bytes_max": led["peak_rss_bytes_max"],
                "peak_gpu_bytes_max": led.get("peak_gpu_bytes_max"),
            }
        )
    return out


def budget_reached(cfg, ledger: dict | None, parts: int) -> dict | None:
    """The budget as each training part reached it: figure used, budget, ratio, matched within budget.tolerance,
    and whether the part stopped at its epoch cap (ran every step without the budget stopping it)."""
    b = cfg.budget
    if ledger is None or b.unit == "epochs":
        return None
    key = "tokens_generated" if b.unit == "tokens" else "device_s"
    budget = (b.tokens if b.unit == "tokens" else b.device_seconds) / parts
    rows = []
    for part in ledger["parts"]:
        used = part[key]
        ratio = used / budget if budget else None
        rows.append(
            {
                "stage": part["stage"],
                "used": used,
                "budget": budget,
                "ratio": ratio,
                "matched": ratio is not None and abs(ratio - 1) <= b.tolerance,
                "epoch_cap": part["finished"] and part["stop_reason"] == "",
            }
        )  # None: not recorded
    return {"unit": b.unit, "tolerance": b.tolerance, "parts": rows, "matched": all(r["matched"] for r in rows)}


def training_rows(
    root: Path, parts: list[tuple[str, str]], pool: int | dict[str, int], cfg
) -> list[tuple[float, dict, str]]:
    """(epochs seen, metrics row, es|grpo) per iteration/step of a method's training run(s), the parts of a
    sequential method (and the tasks of a sequence) end to end: read once, for both curves. ``pool``: the training
    pool, or per stage name (a sequence's tasks may differ in size)."""
    out, offset = [], 0.0
    for stage, kind in parts:
        size = pool[stage] if isinstance(pool, dict) else pool
        per_unit = cfg.es.prompts_per_iteration if kind == "es" else cfg.grpo.prompts_per_step
        rows = [r for r in _read_jsonl(root / "stages" / stage / "metrics.jsonl") if r.get(REWARD_MEAN) is not None]
        out += [(offset + (i + 1) * per_unit / size, r, kind) for i, r in enumerate(rows)]
        offset += len(rows) * per_unit / size
    return out


def reward_curve(rows: list[tuple[float, dict, str]]) -> list[tuple[float, float, str]]:
    """(epochs seen, mean training reward, es|grpo) per iteration/step: ES's is the mean over the population's
    perturbed members (es_sampling), GRPO's over its sampled groups (grpo_sampling): not the same measurement."""
    return [(x, float(r[REWARD_MEAN]), kind) for x, r, kind in rows]


def held_out_curve(rows: list[tuple[float, dict, str]], base: dict | None = None) -> list[tuple[float, float, float]]:
    """(epochs seen, held-out pass@1, held-out entropy) at each eval.every row, from the base weights' point (the
    first training run's held_out_base.json) on; the same scoring for every method."""
    first = [(0.0, float(base["pass_at_1"]), base.get("entropy"))] if base and base.get("pass_at_1") is not None else []
    return first + [
        (x, float(r[HELD_OUT_PASS1]), r.get(HELD_OUT_ENTROPY)) for x, r, _ in rows if r.get(HELD_OUT_PASS1) is not None
    ]


def across_seeds(per_seed: dict, ks: list[int]) -> dict:
    """Per method: mean and std over seeds of the average pass@k, the entropy and the drift L2."""
    out = {}
    for method in next(iter(per_seed.values()))["methods"]:
        entries = [rep["methods"][method] for rep in per_seed.values()]

        def stat(values):
            v = [x for x in values if x is not None]
            return {
                "mean": float(np.mean(v)) if v else None,
                "std": float(np.std(v, ddof=1)) if len(v) > 1 else 0.0,
                "values": values,
            }

        out[method] = {
            "average": {str(k): stat([e["average"][str(k)] for e in entries]) for k in ks},
            "entropy": stat([e["entropy"]["mean_per_token"] for e in entries]),
            "drift_l2": stat([(e.get("drift") or {}).get("l2") for e in entries]),
        }
    return out


def per_problem_counts(root: Path, cfg, plan: dict) -> dict:
    """The per-problem record report.json keeps, so that a report can be recomputed from it alone
    (launch.compare.rerender): per method, per seed (in cfg.seeds order), per task, on the problems every method and
    seed answered, the correct completions of eval.n and the entropy summed over the generated tokens with their
    count. {"n": eval.n, "problems": {task: ids}, "methods": {method: {task: {"correct": [[int] per problem] per
    seed, "entropy_sum": ..., "entropy_tokens": ...}}}}, from each evaluation's samples.jsonl; methods without it
    (eval.save_samples=false) are left out. Smaller than pass@k per k, and every pass@k derives from it exactly."""
    tasks = list(cfg.eval.tasks)
    raw: dict = {}
    for method, by_seed in plan.items():
        seeds = []
        for stages in by_seed.values():
            rows = _read_jsonl(root / "stages" / _stage(stages, "eval").name / "samples.jsonl")
            per: dict = {t: {} for t in tasks}
            for s in rows:
                c = per[s["task"]].setdefault(s["problem"], [0, 0.0, 0])
                c[0] += int(bool(s["correct"]))
                c[1] += float(s.get("entropy_sum") or 0.0)
                c[2] += int(s.get("entropy_tokens") or 0)
            seeds.append(per)
        if all(seed[t] for seed in seeds for t in tasks):  # else samples.jsonl not kept (eval.save_samples=false)
            raw[method] = seeds
    common = (
        {t: sorted(set.intersection(*[set(seed[t]) for seeds in raw.values() for seed in seeds])) for t in tasks}
        if raw
        else {t: [] for t in tasks}
    )
    return {
        "n": int(cfg.eval.n),
        "problems": common,
        "methods": {
            method: {
                t: {
                    key: [[seed[t][p][i] for p in common[t]] for seed in seeds]
                    for i, key in enumerate(("correct", "entropy_sum", "entropy_tokens"))
                }
                for t in tasks
            }
            for method, seeds in raw.items()
        },
    }


def scores(counts: dict, ks: list[int]) -> dict:
    """``per_problem_counts``'s record -> the per-problem scores the tests take: {"problems": {task: ids},
    "methods": {method: {"pass": {task: (seeds, problems, len(ks))}, "entropy": {task: (seeds, problems)}}}}
    (pass@k by the unbiased estimator; entropy: mean per generated token of a problem's samples, NaN where none was
    scored)."""
    n = int(counts["n"])
    table = np.array([[pass_at_k(n, c, k) for k in ks] for c in range(n + 1)]).reshape(n + 1, len(ks))
    out = {"problems": counts["problems"], "methods": {}}
    for method, by_task in counts["methods"].items():
        m = {"pass": {}, "entropy": {}}
        for t, c in by_task.items():
            correct = np.asarray(c["correct"], dtype=np.int64).reshape(len(c["correct"]), len(counts["problems"][t]))
            m["pass"][t] = table[correct]
            total = np.asarray(c["entropy_sum"], dtype=np.float64).reshape(correct.shape)
            tokens = np.asarray(c["entropy_tokens"], dtype=np.float64).reshape(correct.shape)
            with np.errstate(divide="ignore", invalid="ignore"):
                m["entropy"][t] = np.where(tokens > 0, total / np.where(tokens > 0, tokens, 1.0), np.nan)
        out["methods"][method] = m
    return out


def intervals(pp: dict, ks: list[int]) -> dict:
    """95% bootstrap intervals over problems of each method's pass@k (a problem's pass@k averaged over the seeds
    first), per task and for the average over tasks: descriptive; differences are tested paired (``comparisons``)."""

    out = {}
    for method, m in pp["methods"].items():
        values = {t: v.mean(axis=0) for t, v in m["pass"].items()}
        if not all(len(v) for v in values.values()):
            continue
        out[method] = {
            "tasks": {t: {str(k): list(interval(v[:, j])) for j, k in enumerate(ks)} for t, v in values.items()},
            "average": {
                str(k): list(interval_of_task_means([v[:, j] for v in values.values()])) for j, k in enumerate(ks)
            },
        }
    return out


ALPHA = 0.05


def method_pairs(methods: list[str]) -> list[tuple[str, str]]:
    """Every pair of the methods run, as (first, second) with difference first - second: the pairs the verdict
    reads first (COMPARED), then the rest in METHODS order (later minus earlier)."""
    pairs = [p for p in COMPARED if p[0] in methods and p[1] in methods]
    for i, x in enumerate(methods):
        for y in methods[i + 1 :]:
            if (x, y) not in pairs and (y, x) not in pairs:
                pairs.append((y, x))
    return pairs


def comparisons(pp: dict, ks: list[int], tasks: list[str]) -> dict:
    """Exploratory: every pair of methods at every k (average pass@k over tasks, tasks weighted equally) and on
    entropy, as paired differences over problems with each method's seeds as a random effect
    (es_ray.metrics.paired): estimates and intervals, with p and Holm's adjustment over this whole table kept in
    report.json for reference; the verdict is the primary family's (launch.compare.verdict)."""
    from es_ray.metrics.paired import holm, paired_difference_tasks

    methods = list(pp["methods"])
    if min((len(v) for v in pp["problems"].values()), default=0) < 2:
        return {
            "family": [],
            "tests": [],
            "why": "fewer than two problems answered by every method and seed of "
            "some task (or eval.save_samples=false): no paired test",
        }
    planned = []
    for x, y in method_pairs(methods):
        mx, my = pp["methods"][x], pp["methods"][y]
        for j, k in enumerate(ks):
            planned.append((x, y, f"pass@{k}", k, [(my["pass"][t][..., j], mx["pass"][t][..., j]) for t in tasks]))
        pairs = []
        for t in tasks:  # problems whose samples were scored in both methods and every seed
            ok = np.isfinite(mx["entropy"][t]).all(axis=0) & np.isfinite(my["entropy"][t]).all(axis=0)
            pairs.append((my["entropy"][t][:, ok], mx["entropy"][t][:, ok]))
        if all(a.shape[1] >= 2 for a, _ in pairs):
            planned.append((x, y, "entropy", None, pairs))
    if not planned:  # one method (methods=[es], say, or one left with samples.jsonl): there is no pair to test
        return {
            "family": [],
            "tests": [],
            "why": f"one method with samples of every task ({', '.join(methods)}; "
            "eval.save_samples=false leaves a method out): no pair to compare",
        }
    tests = [_test(x, y, metric, k, paired_difference_tasks(pairs)) for x, y, metric, k, pairs in planned]
    for t, adj in zip(tests, holm([t["p"] for t in tests])):
        t["p_holm"] = adj
    family = sorted({t["metric"] for t in tests}, key=lambda m: (m == "entropy", len(m), m))
    return {"family": family, "tests": tests, "alpha": ALPHA, "pairs": len(method_pairs(methods))}


def _test(x: str, y: str, metric: str, k, r) -> dict:
    return {
        "a": x,
        "b": y,
        "metric": metric,
        "k": k,
        "diff": r.diff,
        "low": r.low,
        "high": r.high,
        "p": r.p,
        "problems": r.problems,
        "seeds": r.seeds,
        "seeds_a": r.seeds_b,
        "seeds_b": r.seeds_a,
        "df": r.df if np.isfinite(r.df) else None,  # no variance at all: no finite df
        "se": r.se,
        "var_training": r.var_training,
    }


def drift_comparison(per_seed: dict) -> dict | None:
    """ES vs GRPO L2 drift over the seeds (one L2 per seed's run; Welch's t: the two methods' runs are independent)."""
    from es_ray.metrics.paired import welch

    l2 = {
        m: [(rep["methods"].get(m, {}).get("drift") or {}).get("l2") for rep in per_seed.values()]
        for m in ("es", "grpo")
    }
    if any(v is None for vals in l2.values() for v in vals) or not all(l2.values()):
        return None
    if len(l2["es"]) < 2:
        return {"seeds": 1, "why": "one seed: the seeds' spread is unknown, no test"}
    r = welch(np.array(l2["grpo"]), np.array(l2["es"]))  # the runs of ES and GRPO are independent, not paired
    return {
        "seeds": len(l2["es"]),
        "diff": r.diff,
        "low": r.low,
        "high": r.high,
        "p": r.p,
        "df": r.df if np.isfinite(r.df) else None,
    }


def es_null(root: Path, stage: str, total: dict, thresholds) -> dict:
    """The null model's drift for an ES run (es_ray.metrics.null_drift): from the shaped fitness its updates used
    (the run's seed_log.jsonl), so it holds for every shaping, ties included; from config.json's settings where the
    log is missing (a run written before it was kept)."""

    run_cfg = _read_json(root / "stages" / stage / "config.json")
    es = run_cfg["es"]
    log = _read_jsonl(root / "stages" / stage / "seed_log.jsonl")
    if log:
        return null_drift_from_log(
            log,
            parameters=total["nonzero"],
            thresholds=thresholds,
            optimizer=es["optimizer"],
            weight_decay=es["weight_decay"],
            anchor_decay=es["anchor_decay"],
        )
    rows = _read_jsonl(root / "stages" / stage / "metrics.jsonl")
    zero = sum(1 for r in rows if r.get(ES_ZERO_UPDATE))
    return null_drift(
        lr=es["lr"],
        sigma=es["sigma"],
        population=es["population"],
        iterations=len(rows),
        parameters=total["nonzero"],
        thresholds=thresholds,
        shaping=es["shaping"],
        optimizer=es["optimizer"],
        estimator=es["estimator"],
        weight_decay=es["weight_decay"],
        anchor_decay=es["anchor_decay"],
        zero_steps=zero,
    )


def collect(root: Path, cfg, plan: dict, pool: int, paths: dict | None = None) -> dict:
    """The report: point estimates averaged over the seeds (each seed's beside them), the first seed's details
    (drift histograms, curves, ledger), the paired tests of every pair of methods over problems and seeds, and the
    analyses beyond the paper's (launch.compare.analyses). ``plan``: {method: {seed: stages}}; ``paths``: {seed:
    es-interpolate stages}."""
    seeds = list(cfg.seeds)
    per_seed = {s: collect_seed(root, cfg, {m: plan[m][s] for m in plan}, pool) for s in seeds}
    rep = per_seed[seeds[0]]
    rep["seeds"] = seeds
    if runs_grpo(plan):
        rep["grpo_placement"] = grpo_placement_text(cfg)
    rep["across_seeds"] = across_seeds(per_seed, rep["k"])
    rep["per_seed"] = {
        str(s): {
            m: {
                "average": e["average"],
                "entropy": e["entropy"]["mean_per_token"],
                "drift_l2": (e.get("drift") or {}).get("l2"),
                "ledger": e["ledger"],
                "budget_reached": e["budget_reached"],
            }
            for m, e in r["methods"].items()
        }
        for s, r in per_seed.items()
    }
    for method, entry in rep["methods"].items():  # the tables' point estimates: means over the seeds
        entries = [r["methods"][method] for r in per_seed.values()]
        entry["pass@k"] = {
            t: {k: _mean([e["pass@k"][t][k] for e in entries]) for k in v} for t, v in entry["pass@k"].items()
        }
        entry["average"] = {k: _mean([e["average"][k] for e in entries]) for k in entry["average"]}
        entry["hit_max_new_tokens"] = _mean([e.get("hit_max_new_tokens") for e in entries])
        entry["passk_curve"] = {
            t: np.mean([e["passk_curve"][t] for e in entries], axis=0).tolist()
            for t in entry["passk_curve"]
            if all(t in e["passk_curve"] for e in entries)
        }
        for key in ("mean_per_token", "untruncated", "t1"):
            entry["entropy"][key] = _mean([e["entropy"][key] for e in entries])
        entry["entropy"]["per_task"] = {
            t: _mean([e["entropy"]["per_task"][t] for e in entries]) for t in entry["entropy"]["per_task"]
        }
    base = rep["methods"].get("base")
    rep["entropy_before"] = base["entropy"]["mean_per_token"] if base else None
    l2 = {m: rep["across_seeds"][m]["drift_l2"]["mean"] for m in ("es", "grpo") if m in rep["across_seeds"]}
    rep["drift_l2_ratio_es_over_grpo"] = l2["es"] / l2["grpo"] if l2.get("es") and l2.get("grpo") else None
    rep["step_sizes"] = step_sizes(cfg)  # stated beside the L2 ratio
    rep["per_problem"] = per_problem_counts(root, cfg, plan)  # so rerender recomputes every test from report.json
    tested(rep, cfg)
    rep["drift_test"] = drift_comparison(per_seed)
    final_eval = lambda stages: _stage(stages, "eval")  # noqa: E731
    rep["objectives"] = objectives(root, {m: plan[m][seeds[0]] for m in plan})
    rep["sequence"] = list(cfg.sequence)
    rep["kl"] = kl_section(root, cfg, plan, final_eval)
    rep["interpolation"] = interpolation_section(root, paths or {})
    rep["forgetting"] = forgetting_section(root, cfg, plan, final_eval)
    return rep


def tested(rep: dict, cfg) -> dict:
    """The report's tests from its per-problem record (rep["per_problem"]): the problem counts, the descriptive
    intervals, the exploratory comparisons and the primary family's verdict (``cfg``: its verdict, methods and
    eval.k), written into ``rep``; launch.compare.rerender calls it on a stored report.json."""
    pp = scores(rep["per_problem"], rep["k"])
    rep["problems"] = {t: len(v) for t, v in pp["problems"].items()}
    rep["intervals"] = intervals(pp, rep["k"])
    rep["comparisons"] = comparisons(pp, rep["k"], rep["tasks"])
    rep["verdict"] = primary_section(pp, cfg, rep["k"], rep["tasks"])
    return rep


def _mean(values):
    v = [x for x in values if x is not None]
    return float(np.mean(v)) if v else None


def _stage(stages: list, kind: str):
    return next((s for s in stages if s.kind == kind), None)


def collect_seed(root: Path, cfg, plan: dict, pool: int) -> dict:
    """One seed's report: ``plan`` is {method: stages of that seed}."""
    ks = [int(k) for k in cfg.eval.k]
    methods, tasks = {}, list(cfg.eval.tasks)
    drift_l2 = {}
    for method, stages in plan.items():
        parts = [(s.name, "es" if s.kind == "train_es" else "grpo") for s in stages if s.kind.startswith("train")]
        rows = training_rows(root, parts, {s.name: s.pool or pool for s in stages}, cfg)
        ledger = method_ledger(cfg, root, parts)
        eval_dir = root / "stages" / _stage(stages, "eval").name
        ev = _read_json(eval_dir / "results.json")
        if ev is None:
            raise FileNotFoundError(f"{eval_dir / 'results.json'} is missing")
        dr = _read_json(root / "stages" / _stage(stages, "drift").name / "drift.json") if parts else None
        per_task = {t: {str(k): ev["tasks"][t]["pass@k"].get(str(k)) for k in ks} for t in tasks}
        average = {str(k): float(np.mean([per_task[t][str(k)] for t in tasks])) for k in ks}
        ent = ev.get("entropy") or {}
        entry = {
            "label": LABELS[method],
            "pass@k": per_task,
            "average": average,
            "entropy": {
                "mean_per_token": ent.get("mean_per_token"),
                "per_task": {t: (ev["tasks"][t].get("entropy") or {}).get("mean_per_token") for t in tasks},
                "histogram": ent.get("histogram"),
                "untruncated": (ev.get("entropy_untruncated") or {}).get("mean_per_token"),
                "t1": (ev.get("entropy_t1") or {}).get("mean_per_token"),
            },
            "mean_reward": {t: ev["tasks"][t]["mean_reward"] for t in tasks},
            "ledger": ledger,
            # each task of a sequence gets the whole budget, split over the method's parts
            "budget_reached": budget_reached(cfg, ledger, max(1, len(parts) // max(1, len(cfg.sequence)))),
            "reward_curve": reward_curve(rows),
            "held_out_curve": held_out_curve(
                rows, _read_json(root / "stages" / parts[0][0] / BASE_POINT) if parts else None
            ),
            "checkpoint": ev["model_dir"],
        }
        if dr is not None:
            tot = dr["total"]
            entry["drift"] = {
                "l2": tot["l2"],
                "relative_l2": tot["relative_l2"],
                "share_nonzero": tot["share_nonzero"],
                "share_below": tot["share_below"],
                "max_abs": tot["max_abs"],
                "by_module_type": {
                    k: {"l2": v["l2"], "relative_l2": v["relative_l2"]} for k, v in dr["by_module_type"].items()
                },
                "histogram_log10": tot.get("histogram_log10"),
                "histogram_edges": dr["histogram_edges"],
            }
            if dr.get("cast"):  # what a GPU engine would hold: updates below bf16's resolution vanish there
                ct = dr["cast"]["total"]
                entry["drift"]["cast"] = {
                    "dtype": dr["cast"]["dtype"],
                    "l2": ct["l2"],
                    "relative_l2": ct["relative_l2"],
                    "share_nonzero": ct["share_nonzero"],
                    "share_below": ct["share_below"],
                    "max_abs": ct["max_abs"],
                }
            if [kind for _, kind in parts] == ["es"]:
                entry["drift"]["null"] = es_null(root, parts[0][0], tot, cfg.drift_thresholds)
            drift_l2[method] = tot["l2"]
        samples = _read_jsonl(eval_dir / "samples.jsonl")
        entry["passk_curve"] = passk_curves(samples, int(cfg.eval.n)) if samples else {}
        entry["hit_max_new_tokens"] = truncated_share(samples, int(cfg.eval.max_new_tokens))
        methods[method] = entry
    ratio = (drift_l2["es"] / drift_l2["grpo"]) if drift_l2.get("grpo") and "es" in drift_l2 else None
    base_entropy = methods.get("base", {}).get("entropy", {}).get("mean_per_token")
    return {
        "run_dir": str(root),
        "pool": pool,
        "budget_epochs": cfg.budget.epochs,
        "tasks": tasks,
        "k": ks,
        "model": cfg.model.path or "embedded default model",
        "train_task": cfg.task.name,
        "budget": {
            "unit": cfg.budget.unit,
            "epochs": cfg.budget.epochs,
            "tokens": cfg.budget.tokens,
            "device_seconds": cfg.budget.device_seconds,
            "tolerance": cfg.budget.tolerance,
        },
        "eval": {
            "n": cfg.eval.n,
            "temperature": cfg.eval.temperature,
            "top_p": cfg.eval.top_p,
            "max_new_tokens": cfg.eval.max_new_tokens,
            "limit": cfg.eval.limit,
            "seed": cfg.run.seed,
        },
        "thresholds": list(cfg.drift_thresholds),
        "entropy_before": base_entropy,
        "drift_l2_ratio_es_over_grpo": ratio,
        "methods": methods,
    }


def write_report(root: Path, cfg, plan: dict, pool: int, paths: dict | None = None) -> dict:
    rep = collect(root, cfg, plan, pool, paths)
    rep["plots"] = plots(rep, root)
    (root / "report.json").write_text(json.dumps(rep, indent=2))
    (root / "report.md").write_text(markdown(rep))
    return rep
