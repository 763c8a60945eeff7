"""es-compare's analyses beyond the paper's, read back from the stages' files like the rest of the report: the
objective each method trained with, the off-task KL to the base model (eval.kl_base), the paths between the methods'
solutions (interpolate.pairs) and forgetting across a task sequence (sequence=[...]); their report.md sections.

Intervals follow the report's paired test (es_ray.metrics.paired): a quantity measured against a fixed zero (a KL to
the base, a change of one run between two of its own checkpoints) is tested as its paired difference from zeros of
the same shape, which gives the crossed model's variance with the seeds as a random effect (docs/comparison.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from es_ray.launch.compare.methods import LABELS
from es_ray.metrics.passk import pass_at_k

# es_ray.metrics.paired (scipy, about 2 s) is imported by the sections that test pairs: the report's other parts, and
# es-compare's start, do without it.

KL_DIRECTIONS = ("base_tuned", "tuned_base")
"""KL(base || tuned) and KL(tuned || base), per token (es_ray.metrics.kl)."""


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def _p(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _interval(values_sp: np.ndarray) -> dict:
    """[S, P] per seed and problem -> the mean with its t interval over problems and seeds (seeds a random effect),
    tested against 0 (es_ray.metrics.paired: the paired difference from zeros of the same shape)."""
    from es_ray.metrics.paired import paired_difference

    if values_sp.shape[1] < 2:
        return {
            "mean": float(values_sp.mean()) if values_sp.size else None,
            "low": None,
            "high": None,
            "p": None,
            "problems": int(values_sp.shape[1]),
            "seeds": int(values_sp.shape[0]),
        }
    r = paired_difference(np.zeros_like(values_sp), values_sp)
    return {
        "mean": r.diff,
        "low": r.low,
        "high": r.high,
        "p": r.p,
        "problems": r.problems,
        "seeds": r.seeds_b,
        "df": r.df if np.isfinite(r.df) else None,
    }


# -- objectives ---------------------------------------------------------------------------------------------------


def objectives(root: Path, stages_by_method: dict) -> dict:
    """Per method: what each of its training runs maximised, from the run's own config.json (task.objective and k,
    and the samples per prompt it had: es.samples_per_prompt or grpo.group_size)."""
    out = {}
    for method, stages in stages_by_method.items():
        runs = []
        for s in stages:
            if not s.kind.startswith("train"):
                continue
            run_cfg = _read(s.dir(root) / "config.json") or {}
            task = run_cfg.get("task") or {}
            part = "es" if s.kind == "train_es" else "grpo"
            samples = (
                (run_cfg.get("es") or {}).get("samples_per_prompt")
                if part == "es"
                else (run_cfg.get("grpo") or {}).get("group_size")
            )
            runs.append(
                {
                    "stage": s.name,
                    "part": part,
                    "task": task.get("name", s.task),
                    "objective": task.get("objective", "mean"),
                    "k": task.get("objective_k"),
                    "samples_per_prompt": samples,
                }
            )
        out[method] = runs
    return out


def objective_text(run: dict) -> str:
    what = f"pass@{run['k']}" if run["objective"] == "pass_at_k" else "mean reward"
    per = "samples per prompt" if run["part"] == "es" else "group size"
    return f"{LABELS.get(run['part'], run['part'])}: {what} on {run['task']} ({per} {run['samples_per_prompt']})"


def objectives_markdown(rep: dict) -> list[str]:
    obj = rep.get("objectives") or {}
    rows = [
        (rep["methods"][m]["label"], "; ".join(objective_text(r) for r in runs))
        for m, runs in obj.items()
        if runs and m in rep["methods"]
    ]
    if not rows:
        return []
    return [
        "",
        "## Training objective (task.objective, from each training run's config.json)",
        "",
        "| method | what each training run maximised |",
        "|---|---|",
    ] + [f"| {a} | {b} |" for a, b in rows]


# -- off-task KL ----------------------------------------------------------------------------------------------------


def _kl_problems(results: dict, task: str, direction: str) -> dict[str, float]:
    per = (results["tasks"][task].get("kl") or {}).get("per_problem") or {}
    return {p: v[direction] for p, v in per.items() if v.get(direction) is not None}


def kl_section(root: Path, cfg, plan: dict, eval_stage) -> dict | None:
    """With eval.kl_base: per method, task and direction the per-token KL to the reference (mean over seeds, with
    its interval over problems and seeds), and every pair of trained methods' paired difference of the KL averaged
    over the tasks, Holm-corrected over that family. ``eval_stage(stages)``: a method's final evaluation stage."""
    from es_ray.metrics.paired import holm, paired_difference_tasks

    if not cfg.eval.kl_base:
        return None
    tasks = list(cfg.eval.tasks)
    per: dict = {}  # method -> task -> direction -> ([S, P] array, problem ids)
    for method, by_seed in plan.items():
        res = [_read(eval_stage(stages).dir(root) / "results.json") for stages in by_seed.values()]
        if any(r is None or not all(r["tasks"][t].get("kl") for t in tasks) for r in res):
            continue
        per[method] = {}
        for t in tasks:
            per[method][t] = {}
            for d in KL_DIRECTIONS:
                seeds = [_kl_problems(r, t, d) for r in res]
                common = sorted(set.intersection(*[set(s) for s in seeds]), key=int)
                per[method][t][d] = (np.array([[s[p] for p in common] for s in seeds]).reshape(len(seeds), -1), common)
    table = {m: {t: {d: _interval(per[m][t][d][0]) for d in KL_DIRECTIONS} for t in tasks} for m in per}
    trained = [m for m in per if m != "base"]
    tests = []
    for i, a in enumerate(trained):
        for b in trained[i + 1 :]:
            for d in KL_DIRECTIONS:
                pairs = []
                for t in tasks:  # the problems both methods' every seed scored
                    (xa, ia), (xb, ib) = per[a][t][d], per[b][t][d]
                    both = sorted(set(ia) & set(ib), key=int)
                    pairs.append((xb[:, [ib.index(p) for p in both]], xa[:, [ia.index(p) for p in both]]))
                if min(x.shape[1] for x, _ in pairs) < 2:
                    continue
                r = paired_difference_tasks(pairs)
                tests.append(
                    {
                        "a": a,
                        "b": b,
                        "direction": d,
                        "diff": r.diff,
                        "low": r.low,
                        "high": r.high,
                        "p": r.p,
                        "problems": r.problems,
                        "seeds_a": r.seeds_b,
                        "seeds_b": r.seeds_a,
                    }
                )
    for t, adj in zip(tests, holm([t["p"] for t in tests])):
        t["p_holm"] = adj
    return {
        "reference": cfg.eval.kl_reference or "the embedded base model",
        "samples": cfg.eval.kl_samples,
        "temperature": cfg.eval.temperature,
        "top_p": cfg.eval.top_p,
        "methods": table,
        "tests": tests,
    }


