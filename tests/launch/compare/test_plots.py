"""The report's figures, rendered from a fixed report (tests/fixtures/compare_report.json: Base and ES run, GRPO
not, three seeds, the embedded model) and es-drift's histogram: two-line titles naming the model, task, seeds and
budget; pass@k bands from the report's intervals; panels only for what ran; value axes from 0; the entropy
histogram a step plot on a linear axis; every reference line in the legend; PDF beside PNG."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from es_ray.launch.compare.plots import figures, model_name, plots  # noqa: E402
from paths import FIXTURES  # noqa: E402

REPORT = FIXTURES / "compare_report.json"


@pytest.fixture
def rep():
    yield json.loads(REPORT.read_text())
    import matplotlib.pyplot as plt

    plt.close("all")


def _titles(fig) -> list[str]:
    out = [fig._suptitle.get_text()] if fig._suptitle is not None else []
    return out + [ax.get_title() for ax in fig.axes if ax.get_title()]


def _legend(ax) -> list[str]:
    leg = ax.get_legend()
    return [t.get_text() for t in leg.get_texts()] if leg is not None else []


def test_every_figure_has_a_two_line_title_naming_model_task_seeds_and_budget(rep):
    figs = figures(rep)
    assert set(figs) == {
        "passk_arithmetic",
        "passk_gsm8k",
        "reward_curves",
        "training_curves",
        "entropy",
        "update_histograms",
    }
    for name, fig in figs.items():
        main = _titles(fig)[0]
        assert main.count("\n") == 1, (name, main)  # at most two lines
        assert "SmolLM2-135M-Instruct trained on arithmetic" in main and "budget 1 epochs per method" in main, main
        assert "embedded default model" not in main
        assert ("mean of 3 seeds" if name.startswith("passk") else "seed 0") in main, (name, main)
        assert all(len(line) <= 100 for line in main.splitlines()), main
    assert model_name({"model": "Qwen/Qwen2.5-1.5B-Instruct"}) == "Qwen2.5-1.5B-Instruct"
    assert model_name({"model": "/mnt/models/llama-3b/"}) == "llama-3b"


def test_passk_has_the_reports_intervals_as_bands_on_an_axis_from_zero(rep):
    ax = figures(rep)["passk_arithmetic"].axes[0]
    assert _legend(ax) == ["Base", "Base: 95% interval", "ES", "ES: 95% interval"]
    assert ax.get_xlabel() == "k (samples per problem)" and ax.get_ylabel().startswith("pass@k (%)")
    assert ax.get_ylim() == (0.0, 100.0)
    band = ax.collections[1]  # ES's band: its lower and upper edges are the report's interval, in percent
    verts = band.get_paths()[0].vertices
    lo = rep["intervals"]["es"]["tasks"]["arithmetic"]
    for k in (1, 4, 8):
        ys = sorted(verts[np.isclose(verts[:, 0], k), 1])
        assert ys[0] == pytest.approx(100 * lo[str(k)][0]) and ys[-1] == pytest.approx(100 * lo[str(k)][1])


def test_reward_panels_only_for_methods_that_ran_with_axes_from_zero(rep):
    fig = figures(rep)["reward_curves"]
    assert len(fig.axes) == 1 and fig.axes[0].get_title().startswith("ES:")  # GRPO did not run: no empty panel
    ax = fig.axes[0]
    assert ax.get_ylim()[0] == 0.0 and "axis from 0" in ax.get_ylabel() and _legend(ax) == ["ES"]
    both = copy.deepcopy(rep)
    both["methods"]["grpo"] = {
        **copy.deepcopy(rep["methods"]["es"]),
        "label": "GRPO",
        "reward_curve": [[0.5 * i, 0.2 + 0.1 * i, "grpo"] for i in range(3)],
    }
    fig2 = figures(both)["reward_curves"]
    assert [a.get_title().split(":")[0] for a in fig2.axes] == ["ES", "GRPO"]
    assert "not comparable across the two panels" in fig2._suptitle.get_text()
    base_only = copy.deepcopy(rep)
    del base_only["methods"]["es"]
    assert not {"reward_curves", "training_curves", "update_histograms"} & set(figures(base_only))


def test_training_curves_start_at_zero(rep):
    fig = figures(rep)["training_curves"]
    p1, ent = fig.axes
    assert p1.get_ylim()[0] == 0.0 and p1.get_ylabel().startswith("held-out pass@1 (%)")
    assert ent.get_ylim()[0] == 0.0 and "entropy" in ent.get_ylabel()
    assert _legend(p1) == ["ES"] and _legend(ent) == ["ES"]


def test_entropy_is_a_step_histogram_on_a_linear_axis(rep):
    ax = figures(rep)["entropy"].axes[0]
    assert ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0.0
    assert not ax.lines and len(ax.patches) == 2  # stairs (a step outline per method), no line through bin centres
    assert _legend(ax) == ["Base", "ES"]
    assert ax.get_xlabel().startswith("token entropy (nats)") and ax.get_ylabel() == "share of generated tokens"


def test_update_histogram_labels_every_threshold_and_counts_without_offset(rep):
    fig = figures(rep)["update_histograms"]
    fig.canvas.draw()
    ax = fig.axes[0]
    assert _legend(ax) == ["ES", "|delta| = 0.001", "|delta| = 0.0015", "|delta| = 0.002"]
    assert ax.yaxis.get_offset_text().get_text() == ""  # no '1e7' above the axis
    assert any(t.get_text().endswith("M") for t in ax.get_yticklabels())


def test_pdf_is_written_beside_each_png(rep, tmp_path):
    names = plots(rep, tmp_path)
    assert names == [f"{stem}.png" for stem in figures(rep)]
    for name in names:
        png, pdf = tmp_path / name, (tmp_path / name).with_suffix(".pdf")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and pdf.read_bytes()[:5] == b"%PDF-"


def test_drift_histogram_labels_thresholds_and_writes_a_pdf(tmp_path):
    from es_ray.metrics.plots import plot_update_histograms, update_histogram_figure

    edges = np.linspace(-8, 0, 33)
    counts = np.zeros(32)
    counts[15:20] = [1e6, 2e7, 3e7, 1e7, 5e5]
    report = {
        "histogram_edges": edges.tolist(),
        "thresholds": [1e-3, 1.5e-3, 2e-3],
        "by_module_type": {"mlp": {"histogram_log10": counts.tolist(), "share_below": {"0.0015": 0.4}}},
    }
    fig = update_histogram_figure(report, "tuned vs base")
    fig.canvas.draw()
    ax = fig.axes[0]
    assert sorted(_legend(ax)) == ["parameters", "|delta| = 0.001", "|delta| = 0.0015", "|delta| = 0.002"]
    assert ax.yaxis.get_offset_text().get_text() == "" and ax.get_ylim()[0] == 0.0
    path = plot_update_histograms(report, tmp_path / "hist.png", title="tuned vs base")
    assert path.is_file() and path.with_suffix(".pdf").read_bytes()[:5] == b"%PDF-"


def test_passk_methods_with_equal_curves_all_stay_visible(rep):
    """All zeros (every completion cut at max_new_tokens): GRPO's line must not hide Base's and ES's."""
    rep = copy.deepcopy(rep)
    rep["methods"]["grpo"] = {**copy.deepcopy(rep["methods"]["es"]), "label": "GRPO"}
    for m in rep["methods"].values():
        m["passk_curve"]["arithmetic"] = [0.0] * len(m["passk_curve"]["arithmetic"])
    ax = figures(rep)["passk_arithmetic"].axes[0]
    lines = [line for line in ax.get_lines() if line.get_label() in ("Base", "ES", "GRPO")]
    assert len(lines) == 3
    assert len({(line.get_marker(), str(line.get_linestyle())) for line in lines}) == 3
    xs = [tuple(line.get_xdata()) for line in lines]
    assert len(set(xs)) == 3  # shifted apart in k
    for x in xs:  # each a little, never as far as the next k
        assert all(abs(a / k - 1) < 0.1 for a, k in zip(x, range(1, len(x) + 1)))


