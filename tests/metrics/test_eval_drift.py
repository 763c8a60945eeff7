"""Drift between checkpoints against hand-computed values, per module type; the histogram plot."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from es_ray.metrics.drift import drift, drift_state_dicts, module_type
from es_ray.metrics.plots import plot_update_histograms


@pytest.mark.parametrize(
    "name,kind",
    [
        ("model.embed_tokens.weight", "embedding"),
        ("lm_head.weight", "lm_head"),
        ("model.norm.weight", "norm"),
        ("model.layers.0.input_layernorm.weight", "norm"),
        ("model.layers.0.post_attention_layernorm.weight", "norm"),  # a norm, although it says attention
        ("model.layers.3.self_attn.q_norm.weight", "norm"),
        ("model.layers.0.self_attn.q_proj.weight", "attention"),
        ("model.layers.0.self_attn.o_proj.bias", "attention"),
        ("model.layers.0.mlp.gate_proj.weight", "mlp"),
        ("model.layers.0.mlp.down_proj.weight", "mlp"),
        ("transformer.wte.weight", "embedding"),
        ("transformer.h.0.attn.c_attn.weight", "attention"),
        ("transformer.h.0.mlp.c_fc.weight", "mlp"),
        ("transformer.ln_f.weight", "norm"),
        ("model.rotary_emb.inv_freq", "other"),
    ],
)
def test_module_type(name, kind):
    assert module_type(name) == kind


def _fixture():
    base = {
        "model.embed_tokens.weight": torch.zeros(4),
        "model.layers.0.self_attn.q_proj.weight": torch.tensor([[3.0, 4.0]]),
        "model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(3),
        "lm_head.weight": torch.zeros(1),
    }
    delta = {
        "model.embed_tokens.weight": torch.tensor([0.0, 0.0009, 0.0014, 0.0025]),
        "model.layers.0.self_attn.q_proj.weight": torch.tensor([[0.0, 0.0]]),
        "model.layers.0.mlp.up_proj.weight": torch.tensor([[-0.0019, 0.0005], [0.0, -0.003]]),
        "model.layers.0.post_attention_layernorm.weight": torch.zeros(3),
        "lm_head.weight": torch.tensor([0.01]),
    }
    return base, {k: base[k] + delta[k] for k in base}


def test_drift_hand_values_per_module_type():
    base, tuned = _fixture()
    rep = drift_state_dicts(base, tuned, top=2)
    emb, mlp = rep["by_module_type"]["embedding"], rep["by_module_type"]["mlp"]
    att, norm, head = (rep["by_module_type"][k] for k in ("attention", "norm", "lm_head"))
    assert (emb["numel"], emb["nonzero"]) == (4, 3)
    assert emb["l2"] == pytest.approx(math.sqrt(0.0009**2 + 0.0014**2 + 0.0025**2), rel=1e-5)
    assert emb["relative_l2"] is None  # the base tensor is all zeros
    assert emb["share_below"] == pytest.approx({"0.001": 1 / 3, "0.0015": 2 / 3, "0.002": 2 / 3})
    assert [(x["name"], x["index"]) for x in emb["largest"]] == [
        ("model.embed_tokens.weight", 3),
        ("model.embed_tokens.weight", 2),
    ]
    assert emb["largest"][0]["delta"] == pytest.approx(0.0025)
    assert mlp["share_below"] == pytest.approx({"0.001": 1 / 3, "0.0015": 1 / 3, "0.002": 2 / 3})
    assert mlp["largest"][0]["delta"] == pytest.approx(-0.003)  # signed value, ranked by magnitude
    assert (att["nonzero"], att["l2"], att["relative_l2"]) == (0, 0.0, 0.0)
    assert att["share_below"] == {"0.001": None, "0.0015": None, "0.002": None}  # no update to share out
    assert (norm["numel"], norm["nonzero"], norm["base_l2"]) == (3, 0, pytest.approx(math.sqrt(3)))
    assert head["max_abs"] == pytest.approx(0.01)
    total = rep["total"]
    assert (total["numel"], total["nonzero"], total["tensors"]) == (14, 7, 5)
    sq = 0.0009**2 + 0.0014**2 + 0.0025**2 + 0.0019**2 + 0.0005**2 + 0.003**2 + 0.01**2
    assert total["l2"] == pytest.approx(math.sqrt(sq), rel=1e-5)
    assert total["relative_l2"] == pytest.approx(math.sqrt(sq) / math.sqrt(25 + 3), rel=1e-5)
    assert total["share_below"] == pytest.approx({"0.001": 2 / 7, "0.0015": 3 / 7, "0.002": 4 / 7})
    assert total["share_nonzero"] == pytest.approx(7 / 14)
    assert total["largest"][0]["name"] == "lm_head.weight"
    assert sum(total["histogram_log10"]) == 7
    assert sum(emb["histogram_log10"]) == 3


def test_relative_l2():
    rep = drift([("model.layers.0.self_attn.q_proj.weight", torch.tensor([[3.0, 4.0]]), torch.tensor([[3.3, 4.4]]))])
    att = rep["by_module_type"]["attention"]
    assert att["l2"] == pytest.approx(0.5, rel=1e-5)
    assert att["relative_l2"] == pytest.approx(0.1, rel=1e-5)


def test_custom_thresholds_missing_names_and_shape_mismatch():
    base = {"a.mlp.w": torch.zeros(3), "b.norm.weight": torch.zeros(2), "only_base": torch.zeros(1)}
    tuned = {"a.mlp.w": torch.tensor([1e-5, 1e-4, 1e-2]), "b.norm.weight": torch.zeros(3), "only_tuned": torch.zeros(1)}
    rep = drift_state_dicts(base, tuned, thresholds=[1e-4, 1e-3])
    assert rep["by_module_type"]["mlp"]["share_below"] == pytest.approx({"0.0001": 1 / 3, "0.001": 2 / 3})
    assert rep["missing"] == {"base_only": ["only_base"], "tuned_only": ["only_tuned"]}
    assert rep["shape_mismatch"] == ["b.norm.weight"]


def test_drift_streams_bf16_and_fp32_alike():
    b = torch.randn(64, 64)
    t = b + 1e-3 * torch.randn(64, 64)
    r32 = drift([("x.mlp.w", b, t)])["total"]
    assert r32["nonzero"] > 0 and r32["l2"] == pytest.approx(float((t - b).norm()), rel=1e-5)


def test_cast_drift_drops_updates_below_the_engine_dtypes_resolution():
    """bf16 keeps 8 mantissa bits: on weights of magnitude ~1 an update of 1e-3 (< 2^-8 / 2) rounds away, one of
    1e-2 survives; the cast view reports what the engine holds, the fp32 view what the master holds."""
    base = torch.ones(1000)
    tuned = base.clone()
    tuned[:500] += 1e-3
    tuned[500:] += 1e-2
    rep = drift([("m.layers.0.mlp.w", base, tuned), ("m.norm.weight", base, base + 1e-3)], cast=torch.bfloat16)
    assert rep["total"]["nonzero"] == 2000 and rep["cast"]["dtype"] == "bfloat16"
    cast = rep["cast"]
    assert cast["total"]["nonzero"] == 500  # only the 1e-2 updates survive the cast
    assert cast["by_module_type"]["mlp"]["nonzero"] == 500 and cast["by_module_type"]["norm"]["nonzero"] == 0
    assert rep["total"]["share_below"]["0.0015"] == pytest.approx(1500 / 2000, abs=1e-3)
    assert cast["total"]["share_below"]["0.0015"] == 0.0  # no tiny update is left in bf16
    assert "cast" not in drift([("m.mlp.w", base, tuned)])


def test_histogram_plot_is_written(tmp_path):
    base, tuned = _fixture()
    rep = drift_state_dicts(base, tuned)
    path = plot_update_histograms(rep, tmp_path / "hist.png", title="test")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert np.asarray(rep["histogram_edges"]).size == 101