def _nats(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def kl_markdown(rep: dict) -> list[str]:
    kl = rep.get("kl")
    if not kl:
        return []
    tasks = rep["tasks"]
    lines = [
        "",
        f"## Off-task KL to the base model (nats per token; eval.kl_base, reference {kl['reference']})",
        "",
        f"Over {kl['samples']} of the reference's own samples per problem (T = {kl['temperature']}, top_p "
        f"{kl['top_p']}), both models teacher-forced on the same tokens, summed over the whole vocabulary "
        "(es_ray/metrics/kl.py). Mean over the seeds [95% interval over problems and seeds, the seeds a random "
        "effect]; KL(base || tuned) first, then KL(tuned || base).",
        "",
        "| method | direction | " + " | ".join(tasks) + " |",
        "|---|---|" + "---|" * len(tasks),
    ]
    for method, by_task in kl["methods"].items():
        for d in KL_DIRECTIONS:
            cells = []
            for t in tasks:
                c = by_task[t][d]
                cells.append(
                    _nats(c["mean"]) + ("" if c["low"] is None else f" [{_nats(c['low'])}, {_nats(c['high'])}]")
                )
            name = "KL(base \\|\\| tuned)" if d == "base_tuned" else "KL(tuned \\|\\| base)"
            lines.append(f"| {LABELS[method]} | {name} | " + " | ".join(cells) + " |")
    if kl["tests"]:
        lines += [
            "",
            "Paired differences of the KL averaged over the tasks (first minus second; Holm over these "
            f"{len(kl['tests'])} tests):",
            "",
            "| compared | direction | difference [95% interval] | p | Holm p |",
            "|---|---|---|---|---|",
        ]
        for t in kl["tests"]:
            lines.append(
                f"| {LABELS[t['a']]} - {LABELS[t['b']]} | {t['direction']} | {t['diff']:+.4g} "
                f"[{t['low']:+.4g}, {t['high']:+.4g}] | {t['p']:.2g} | {t['p_holm']:.2g} |"
            )
    return lines


# -- paths between solutions ----------------------------------------------------------------------------------------


def interpolation_section(root: Path, paths: dict) -> dict | None:
    """Per interpolate.pairs entry: every seed's es-interpolate results (curves, barriers with intervals, the update
    cosines) and the curves' mean over the seeds. ``paths``: {seed: [interpolation stages]}."""
    out: dict = {}
    for seed, stages in (paths or {}).items():
        for s in stages:
            res = _read(s.dir(root) / "interpolation.json")
            if res is None:
                raise FileNotFoundError(
                    f"{s.dir(root) / 'interpolation.json'} is missing: delete "
                    f"{s.dir(root) / 'done.json'} to run that stage again"
                )
            entry = out.setdefault(s.task, {"grid": res["grid"], "seeds": {}})
            entry["seeds"][str(seed)] = {
                "tasks": res["tasks"],
                "cosine": res["updates"]["cosine"],
                "by_module_type": res["updates"]["by_module_type"],
            }
    for entry in out.values():
        runs = list(entry["seeds"].values())
        entry["mean_curve"] = {
            t: {m: np.mean([r["tasks"][t][m]["curve"] for r in runs], axis=0).tolist() for m in metrics}
            for t, metrics in runs[0]["tasks"].items()
        }
    return out or None


def _pair_label(pair: str) -> str:
    a, b = pair.split("-")
    return f"{LABELS.get(a, a)} -> {LABELS.get(b, b)}"


def _cos(c) -> str:
    return "n/a (an update is zero)" if c is None else f"{c:.4f}"


def interpolation_markdown(rep: dict) -> list[str]:
    paths = rep.get("interpolation")
    if not paths:
        return []
    lines = [
        "",
        "## Paths between solutions (es-interpolate)",
        "",
        "theta(t) = (1 - t) theta_first + t theta_second, scored at each t as the evaluation scores (the same "
        "problems and sampling seeds, so t = 0 and t = 1 are the two end points' own scores). Barrier: the "
        "largest drop of the curve below the straight line between its end points, with its 95% bootstrap "
        "interval over problems (es_ray/metrics/interpolate.py). Cosine: between the two updates from the base "
        "weights (n/a where one end is the base). Plot: `interpolation.png`.",
        "",
    ]
    for pair, entry in paths.items():
        grid = entry["grid"]
        lines += [
            f"### {_pair_label(pair)}",
            "",
            "| seed | task | metric | " + " | ".join(f"t={t:g}" for t in grid) + " | barrier [95% interval] |",
            "|---|---|---|" + "---|" * len(grid) + "---|",
        ]
        for seed, run in entry["seeds"].items():
            for t, metrics in run["tasks"].items():
                for m, r in metrics.items():
                    lo, hi = r["barrier_interval"]
                    lines.append(
                        f"| {seed} | {t} | {m} | "
                        + " | ".join(f"{v:.3f}" for v in r["curve"])
                        + f" | {r['barrier']:.3f} [{lo:.3f}, {hi:.3f}] at t={r['barrier_at']:g} |"
                    )
        types = sorted({k for run in entry["seeds"].values() for k in run["by_module_type"]})
        lines += ["", "| seed | cosine of the updates | " + " | ".join(types) + " |", "|---|---|" + "---|" * len(types)]
        for seed, run in entry["seeds"].items():
            lines.append(
                f"| {seed} | {_cos(run['cosine'])} | "
                + " | ".join(_cos(run["by_module_type"].get(k)) for k in types)
                + " |"
            )
        lines.append("")
    return lines


def interpolation_figure(plt, rep: dict, title):
    """One panel per evaluation task: every path's mean curve over the seeds at the smallest and the largest k."""
    paths = rep.get("interpolation")
    if not paths:
        return None
    tasks = list(rep["tasks"])
    ks = rep["k"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks) + 0.5, 4.4), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        for pair, entry in paths.items():
            curves = entry["mean_curve"].get(task, {})
            for k, style in ((ks[0], "-"), (ks[-1], "--")):
                if f"pass@{k}" in curves:
                    ax.plot(
                        entry["grid"],
                        [100 * v for v in curves[f"pass@{k}"]],
                        style,
                        marker=".",
                        label=f"{_pair_label(pair)}: pass@{k}",
                    )
        ax.set_ylim(0, 100)
        ax.set_xlabel("t (0: the first end, 1: the second)")
        ax.set_ylabel("pass@k (%), axis from 0")
        ax.set_title(task, fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title(rep, "the straight paths between solutions (es-interpolate)"), fontsize=9)
    return fig


