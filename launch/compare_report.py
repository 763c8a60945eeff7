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


def collect(root: Path, cfg, plan: dict, pool: int) -> dict:
    ks = [int(k) for k in cfg.eval.k]
    methods, tasks = {}, list(cfg.eval.tasks)
    drift_l2 = {}
    for method, stages in plan.items():
        parts = [(s.name, "es" if s.kind == "train_es" else "grpo") for s in stages if s.kind.startswith("train")]
        ev = _read_json(root / "stages" / f"eval.{method}" / "results.json")
        if ev is None:
            raise FileNotFoundError(f"{root / 'stages' / f'eval.{method}' / 'results.json'} is missing")
        dr = _read_json(root / "stages" / f"drift.{method}" / "drift.json") if parts else None
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
            drift_l2[method] = tot["l2"]
        samples = _read_jsonl(root / "stages" / f"eval.{method}" / "samples.jsonl")
        entry["passk_curve"] = passk_curves(samples, int(cfg.eval.n)) if samples else {}
        methods[method] = entry
    ratio = (drift_l2["es"] / drift_l2["grpo"]) if drift_l2.get("grpo") and "es" in drift_l2 else None
    base_entropy = methods.get("base", {}).get("entropy", {}).get("mean_per_token")
    return {
        "run_dir": str(root), "pool": pool, "budget_epochs": cfg.budget.epochs, "tasks": tasks, "k": ks,
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
             f"Training budget: {rep['budget_epochs']:g} epochs over a pool of {rep['pool']} prompts per method "
             "(sequential methods: half each). Evaluation: "
             f"n = {e['n']} samples per problem, temperature {e['temperature']}, top_p {e['top_p']}, "
             f"max_new_tokens {e['max_new_tokens']}, limit {e['limit'] or 'none'}, seed {e['seed']}.", "",
             f"## {kk} (%)", "",
             "| method | " + " | ".join(tasks) + " | average |", "|---|" + "---|" * (len(tasks) + 1)]
    for m in methods.values():
        cells = [" / ".join(_p(m["pass@k"][t][str(k)]) for k in ks) for t in tasks]
        cells.append(" / ".join(_p(m["average"][str(k)]) for k in ks))
        lines.append(f"| {m['label']} | " + " | ".join(cells) + " |")
    lines += ["", "## Token entropy (nats per generated token, teacher-forced)", "",
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
    ratio = rep["drift_l2_ratio_es_over_grpo"]
    lines += ["", f"L2 ratio ES / GRPO: {_f(ratio, '{:.2f}')}. The thresholds columns are the share of changed "
              "parameters whose change is below each threshold (functional sparsity).", "",
              "## Compute ledger (measured)", "",
              "| method | tokens generated | tokens back-propagated | wall s | device-s | peak RSS per process GiB "
              "| peak GPU GiB |", "|---|---|---|---|---|---|---|"]
    for m in methods.values():
        led = m["ledger"]
        if led is None:
            continue
        lines.append(f"| {m['label']} | {led['tokens_generated']:,} | {led['tokens_backpropagated']:,} | "
                     f"{led['wall_s']:.0f} | {led['device_s']:.0f} {led['device']} | "
                     f"{_gib(led['peak_rss_bytes_max'])} | {_gib(led['peak_gpu_bytes_max'])} |")
    lines += ["", "device-s: for every actor, the devices it held (GPUs, or CPU cores on a CPU-only actor) times the "
              "seconds it was held, summed (es_ray.runtime.ledger, the same code for every method). Peak memory: the "
              "largest peak resident set of any actor process of the run (and its peak GPU allocation).", "",
              "Plots: " + ", ".join(f"`{p}`" for p in rep.get("plots", [])), ""]
    return "\n".join(lines)


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
