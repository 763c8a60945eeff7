"""es-train as a subprocess: bad input refused before work; a tiny real run on the embedded default model."""

from __future__ import annotations

import json
import subprocess

import pytest


def es_train(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["es-train", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("es.population=1", "es.population"),
        ("es.sigma=0", "es.sigma"),
        ("es.sigma=-1e-3", "es.sigma"),
        ("task.name=nope", "task.name"),
        ("engine.name=nope", "engine.name"),
        ("run.dir=relative/dir", "run.dir"),
        ("model.path=/nonexistent/model", "model.path"),
        ("cluster.address=127.0.0.1:1", "cluster.address"),
    ],
)
def test_bad_input_is_refused_with_a_message(override, expected, tmp_path):
    extra = [] if override.startswith("run.dir") else [f"run.dir={tmp_path / 'run'}"]
    res = es_train(override, *extra, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert expected in res.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_odd_population_with_antithetic_is_refused(tmp_path):
    res = es_train("es.estimator=antithetic", "es.population=5", f"run.dir={tmp_path}", timeout=300)
    assert res.returncode == 2 and "even" in res.stderr


@pytest.mark.slow
def test_es_train_on_default_model_writes_loadable_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    res = es_train("es.population=2", "es.iterations=2", "es.prompts_per_iteration=2", "sampling.max_new_tokens=4",
                   "cluster.num_actors=2", "eval.every=0", "run.progress=false", f"run.dir={run_dir}")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    assert len((run_dir / "seed_log.jsonl").read_text().splitlines()) == 2
    assert list((run_dir / "tensorboard").iterdir())
    final = run_dir / "checkpoints" / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    assert sum(p.numel() for p in model.parameters()) == 134515008
    meta = json.loads((final / "es_meta.json").read_text())
    assert meta["iteration"] == 2