# -- forgetting across a task sequence ------------------------------------------------------------------------------


def _problem_passk(path: Path, task: str, n: int, ks: list[int]) -> dict[int, list[float]]:
    """{problem: [pass@k for k in ks]} of one task from an evaluation's samples.jsonl."""
    correct: dict[int, int] = {}
    for s in _rows(path):
        if s["task"] == task:
            correct[s["problem"]] = correct.get(s["problem"], 0) + int(bool(s["correct"]))
    return {p: [pass_at_k(n, c, k) for k in ks] for p, c in correct.items()}


def forgetting_section(root: Path, cfg, plan: dict, eval_stage) -> dict | None:
    """With sequence=[t1, ..., tn]: per trained method, the pass@k on every task t_j after each stage i >= j (mean
    over the seeds; the base's before any), and the change on each earlier task from just after it was trained to
    after the last stage, paired over problems and seeds (the same runs: seed s before and after), Holm-corrected
    over the family. Needs the evaluations' samples.jsonl (eval.save_samples)."""
    from es_ray.metrics.paired import holm

    seq = list(cfg.sequence)
    if not seq:
        return None
    n, ks = int(cfg.eval.n), [int(k) for k in cfg.eval.k]

    def scored(stages, after: int) -> Path:  # the evaluation that scored the weights after stage ``after``
        if after == len(seq) - 1:
            return eval_stage(stages).dir(root) / "samples.jsonl"
        d = next(s for s in stages if s.kind == "seq_eval" and s.task == seq[after])
        return d.dir(root) / "samples.jsonl"

    out: dict = {"sequence": seq, "k": ks, "methods": {}, "tests": []}
    if "base" in plan:
        before = {
            t: [_problem_passk(eval_stage(st).dir(root) / "samples.jsonl", t, n, ks) for st in plan["base"].values()]
            for t in seq
        }
        out["before"] = {t: _mean_over(v) for t, v in before.items()}
    for method, by_seed in plan.items():
        if method == "base":
            continue
        table, arrays = {}, {}
        for j, task in enumerate(seq):
            table[task] = {}
            for i in range(j, len(seq)):
                per_seed = [_problem_passk(scored(stages, i), task, n, ks) for stages in by_seed.values()]
                table[task][seq[i]] = _mean_over(per_seed)
                arrays[(task, i)] = per_seed
        out["methods"][method] = table
        for j, task in enumerate(seq[:-1]):
            first, last = arrays[(task, j)], arrays[(task, len(seq) - 1)]
            common = sorted(set.intersection(*[set(x) for x in first + last]))
            for q, k in enumerate(ks):
                d = np.array([[b[p][q] - a[p][q] for p in common] for a, b in zip(first, last)]).reshape(len(first), -1)
                out["tests"].append({"method": method, "task": task, "k": k, **_interval(d)})
    ps = [t["p"] for t in out["tests"] if t["p"] is not None]
    for t, adj in zip([t for t in out["tests"] if t["p"] is not None], holm(ps) if ps else []):
        t["p_holm"] = adj
    return out


