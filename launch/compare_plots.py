"""es-compare's plots, from report.json's data: pass@k curves per task, training reward, held-out pass@1 and
entropy over training, entropy distributions, update histograms."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


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
