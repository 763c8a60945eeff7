"""es-compare's figures, from report.json's data, each as PNG and PDF (for a paper) side by side: pass@k per task
with the report's 95% intervals as bands, training reward (ES and GRPO apart: they measure different things; a panel
only for what ran), held-out pass@1 and entropy over training (the same scoring for every method), the entropy
distribution, update sizes. Every title is two lines at most: what the figure shows, then the model's name, the
training task, the seeds and the budget. Every value axis starts at a stated baseline (0), so a small change looks
small; every reference line is in the legend. ``figures`` builds them (tests read titles, labels and legends
there), ``plots`` writes them."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from es_ray.launch.compare.analyses import interpolation_figure

# matplotlib is imported where a figure is drawn: the report's text does without it.

EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
"""What an empty model.path (or es_ray.models.EMBEDDED_NAMES) trains: the embedded default model."""
_EMBEDDED_REFS = ("", "smollm2-135m", "embedded", "embedded default model")


def model_name(rep: dict) -> str:
    """The model's own name: the last part of a hub id or local directory, or the embedded model's."""
    ref = str(rep.get("model") or "")
    return EMBEDDED_MODEL if ref.strip().lower() in _EMBEDDED_REFS else Path(ref.rstrip("/")).name


def _budget(rep: dict) -> str:
    b = rep["budget"]
    return {
        "epochs": f"{b['epochs']:g} epochs",
        "tokens": f"{b['tokens']:,} tokens",
        "device_seconds": f"{b['device_seconds']:g} device-s",
    }[b["unit"]]


def title(rep: dict, what: str, first_seed: bool = False) -> str:
    """'<what>' then one line: model, training task, the seeds shown, the budget per method."""
    seeds = list(rep.get("seeds") or [])
    if first_seed and seeds:
        shown = f"seed {seeds[0]}"
    else:
        shown = f"mean of {len(seeds)} seeds" if len(seeds) > 1 else f"seed {seeds[0]}" if seeds else "seed ?"
    return (
        f"{what}\n{model_name(rep)} trained on {rep.get('train_task', '?')}, {shown}, budget {_budget(rep)} per method"
    )


def _from_zero(ax, values: list[float], scale: float = 1.0, floor: float = 0.05) -> None:
    """A value axis from 0 to a little above the largest value (at least ``floor``): a small change stays small."""
    top = max([scale * v for v in values if v is not None and math.isfinite(v)] or [0.0])
    low = min([scale * v for v in values if v is not None and math.isfinite(v)] or [0.0])
    ax.set_ylim(min(0.0, 1.1 * low), max(floor * scale, 1.1 * top))


def _counts_axis(axis) -> None:
    """Counts as 2.5M, not '1e7' above the axis."""
    from matplotlib.ticker import EngFormatter

    axis.set_major_formatter(EngFormatter(sep=""))


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


METHOD_STYLES = (
    {"marker": "o", "linestyle": "-"},
    {"marker": "s", "linestyle": "--"},
    {"marker": "^", "linestyle": ":"},
    {"marker": "D", "linestyle": "-."},
    {"marker": "v", "linestyle": (0, (5, 1, 1, 1))},
    {"marker": "P", "linestyle": (0, (1, 2))},
)
"""One marker and dash per method in the pass@k figure, so methods with equal curves stay visible."""


def passk_figure(plt, rep: dict, task: str):
    """pass@k for k = 1..n per method, the report's 95% bootstrap interval over problems as a band at its k."""
    fig, ax = plt.subplots(figsize=(7, 4.4))
    intervals = rep.get("intervals") or {}
    drawn = [(name, m) for name, m in rep["methods"].items() if m["passk_curve"].get(task)]
    for i, (name, m) in enumerate(drawn):
        curve = m["passk_curve"][task]
        # equal curves (every method at 0) would hide one another: each method its own marker and dash, larger
        # markers drawn first, and its points shifted a little in k (a log axis: a factor, centred on k)
        style = METHOD_STYLES[i % len(METHOD_STYLES)]
        shift = 2 ** (0.04 * (i - (len(drawn) - 1) / 2))
        ks = [k * shift for k in range(1, len(curve) + 1)]
        (line,) = ax.plot(
            ks,
            [100 * v for v in curve],
            label=m["label"],
            zorder=2 + i,
            markersize=8 - 1.5 * (i % 3),
            fillstyle="none" if i % 2 else "full",
            **style,
        )
        band = (intervals.get(name) or {}).get("tasks", {}).get(task) or {}
        ks = sorted(int(k) for k in band)
        if ks:
            ax.fill_between(
                ks,
                [100 * band[str(k)][0] for k in ks],
                [100 * band[str(k)][1] for k in ks],
                color=line.get_color(),
                alpha=0.2,
                lw=0,
                label=f"{m['label']}: 95% interval",
            )
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 100)
    ax.set_xlabel("k (samples per problem)")
    ax.set_ylabel("pass@k (%), axis from 0")
    ax.set_title(title(rep, f"{task}: pass@k (unbiased estimator, n = {rep['eval']['n']})"), fontsize=9)
    _legend(ax)
    return fig