def _mean_over(per_seed: list[dict[int, list[float]]]) -> list[float | None]:
    """Each seed's mean pass@k over its problems, then the mean over the seeds (one value per k)."""
    seeds = [np.mean(list(x.values()), axis=0) for x in per_seed if x]
    return np.mean(seeds, axis=0).tolist() if seeds else []


def forgetting_markdown(rep: dict) -> list[str]:
    f = rep.get("forgetting")
    if not f:
        return []
    seq, ks = f["sequence"], f["k"]
    kk = "/".join(f"Pass@{k}" for k in ks)
    lines = [
        "",
        f"## Task sequence: {' -> '.join(seq)} (forgetting)",
        "",
        f"{kk} (%) on each task of the sequence after each training stage (mean over the seeds; 'before': the "
        "base model). Each task's held-out problems are scored as the final evaluation scores them.",
        "",
        "| method | task | before | " + " | ".join(f"after {t}" for t in seq) + " |",
        "|---|---|---|" + "---|" * len(seq),
    ]
    before = f.get("before") or {}
    for method, table in f["methods"].items():
        for task in seq:
            cells = [" / ".join(_p(v) for v in table[task][t]) if t in table[task] else "-" for t in seq]
            b = " / ".join(_p(v) for v in before.get(task, [])) or "-"
            lines.append(f"| {LABELS[method]} | {task} | {b} | " + " | ".join(cells) + " |")
    if f["tests"]:
        lines += [
            "",
            f"Change on each earlier task from just after it was trained to after {seq[-1]} (negative: "
            "forgotten), paired over problems and seeds (each seed's run before and after; "
            "es_ray/metrics/paired.py), Holm-corrected over these tests:",
            "",
            "| method | task | k | change [95% interval] | p | Holm p |",
            "|---|---|---|---|---|---|",
        ]
        for t in f["tests"]:
            iv = "-" if t["low"] is None else f"[{100 * t['low']:+.1f}, {100 * t['high']:+.1f}]"
            p = "-" if t["p"] is None else f"{t['p']:.2g}"
            ph = "-" if t.get("p_holm") is None else f"{t['p_holm']:.2g}"
            mean = "-" if t["mean"] is None else f"{100 * t['mean']:+.1f} points"
            lines.append(f"| {LABELS[t['method']]} | {t['task']} | {t['k']} | {mean} {iv} | {p} | {ph} |")
    return lines
