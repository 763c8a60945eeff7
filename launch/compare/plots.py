"""es-compare's plots, from report.json's data: pass@k curves per task, training reward (ES and GRPO apart: they
measure different things), held-out pass@1 and entropy over training (the same scoring for every method), entropy
distributions, update histograms. Every title names the model, the training task, the seeds and the budget; every
axis is set from its data (percent from 0, entropy over the populated bins)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def _budget(rep: dict) -> str:
    b = rep["budget"]
    return {"epochs": f"{b['epochs']:g} epochs", "tokens": f"{b['tokens']:,} tokens",
            "device_seconds": f"{b['device_seconds']:g} device-s"}[b["unit"]]


def title(rep: dict, what: str, first_seed: bool = False) -> str:
    """'<what>' over two lines naming the model and the training task, then the seeds shown and the budget."""
    seeds = rep.get("seeds") or []
    shown = f"seed {seeds[0]}'s run" if first_seed and seeds else f"mean over seeds {seeds}"
    return (f"{what}\n{Path(str(rep.get('model', '?'))).name}, trained on {rep.get('train_task', '?')}\n"
            f"{shown}, budget {_budget(rep)} per method")


def _percent_axis(ax, values: list[float]) -> None:
    top = max([v for v in values if v is not None] or [0.0])
    ax.set_ylim(0, max(5.0, min(100.0, 100 * top * 1.1 + 1)))


def plots(rep: dict, root: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    methods = rep["methods"]
    for task in rep["tasks"]:
        fig, ax = plt.subplots(figsize=(6.5, 4.3))
        values = []
        for m in methods.values():
            curve = m["passk_curve"].get(task)
            if curve:
                values += curve
                ax.plot(range(1, len(curve) + 1), [100 * v for v in curve], marker=".", label=m["label"])
        ax.set_xscale("log", base=2)
        _percent_axis(ax, values)
        ax.set_xlabel("k (samples per problem)")
        ax.set_ylabel("pass@k (%)")
        ax.set_title(title(rep, f"{task}: pass@k (unbiased estimator)"), fontsize=9)
        ax.legend(fontsize=8)
        out.append(_save(fig, root / f"passk_{task}.png"))
    out.append(_reward_curves(plt, rep, root))
    if any(m["held_out_curve"] for m in methods.values()):
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.3))
        p1s = []
        for m in methods.values():
            if m["held_out_curve"]:
                xs, p1, ent = zip(*m["held_out_curve"])
                p1s += list(p1)
                a1.plot(xs, [100 * v for v in p1], marker=".", label=m["label"])
                if all(e is not None for e in ent):
                    a2.plot(xs, ent, marker=".", label=m["label"])
        e = rep["eval"]
        _percent_axis(a1, p1s)
        a1.set_xlabel("epochs over the training pool (0: the base weights)")
        a1.set_ylabel(f"held-out pass@1 (%), T = {e['temperature']}, top_p {e['top_p']}")
        a2.set_xlabel("epochs over the training pool (0: the base weights)")
        a2.set_ylabel("held-out token entropy (nats)")
        a1.legend(fontsize=8)
        fig.suptitle(title(rep, "training curves: held-out set, the same scoring for every method", True), fontsize=9)
        out.append(_save(fig, root / "training_curves.png"))
    out.append(_entropy(plt, rep, root))
    fig, ax = plt.subplots(figsize=(6.5, 4.3))
    marks = [math.log10(t) for t in rep["thresholds"]]
    lo, hi = min(marks, default=0.0), max(marks, default=0.0)
    for m in methods.values():
        d = m.get("drift")
        if d and d.get("histogram_log10") and d.get("histogram_edges"):
            edges, counts = np.asarray(d["histogram_edges"]), np.asarray(d["histogram_log10"])
            ax.step((edges[:-1] + edges[1:]) / 2, counts, where="mid", label=m["label"])
            used = counts.nonzero()[0]
            if used.size:  # the populated bins (and the thresholds), not the histogram's whole fixed range
                lo, hi = min(lo, edges[used[0]]), max(hi, edges[used[-1] + 1])
    for t in marks:
        ax.axvline(t, color="grey", lw=0.8, ls="--")
    ax.set_xlim(lo - 0.3, hi + 0.3)
    ax.set_xlabel("log10 |delta| (changed parameters)")
    ax.set_ylabel("parameters")
    ax.set_title(title(rep, "update sizes against the base weights", True), fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    out.append(_save(fig, root / "update_histograms.png"))
    return out


def _reward_curves(plt, rep: dict, root: Path) -> str:
    """Two panels, never one axis: ES's reward is the mean over its perturbed members' completions (es_sampling,
    greedy by default), GRPO's the mean over its sampled groups (grpo_sampling): different measurements."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3), sharey=False)
    what = {"es": "ES: mean reward of the perturbed members\n(training prompts, es_sampling)",
            "grpo": "GRPO: mean reward of the sampled groups\n(training prompts, grpo_sampling)"}
    for ax, kind in zip(axes, ("es", "grpo")):
        for m in rep["methods"].values():
            pts = [(x, y) for x, y, k in m["reward_curve"] if k == kind]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker=".", label=m["label"])
        ax.set_title(what[kind], fontsize=9)
        ax.set_xlabel("epochs over the training pool")
        ax.set_ylabel("mean training reward")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no run of this method", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(title(rep, "training reward: not comparable across the two panels", True), fontsize=9)
    return _save(fig, root / "reward_curves.png")


def _entropy(plt, rep: dict, root: Path) -> str:
    fig, ax = plt.subplots(figsize=(6.5, 4.3))
    lo, hi = math.inf, -math.inf
    for m in rep["methods"].values():
        h = m["entropy"]["histogram"]
        if h:
            edges, counts = np.asarray(h["edges"]), np.asarray(h["counts"], dtype=np.float64)
            if counts.sum() > 0:
                used = counts.nonzero()[0]
                lo, hi = min(lo, edges[used[0]]), max(hi, edges[used[-1] + 1])
                ax.plot((edges[:-1] + edges[1:]) / 2, counts / counts.sum(), marker=".", label=m["label"])
    if math.isfinite(lo):  # the populated bins, not the histogram's whole fixed range
        pad = 0.05 * (hi - lo) or 0.1
        ax.set_xlim(max(0.0, lo - pad), hi + pad)
        ax.legend(fontsize=8)
    ax.set_xlabel("token entropy (nats) of the distribution sampled")
    ax.set_ylabel("share of generated tokens")
    ax.set_yscale("log")
    ax.set_title(title(rep, "token entropy of the evaluation's samples", True), fontsize=9)
    return _save(fig, root / "entropy.png")


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name
