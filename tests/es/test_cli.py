"""es-train as a subprocess: bad input refused before work; a tiny real run on the embedded default model."""

from __future__ import annotations

import json
import os
import shlex
import signal
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


def test_pass_at_k_with_fewer_samples_than_k_is_refused_in_one_line(tmp_path):
    res = es_train(
        "task.objective=pass_at_k",
        "task.objective_k=4",
        "es.samples_per_prompt=2",
        f"run.dir={tmp_path / 'run'}",
        timeout=300,
    )
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr[-2000:]
    assert "es.samples_per_prompt=2" in res.stderr and not (tmp_path / "run").exists()


def test_odd_population_with_antithetic_is_refused(tmp_path):
    res = es_train("es.estimator=antithetic", "es.population=5", f"run.dir={tmp_path}", timeout=300)
    assert res.returncode == 2 and "even" in res.stderr


@pytest.mark.slow
def test_es_train_on_default_model_writes_loadable_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    res = es_train(
        "es.population=2",
        "es.iterations=2",
        "es.prompts_per_iteration=2",
        "sampling.max_new_tokens=4",
        "cluster.num_actors=2",
        "eval.every=0",
        "run.progress=false",
        f"run.dir={run_dir}",
    )
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


@pytest.mark.ray
def test_the_printed_continue_command_resumes_the_run_as_printed(ray_local, tiny_model_dir, tmp_path):
    """A run stopped by a signal prints "Continue with: <command>"; that command, run as printed (the cluster found
    through RAY_ADDRESS as under Ray Jobs), finishes the run with its saved settings, none repeated."""
    run_dir = tmp_path / "run dir"  # a space: the printed command must quote it
    env = {**os.environ, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}
    first = subprocess.run(
        [
            "es-train",
            f"model.path={tiny_model_dir}",
            "task.name=es_test_tasks:VowelTask",
            "task.train_size=8",
            "es.population=2",
            "es.sigma=0.02",
            "es.iterations=4",
            "es.prompts_per_iteration=4",
            "sampling.max_new_tokens=4",
            "engine.dtype=float32",
            "cluster.num_actors=1",
            "cluster.cpus_per_actor=1",
            "eval.every=0",
            "run.progress=false",
            "run.trackers=[]",
            "faults.interrupt_at_iteration=1",
            "faults.actor_delay_s=1",
            f"run.dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    out = first.stdout + first.stderr
    assert first.returncode == 128 + signal.SIGTERM, out[-3000:]
    command = out.split("Continue with: ", 1)[1].splitlines()[0]
    assert command.startswith("es-train run.resume=true run.dir=")
    second = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=600, env=env)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3], (out + second.stdout + second.stderr)[-4000:]
    assert json.loads((run_dir / "config.json").read_text())["es"]["population"] == 2


@pytest.mark.parametrize(
    "args, expected",
    [
        (["es.populaton=2"], r"^unknown key es\.populaton in 'es\.populaton=2': did you mean es\.population\?"),
        (["modle=x"], r"^unknown key modle .*did you mean model\?"),
        (["es.population=abc"], r"^es\.population=abc: Value 'abc' of type 'str' could not be converted to Integer$"),
        (["eval.every=1.5"], r"^eval\.every=1\.5: .*Integer$"),
        (["run.trackers=wandb"], r"^run\.trackers=wandb: .*key=\[a,b\]"),
        (["es.population=[1"], r"^cannot read the override 'es\.population=\[1'"),
        (["experiment=nope"], r"^experiment=nope: no such preset; choose one of coverage, cpu_demo, "),
        (["experiment=cpu_demo"], r"^experiment=cpu_demo: Key 'budget' not in 'ESTrainConfig'; the preset is not for"),
    ],
)
def test_hydra_errors_are_one_line_naming_the_key(args, expected):
    import re

    from es_ray.es.config import register_configs
    from es_ray.runtime.entry import check_overrides

    register_configs()
    problem = check_overrides("es_train", args)
    assert problem is not None and "\n" not in problem and re.search(expected, problem), problem
    assert check_overrides("es_train", ["es.population=4", "experiment=es_reference_gsm8k", "+eval.paths.x=y"]) is None


@pytest.mark.parametrize(
    "args, expected",
    [
        (["es.populaton=2"], "did you mean es.population?"),
        (["es.population=abc"], "es.population=abc"),
        (["-m", "es.sigma=1e-3,2e-3"], "es-submit --sweep"),
        (["--multirun", "es.sigma=1e-3"], "es-submit --sweep"),
    ],
)
def test_hydra_errors_and_multirun_exit_2_with_one_line_before_any_work(args, expected, tmp_path):
    res = es_train(*args, f"run.dir={tmp_path / 'run'}", timeout=300)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and expected in res.stderr, res.stderr[-2000:]
    assert res.stderr.startswith("es-train: ") and not (tmp_path / "run").exists()


def _help(prog: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([prog, *args, "--help"], capture_output=True, text=True, timeout=300)


def _keys(stdout: str) -> dict[str, str]:
    """key -> value from --help's key lines (unindented key=value)."""
    return dict(line.split("=", 1) for line in stdout.splitlines() if "=" in line and not line.startswith((" ", "=")))


def test_help_prints_each_keys_docstring_also_after_an_override():
    """--help shows every key with the docstring docs/config.md uses, and the values after the overrides given."""
    from es_ray.core.config_docs import field_docs
    from es_ray.es.config import ESConfig

    plain, after = _help("es-train"), _help("es-train", "task.name=countdown", "es.population=4")
    assert plain.returncode == 0 and after.returncode == 0, plain.stderr[-2000:] + after.stderr[-2000:]
    doc = field_docs(ESConfig)["population"]
    for res in (plain, after):
        flat = " ".join(res.stdout.split())
        assert doc in flat and "experiment: es_reference_gsm8k" in res.stdout
    assert _keys(plain.stdout)["es.population"] == str(ESConfig().population)
    assert _keys(after.stdout)["es.population"] == "4" and _keys(after.stdout)["task.name"] == "countdown"
    assert "Keys after task.name=countdown es.population=4" in after.stdout


def test_help_lists_only_the_keys_the_command_reads():
    drift, evaluate = _help("es-drift"), _help("es-eval")
    assert drift.returncode == 0 and evaluate.returncode == 0
    drift_keys, eval_keys = _keys(drift.stdout), _keys(evaluate.stdout)
    assert {"tuned", "thresholds", "run.dir", "run.overwrite"} <= set(drift_keys)
    assert not {"run.resume", "run.checkpoint_every", "run.stop_at_tokens", "run.seed"} & set(drift_keys)
    assert "run.seed" in eval_keys and "eval.k" in eval_keys and "run.resume" not in eval_keys
    assert "run.resume" in _keys(_help("es-train").stdout)


def test_help_after_a_misspelt_override_is_the_one_line_error():
    res = _help("es-train", "es.populaton=4")
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0
    assert "did you mean es.population?" in res.stderr and not res.stdout
