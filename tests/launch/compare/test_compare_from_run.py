"""es-compare takes an already-trained run as a method's training stage (+from_run.<method>=/abs/run), checked as
its own stages are: the same method, finished, the settings this comparison would train with; the run is only read."""

from __future__ import annotations

import dataclasses
import json

import pytest

from es_ray.core.config import ConfigError
from es_ray.launch.compare.run import CompareConfig, run_stage, stage_plan, validate_compare


def _cfg(tmp_path, **kw) -> CompareConfig:
    cfg = CompareConfig()
    cfg.methods = ["base", "es"]
    cfg.run = dataclasses.replace(cfg.run, dir=str(tmp_path / "cmp"))
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def _trained_run(tmp_path, cfg, method="es", finished=True, **changes):
    """A finished run dir holding the config the comparison's es stage would have (with ``changes``), labelled as a
    run of ``method``."""
    stage = next(
        s
        for s in stage_plan(dataclasses.replace(cfg, from_run={}), "es", tmp_path / "cmp")
        if s.kind.startswith("train")
    )
    config = json.loads(json.dumps(dataclasses.asdict(stage.config()), default=str))
    config["run"]["dir"] = str(tmp_path / "mine")
    config["es"]["iterations"] += 5  # its own budget: free
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        config[section][key] = value
    run = tmp_path / "mine"
    (run / "checkpoints" / "final").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"method": method, **config}))
    (run / "metrics.jsonl").write_text(json.dumps({"iteration": 0, "reward/mean": 0.5}) + "\n")
    (run / "ledger.json").write_text(json.dumps({"finished": finished}))
    (run / "summary.json").write_text(
        json.dumps({"run_dir": str(run), "final_checkpoint": str(run / "checkpoints" / "final")})
    )
    return run


def test_a_finished_run_with_the_stages_settings_stands_in_for_training(tmp_path):
    cfg = _cfg(tmp_path)
    run = _trained_run(tmp_path, cfg)
    cfg.from_run = {"es": str(run)}
    validate_compare(cfg)
    root = tmp_path / "cmp"
    stages = stage_plan(cfg, "es", root)
    train = next(s for s in stages if s.kind == "train_es")
    before = sorted(p.name for p in run.iterdir())
    record = run_stage(train, root, lambda line: None)
    d = train.dir(root)
    assert (d / "checkpoints" / "final").resolve() == (run / "checkpoints" / "final").resolve()
    assert (d / "metrics.jsonl").read_text() == (run / "metrics.jsonl").read_text()
    assert (d / "done.json").is_file() and not (d / "done.json").is_symlink()
    assert record["result"]["final_checkpoint"] == str(d / "checkpoints" / "final")
    assert sorted(p.name for p in run.iterdir()) == before  # nothing written into the run
    assert run_stage(train, root, lambda line: None)["stage"] == train.name  # done: skipped on a repeat
    evaluate = next(s for s in stages if s.kind == "eval")
    assert evaluate.config().model.path == str(d / "checkpoints" / "final")


@pytest.mark.parametrize(
    "case, words",
    [
        ("settings", "es.sigma (0.5 there"),
        ("unfinished", "has not finished"),
        ("method", "is a 'grpo' run"),
        ("seeds", "is one run, and seeds=[0, 1]"),
        ("stray", "from_run.grpo: grpo is not among methods"),
        ("relative", "is not the absolute directory"),
        ("sequential", "only a method with one training stage"),
        ("corrupt", "config.json is not a JSON object"),
        ("list", "config.json is not a JSON object"),
    ],
)
def test_a_run_that_does_not_fit_is_refused_in_one_line(tmp_path, case, words):
    cfg = _cfg(tmp_path)
    run = _trained_run(
        tmp_path,
        cfg,
        **({"es.sigma": 0.5} if case == "settings" else {}),
        **({"method": "grpo"} if case == "method" else {}),
        **({"finished": False} if case == "unfinished" else {}),
    )
    cfg.from_run = {"es": str(run)}
    if case == "seeds":
        cfg.seeds = [0, 1]
    if case == "stray":
        cfg.from_run = {"grpo": str(run)}
    if case == "relative":
        cfg.from_run = {"es": "mine"}
    if case in ("corrupt", "list"):  # a config.json cut short by a full disk, or not es-train's
        (run / "config.json").write_text('{"method": "es",' if case == "corrupt" else "[1]")
    if case == "sequential":
        cfg.methods, cfg.from_run = ["base", "es_grpo"], {"es_grpo": str(run)}
    with pytest.raises(ConfigError) as err:
        validate_compare(cfg)
    assert words in str(err.value) and "from_run." in str(err.value) and "\n" not in str(err.value)