REWARD_KINDS = {
    "es": "ES: mean reward of the perturbed members\n(training prompts, es_sampling)",
    "grpo": "GRPO: mean reward of the sampled groups\n(training prompts, grpo_sampling)",
}


def reward_figure(plt, rep: dict):
    """One panel per training kind that ran, never one axis for both: ES's reward is the mean over its perturbed
    members' completions (es_sampling, greedy by default), GRPO's the mean over its sampled groups
    (grpo_sampling): different measurements. None when nothing was trained."""
    kinds = [k for k in REWARD_KINDS if any(p[2] == k for m in rep["methods"].values() for p in m["reward_curve"])]
    if not kinds:
        return None
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds) + 0.5, 4.4), squeeze=False)
    for ax, kind in zip(axes.flat, kinds):
        ys_all = []
        for m in rep["methods"].values():
            pts = [(x, y) for x, y, k in m["reward_curve"] if k == kind]
            if pts:
                xs, ys = zip(*pts)
                ys_all += ys
                ax.plot(xs, ys, marker=".", label=m["label"])
        _from_zero(ax, ys_all)
        ax.set_title(REWARD_KINDS[kind], fontsize=9)
        ax.set_xlabel("epochs over the training pool")
        ax.set_ylabel("mean training reward, axis from 0")
        _legend(ax)
    what = "training reward" + (": not comparable across the two panels" if len(kinds) > 1 else "")
    fig.suptitle(title(rep, what, True), fontsize=9)
    return fig


def training_figure(plt, rep: dict):
    """Held-out pass@1 and (where measured) entropy over training; None without held-out curves."""
    curves = {m["label"]: m["held_out_curve"] for m in rep["methods"].values() if m["held_out_curve"]}
    if not curves:
        return None
    with_entropy = {k: c for k, c in curves.items() if all(p[2] is not None for p in c)}
    fig, axes = plt.subplots(1, 2 if with_entropy else 1, figsize=(11 if with_entropy else 6.5, 4.4), squeeze=False)
    a1 = axes.flat[0]
    p1s = []
    for label, c in curves.items():
        xs, p1, _ = zip(*c)
        p1s += p1
        a1.plot(xs, [100 * v for v in p1], marker=".", label=label)
    e = rep["eval"]
    _from_zero(a1, p1s, scale=100)
    a1.set_xlabel("epochs over the training pool (0: the base weights)")
    a1.set_ylabel(f"held-out pass@1 (%), T = {e['temperature']}, top_p {e['top_p']}")
    _legend(a1)
    if with_entropy:
        a2 = axes.flat[1]
        ents = []
        for label, c in with_entropy.items():
            xs, _, ent = zip(*c)
            ents += ent
            a2.plot(xs, ent, marker=".", label=label)
        _from_zero(a2, ents)
        a2.set_xlabel("epochs over the training pool (0: the base weights)")
        a2.set_ylabel("held-out token entropy (nats), axis from 0")
        _legend(a2)
    fig.suptitle(title(rep, "held-out set over training, the same scoring for every method", True), fontsize=9)
    return fig