def test_drift_histogram_panels_share_one_x_range_and_name_the_checkpoints(tmp_path):
    from es_ray.metrics.plots import checkpoint_label, update_histogram_figure

    edges = np.linspace(-8, 0, 33)
    narrow, wide = np.zeros(32), np.zeros(32)
    narrow[18:20] = [5, 7]
    wide[4:24] = 3
    report = {
        "histogram_edges": edges.tolist(),
        "thresholds": [1e-3, 1.5e-3, 2e-3],
        "by_module_type": {
            "mlp": {"histogram_log10": narrow.tolist(), "share_below": {}},
            "attention": {"histogram_log10": wide.tolist(), "share_below": {}},
        },
    }
    fig = update_histogram_figure(report, "t")
    a, b = fig.axes[0].get_xlim(), fig.axes[1].get_xlim()
    assert a == b and a[0] <= edges[4] and a[1] >= edges[24]
    assert checkpoint_label("/runs/cmp/es/seed0/checkpoints/final") == "seed0/checkpoints/final"


def test_the_report_warns_when_most_completions_hit_max_new_tokens(rep):
    from es_ray.launch.compare.truncation import truncated_share, truncation_markdown

    assert truncated_share([{"tokens": 64}, {"tokens": 64}, {"tokens": 12}], 64) == pytest.approx(2 / 3)
    assert truncated_share([], 64) is None
    rep = copy.deepcopy(rep)
    for m in rep["methods"].values():
        m["hit_max_new_tokens"] = 0.1
    assert truncation_markdown(rep) == []
    rep["methods"]["es"]["hit_max_new_tokens"] = 1.0
    text = "\n".join(truncation_markdown(rep))
    assert (
        "most completions hit max_new_tokens" in text
        and "ES 100%" in text
        and "Base" not in text.split("most completions hit")[1].split("\n")[0]
        and "eval.max_new_tokens=" in text
    )
