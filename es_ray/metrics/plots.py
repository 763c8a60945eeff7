"""Plots (matplotlib, Agg backend: no display needed), written as PNG with a PDF beside it (for a paper)."""

from __future__ import annotations

import math
from pathlib import Path, PurePath

# matplotlib and numpy are imported by the plotting functions only: the metrics import fast without them.


def plot_update_histograms(report: dict, path: str | Path, title: str = "") -> Path:
    """``update_histogram_figure`` written to ``path`` (PNG) and the same name with .pdf."""
    fig = update_histogram_figure(report, title)  # selects the Agg backend before pyplot is imported
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=150)
    fig.savefig(path.with_suffix(".pdf"))
    plt.close(fig)
    return path


def shared_xlim(report: dict, types: list[str], edges) -> tuple[float, float] | None:
    """The x range every panel shows: the populated bins of all module types together, widened to the thresholds;
    None when no panel has a non-zero update."""
    import numpy as np

    lo = hi = None
    for kind in types:
        nonzero = np.asarray(report["by_module_type"][kind]["histogram_log10"]).nonzero()[0]
        if nonzero.size:
            a, b = edges[max(0, nonzero[0] - 2)], edges[min(len(edges) - 1, nonzero[-1] + 3)]
            lo, hi = (a, b) if lo is None else (min(lo, a), max(hi, b))
    if lo is None:
        return None
    marks = [math.log10(t) for t in report["thresholds"]]
    return float(min(lo, min(marks) - 0.2)), float(max(hi, max(marks) + 0.2))


def checkpoint_label(path: str, parts: int = 3) -> str:
    """A checkpoint's name for a figure: the last ``parts`` components of its path (run/checkpoints/final)."""
    tail = PurePath(str(path)).parts[-parts:]
    return str(PurePath(*tail)) if tail else str(path)


def update_histogram_figure(report: dict, title: str = ""):
    """One panel per module type: counts of log10 |delta| over the non-zero updates on a linear axis from 0 (counts
    as 2.5M, no '1e7' offset), each threshold a labelled line in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import EngFormatter

    edges = np.asarray(report["histogram_edges"])
    types = [k for k, v in report["by_module_type"].items() if "histogram_log10" in v]
    cols = min(3, max(1, len(types)))
    rows = max(1, math.ceil(len(types) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    xlim = shared_xlim(report, types, edges)
    for ax, kind in zip(axes.flat, types):
        rep = report["by_module_type"][kind]
        counts = np.asarray(rep["histogram_log10"])
        # one filled step outline, not a bar per bin: the same picture, one artist instead of ~100 per panel
        ax.stairs(counts, edges, fill=True, color="#4C72B0", label="parameters")
        for t, ls in zip(report["thresholds"], ("--", ":", "-.") * len(report["thresholds"])):
            ax.axvline(math.log10(t), color="#C44E52", lw=0.9, ls=ls, label=f"|delta| = {t:g}")
        if xlim is not None:  # one x range for every panel, so the module types compare by eye
            ax.set_xlim(*xlim)
        share = rep["share_below"].get(f"{report['thresholds'][1]:g}") if len(report["thresholds"]) > 1 else None
        sub = f"  ({share:.1%} < {report['thresholds'][1]:g})" if share is not None else ""
        ax.set_title(f"{kind}{sub}", fontsize=9)
        ax.set_xlabel("log10 |delta|", fontsize=8)
        ax.set_ylabel("parameters", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_formatter(EngFormatter(sep=""))
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(types) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    return fig