def entropy_figure(plt, rep: dict):
    """The per-token entropy distribution of the evaluation's samples: a step histogram (share of tokens per bin,
    empty bins at 0) on linear axes; None when no method has one."""
    fig, ax = plt.subplots(figsize=(7, 4.4))
    lo, hi = math.inf, -math.inf
    for m in rep["methods"].values():
        h = m["entropy"]["histogram"]
        if not h:
            continue
        edges, counts = np.asarray(h["edges"]), np.asarray(h["counts"], dtype=np.float64)
        if counts.sum() > 0:
            used = counts.nonzero()[0]
            lo, hi = min(lo, edges[used[0]]), max(hi, edges[used[-1] + 1])
            ax.stairs(counts / counts.sum(), edges, label=m["label"], lw=1.4)
    if not math.isfinite(lo):
        plt.close(fig)
        return None
    pad = 0.05 * (hi - lo) or 0.1  # the populated bins, not the histogram's whole fixed range
    ax.set_xlim(max(0.0, lo - pad), hi + pad)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("token entropy (nats) of the distribution sampled")
    ax.set_ylabel("share of generated tokens")
    ax.set_title(title(rep, "token entropy of the evaluation's samples", True), fontsize=9)
    _legend(ax)
    return fig


def update_figure(plt, rep: dict):
    """Counts of log10 |delta| of the changed parameters per trained method, the drift thresholds as labelled
    lines; None when no drift was measured."""
    drifted = [
        m
        for m in rep["methods"].values()
        if (m.get("drift") or {}).get("histogram_log10") and m["drift"].get("histogram_edges")
    ]
    if not drifted:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.4))
    marks = [math.log10(t) for t in rep["thresholds"]]
    lo, hi = min(marks, default=0.0), max(marks, default=0.0)
    for m in drifted:
        edges, counts = np.asarray(m["drift"]["histogram_edges"]), np.asarray(m["drift"]["histogram_log10"])
        ax.stairs(counts, edges, label=m["label"], lw=1.4)
        used = counts.nonzero()[0]
        if used.size:  # the populated bins (and the thresholds), not the histogram's whole fixed range
            lo, hi = min(lo, edges[used[0]]), max(hi, edges[used[-1] + 1])
    threshold_lines(ax, rep["thresholds"])
    ax.set_xlim(lo - 0.3, hi + 0.3)
    ax.set_ylim(bottom=0)
    _counts_axis(ax.yaxis)
    ax.set_xlabel("log10 |delta| (changed parameters)")
    ax.set_ylabel("parameters")
    ax.set_title(title(rep, "update sizes against the base weights", True), fontsize=9)
    _legend(ax)
    return fig


def threshold_lines(ax, thresholds) -> None:
    """The drift thresholds as dashed vertical lines at log10(t), each with its label for the legend."""
    styles = ("--", ":", "-.")
    for i, t in enumerate(thresholds):
        ax.axvline(math.log10(t), color="grey", lw=0.9, ls=styles[i % len(styles)], label=f"|delta| = {t:g}")


def figures(rep: dict) -> dict:
    """File stem -> matplotlib Figure, for every figure the report's data supports."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {f"passk_{task}": passk_figure(plt, rep, task) for task in rep["tasks"]}
    out.update(
        {
            "reward_curves": reward_figure(plt, rep),
            "training_curves": training_figure(plt, rep),
            "entropy": entropy_figure(plt, rep),
            "update_histograms": update_figure(plt, rep),
            "interpolation": interpolation_figure(plt, rep, title),
        }
    )
    return {k: v for k, v in out.items() if v is not None}


def plots(rep: dict, root: Path) -> list[str]:
    """Write every figure as <stem>.png and <stem>.pdf under ``root``; returns the PNG names."""
    return [save(fig, Path(root) / f"{stem}.png") for stem, fig in figures(rep).items()]


def save(fig, path: Path) -> str:
    """``path`` (PNG) and the same figure as PDF beside it; closes the figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=150)
    fig.savefig(path.with_suffix(".pdf"))
    plt.close(fig)
    return path.name
