"""es-interpolate (es_ray/evaluation/es_interpolate.py, es_ray/metrics/interpolate.py): the end points score what
es-eval gives each checkpoint, the barrier and its interval, the cosines against numpy, bad pairs refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from es_ray.metrics.interpolate import barrier, barrier_interval, mix, update_cosine


def test_mix_end_points_are_exact_and_the_middle_is_the_average():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 7, generator=g).bfloat16(), torch.randn(5, 7, generator=g)
    assert torch.equal(mix(a, b, 0.0), a.float()) and torch.equal(mix(a, b, 1.0), b)
    np.testing.assert_allclose(mix(a, b, 0.25).numpy(), 0.75 * a.float().numpy() + 0.25 * b.numpy(), rtol=1e-6)


def test_barrier_is_the_largest_drop_below_the_line():
    grid = [0.0, 0.25, 0.5, 0.75, 1.0]
    # line from 0.6 to 0.2: 0.6, 0.5, 0.4, 0.3, 0.2; the curve dips 0.3 below it at t = 0.5
    height, at = barrier([0.6, 0.45, 0.1, 0.3, 0.2], grid)
    assert height == pytest.approx(0.3) and at == 0.5
    assert barrier([0.2, 0.9, 0.4], [0.0, 0.5, 1.0]) == (0.0, None)  # above the line: no barrier, at no end point
    assert barrier([0.5, 0.5, 0.5], [0.0, 0.5, 1.0]) == (0.0, None)  # on the line: no drop
    assert barrier([0.9, 0.4, 0.1], [0.0, 0.5, 1.0]) == (pytest.approx(0.1), 0.5)  # a drop is at an interior t
    rng = np.random.default_rng(0)
    v_tp = np.clip(np.array([0.6, 0.45, 0.1, 0.3, 0.2])[:, None] + rng.normal(0, 0.2, size=(5, 40)), 0, 1)
    lo, hi = barrier_interval(v_tp, grid, draws=500, seed=1)
    point, _ = barrier(v_tp.mean(axis=1), grid)
    assert lo <= point <= hi and hi - lo > 0.01
    # by hand: the same problems resampled at every t
    idx = np.random.default_rng(1).integers(0, 40, size=(500, 40))
    by_hand = [barrier(v_tp[:, row].mean(axis=1), grid)[0] for row in idx]
    assert (lo, hi) == pytest.approx((np.quantile(by_hand, 0.025), np.quantile(by_hand, 0.975)))


def test_update_cosines_against_numpy():
    g = torch.Generator().manual_seed(2)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    base = {n: torch.randn(4, 3, generator=g) for n in names}
    a = {n: base[n] + torch.randn(4, 3, generator=g) for n in names}
    b = {n: base[n] + torch.randn(4, 3, generator=g) for n in names}
    b[names[2]] = base[names[2]].clone()  # b leaves the norm alone: no angle there
    out = update_cosine((n, base[n], a[n], b[n]) for n in names)

    def delta(x, n):
        return x[n].double().numpy().ravel() - base[n].double().numpy().ravel()

    da, db = np.concatenate([delta(a, n) for n in names]), np.concatenate([delta(b, n) for n in names])
    assert out["cosine"] == pytest.approx(da @ db / np.linalg.norm(da) / np.linalg.norm(db), rel=1e-12)
    x, y = delta(a, names[1]), delta(b, names[1])
    assert out["by_module_type"]["mlp"] == pytest.approx(x @ y / np.linalg.norm(x) / np.linalg.norm(y), rel=1e-12)
    assert out["by_module_type"]["norm"] is None and set(out["by_module_type"]) == {"attention", "mlp", "norm"}


def _perturbed(src: Path, dst: Path, scale: float, seed: int) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    w = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    save_file(
        {k: v + scale * torch.randn(v.shape, generator=g) for k, v in w.items()},
        str(dst / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return dst


TASK = "es_test_tasks:VowelTask"  # a dense reward the tiny random model scores above 0
EVAL = {"tasks": [TASK], "n": 2, "k": [1, 2], "limit": 3, "max_new_tokens": 6, "entropy": False, "temperature": 1.0}
ENGINE = {"dtype": "float32", "device": "cpu", "batch_size": 8}


def _eval_alone(model_dir: Path, run_dir: Path) -> dict:
    from es_ray.evaluation.config import to_eval_config
    from es_ray.evaluation.es_eval import run

    return run(
        to_eval_config(
            {
                "model": {"path": str(model_dir)},
                "eval": EVAL,
                "engine": ENGINE,
                "cluster": {"num_actors": 0},
                "run": {"dir": str(run_dir), "progress": False, "trackers": []},
            }
        )
    )


def test_end_points_score_what_es_eval_gives_each_checkpoint(tiny_model_dir, tmp_path):
    from es_ray.evaluation.config import to_interpolate_config
    from es_ray.evaluation.es_interpolate import run

    a = _perturbed(tiny_model_dir, tmp_path / "a", 0.05, 1)
    b = _perturbed(tiny_model_dir, tmp_path / "b", 0.05, 2)
    res = run(
        to_interpolate_config(
            {
                "a": str(a),
                "b": str(b),
                "base": str(tiny_model_dir),
                "grid": [0, 0.5, 1],
                "draws": 200,
                "eval": EVAL,
                "engine": ENGINE,
                "run": {"dir": str(tmp_path / "path"), "progress": False},
            }
        )
    )
    for end, model in ((0, a), (-1, b)):
        alone = _eval_alone(model, tmp_path / f"alone{end}")["tasks"][TASK]
        curves = res["tasks"][TASK]
        assert alone["mean_reward"] > 0
        assert curves["mean_reward"]["curve"][end] == pytest.approx(alone["mean_reward"], abs=1e-12)
        for k in (1, 2):
            assert curves[f"pass@{k}"]["curve"][end] == pytest.approx(alone["pass@k"][str(k)], abs=1e-12)
    r = res["tasks"][TASK]["mean_reward"]
    assert r["curve"][0] != r["curve"][-1]
    assert r["barrier"] >= 0 and r["barrier_interval"][0] <= r["barrier"] <= r["barrier_interval"][1]
    # two independent random updates of 10^4+ weights are nearly orthogonal
    assert abs(res["updates"]["cosine"]) < 0.05 and res["updates"]["by_module_type"]["mlp"] is not None
    saved = json.loads((tmp_path / "path" / "interpolation.json").read_text())
    assert saved["grid"] == [0, 0.5, 1] and "barrier" in (tmp_path / "path" / "interpolation.md").read_text()


def test_different_architectures_are_refused_in_one_line(tiny_model_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (other / "config.json").write_text(json.dumps(cfg))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "es_ray.evaluation.es_interpolate",
            f"a={tiny_model_dir}",
            f"b={other}",
            f"base={tiny_model_dir}",
            "eval.tasks=[gsm8k]",
            f"run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr[-2000:]
    assert "num_hidden_layers" in res.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize("program", ["eval", "drift", "interpolate", "drift-finishes"])
def test_an_evaluation_leaves_no_hold_on_its_run_dir(tiny_model_dir, tmp_path, monkeypatch, program):
    """es-eval, es-drift and es-interpolate take their run dir's lock (``open_run_dir``) and give it back however
    they end: es-compare runs them in its own process, which lives on, and so does a notebook; a second driver in
    another process is not told one runs there."""
    from es_ray.evaluation import es_drift, es_eval, es_interpolate
    from es_ray.evaluation.config import to_drift_config, to_eval_config, to_interpolate_config
    from es_ray.runtime import rundir

    def fails(*args, **kwargs):
        raise RuntimeError("failed after the run dir was opened")

    run_dir = tmp_path / "run"
    run = {"dir": str(run_dir), "progress": False, "trackers": []}
    if program == "eval":
        monkeypatch.setattr(es_eval, "_run_with_progress", fails)

        def call():
            return es_eval.run(
                to_eval_config(
                    {
                        "model": {"path": str(tiny_model_dir)},
                        "eval": EVAL,
                        "engine": ENGINE,
                        "cluster": {"num_actors": 0},
                        "run": run,
                    }
                )
            )
    elif program == "interpolate":
        monkeypatch.setattr(es_interpolate, "update_cosines", fails)
        a = shutil.copytree(tiny_model_dir, tmp_path / "a")

        def call():
            return es_interpolate.run(
                to_interpolate_config(
                    {
                        "a": str(a),
                        "base": str(tiny_model_dir),
                        "grid": [0, 1],
                        "eval": EVAL,
                        "engine": ENGINE,
                        "run": run,
                    }
                )
            )
    else:
        if program == "drift":
            monkeypatch.setattr(es_drift, "_tensor_index", fails)
        run.pop("trackers")

        def call():
            return es_drift.run_drift(
                to_drift_config(
                    {
                        "base": str(tiny_model_dir),
                        "tuned": str(tiny_model_dir),
                        "run": run,
                    }
                )
            )

    if program == "drift-finishes":
        call()
    else:
        with pytest.raises(RuntimeError, match="failed after the run dir was opened"):
            call()
    assert (run_dir / "config.json").is_file() and run_dir not in rundir._held_locks
