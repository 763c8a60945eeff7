"""Config: validate / to_config refuse bad input naming the key; Hydra composes the default and every preset."""

from __future__ import annotations

import dataclasses
import importlib
import tomllib
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from es_ray.es.config import ESConfig, ESTrainConfig, register_configs, to_train_config, validate

from es_ray.core.config import ConfigError, HeldOutConfig, RunConfig, TaskConfig
from es_ray.runtime.entry import run_or_exit
from paths import REPO

CONF_DIR = REPO / "conf"
PRIMARY = "es_train"


def _cfg(**sections) -> ESTrainConfig:
    return ESTrainConfig(**sections)


def test_defaults_validate():
    cfg = validate(ESTrainConfig())
    assert cfg.es.population >= 2 and cfg.es.sigma > 0


@pytest.mark.parametrize(
    "cfg,key",
    [
        (_cfg(es=ESConfig(population=1)), "es.population"),
        (_cfg(es=ESConfig(population=0)), "es.population"),
        (_cfg(es=ESConfig(population=7, estimator="antithetic")), "es.population"),
        (_cfg(es=ESConfig(sigma=0.0)), "es.sigma"),
        (_cfg(es=ESConfig(sigma=-1e-3)), "es.sigma"),
        (_cfg(es=ESConfig(lr=-1.0)), "es.lr"),
        (_cfg(es=ESConfig(shaping="softmax")), "es.shaping"),
        (_cfg(es=ESConfig(estimator="two_point")), "es.estimator"),
        (_cfg(es=ESConfig(optimizer="rmsprop")), "es.optimizer"),
        (_cfg(es=ESConfig(noise="uniform")), "es.noise"),
        (_cfg(task=TaskConfig(name="not_a_task")), "task.name"),
        (_cfg(run=RunConfig(dir="runs/relative")), "run.dir"),
        (_cfg(eval=HeldOutConfig(top_p=0.0)), "eval.top_p"),
        (_cfg(eval=HeldOutConfig(top_p=1.5)), "eval.top_p"),
        (_cfg(eval=HeldOutConfig(temperature=0.0)), "eval.temperature"),
        (_cfg(eval=HeldOutConfig(max_new_tokens=-1)), "eval.max_new_tokens"),
    ],
)
def test_validate_refuses_naming_the_key(cfg, key):
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert key in str(info.value)


def test_validate_refuses_unknown_engine():
    cfg = ESTrainConfig()
    cfg.engine.name = "tensorrt"
    with pytest.raises(ConfigError, match=r"engine\.name"):
        validate(cfg)


def test_validate_accepts_even_antithetic_and_absolute_run_dir(tmp_path):
    cfg = _cfg(es=ESConfig(population=6, estimator="antithetic"), run=RunConfig(dir=str(tmp_path)))
    assert validate(cfg) is cfg


def _hydra_entry_points() -> dict[str, str]:
    """Console script -> module of every Hydra entry point (es-submit, argparse, has its own test in
    test_launch_submit.py: a bad override is exit code 2 naming the key)."""
    scripts = tomllib.loads((CONF_DIR.parent / "pyproject.toml").read_text())["project"]["scripts"]
    return {name: target.split(":")[0] for name, target in scripts.items() if name != "es-submit"}


def test_the_hydra_entry_points_are_the_expected_ones():
    assert set(_hydra_entry_points()) == {
        "es-train",
        "es-eval",
        "es-drift",
        "es-interpolate",
        "grpo-train",
        "es-compare",
    }


@pytest.mark.parametrize("script", sorted(_hydra_entry_points()))
def test_every_entry_point_turns_a_config_error_into_one_line_and_exit_code_2(script, capsys):
    module = importlib.import_module(_hydra_entry_points()[script])
    with pytest.raises(SystemExit) as info:
        module._main({"run": {"nonsense_key": 1}})  # what Hydra hands over, with a key no schema has
    assert info.value.code == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith(f"{script}: ConfigError: ") and out.err.count("\n") == 1, out.err
    assert "run.nonsense_key" in out.err


def test_a_config_error_raised_in_an_actor_is_one_line_too(capsys):
    """An actor's ConfigError (the GRPO learner refusing the checkpoint it resumes from) reaches the driver as Ray's
    RayTaskError, an instance of ConfigError too, whose text is the actor's traceback: the line shown is its cause's."""
    import traceback

    from ray.exceptions import RayTaskError

    try:
        raise ConfigError("step_000004/shards: an old layout; start the run again in a new run.dir")
    except ConfigError as exc:
        in_actor = RayTaskError("GRPOLearner.load", traceback.format_exc(), exc).as_instanceof_cause()

    def resume():
        raise in_actor

    assert isinstance(in_actor, ConfigError)
    with pytest.raises(SystemExit) as info:
        run_or_exit("grpo-train", resume)
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "grpo-train: ConfigError: step_000004/shards: an old layout; start the run again in a new run.dir\n"
    )


def test_a_bug_is_not_passed_off_as_a_user_error():
    def bug():
        raise RuntimeError("a bug keeps its traceback")

    with pytest.raises(RuntimeError, match="keeps its traceback"):
        run_or_exit("es-train", bug)


# -- to_config --------------------------------------------------------------------------------------------


def test_to_config_builds_nested_dataclasses_from_a_dict(tmp_path):
    cfg = to_train_config(
        {
            "es": {"population": 4, "sigma": 0.01},
            "task": {"name": "gsm8k"},
            "run": {"dir": str(tmp_path)},
            "hydra": {"ignored": True},
        }
    )
    assert isinstance(cfg, ESTrainConfig)
    assert cfg.es.population == 4 and cfg.es.sigma == 0.01 and cfg.task.name == "gsm8k"
    assert cfg.es.lr == ESConfig().lr  # untouched fields keep their defaults


@pytest.mark.parametrize(
    "data,key",
    [
        ({"es": {"population": 1}}, "es.population"),
        ({"es": {"population": 5, "estimator": "antithetic"}}, "es.population"),
        ({"es": {"sigma": 0}}, "es.sigma"),
        ({"task": {"name": "unknown"}}, "task.name"),
        ({"engine": {"name": "llamacpp"}}, "engine.name"),
        ({"run": {"dir": "relative/dir"}}, "run.dir"),
        ({"es": {"popsize": 8}}, "es.popsize"),
        ({"nonsense": 1}, "nonsense"),
        ({"engine": {"dtype": "bfloat16", "gpu_memory": 0.5}}, "engine.gpu_memory"),
    ],
)
def test_to_config_refuses_naming_the_key(data, key):
    with pytest.raises(ConfigError) as info:
        to_train_config(data)
    assert key in str(info.value)


def test_to_config_accepts_a_dictconfig():
    cfg = to_train_config(OmegaConf.create({"es": {"population": 6}, "sampling": {"max_new_tokens": 8}}))
    assert cfg.es.population == 6 and cfg.sampling.max_new_tokens == 8


# -- Hydra ------------------------------------------------------------------------------------------------


def _default_groups() -> set[str]:
    """Config groups that the primary config's defaults list names (overridable as group=option)."""
    groups = set()
    for entry in OmegaConf.to_container(OmegaConf.load(CONF_DIR / f"{PRIMARY}.yaml")).get("defaults", []):
        if isinstance(entry, dict):
            for key in entry:
                groups.add(key.replace("optional ", "").replace("override ", "").strip())
    return groups


def _presets() -> list[tuple[str, str]]:
    """(group, option) of every YAML under conf/ subfolders, so a new preset is covered without editing this file."""
    out = []
    for path in sorted(CONF_DIR.rglob("*.yaml")):
        rel = path.relative_to(CONF_DIR)
        if len(rel.parts) < 2 or rel.parts[0] == "hydra":
            continue
        out.append((rel.parent.as_posix(), path.stem))
    return out


PRESETS = _presets()


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name=PRIMARY, overrides=overrides)


def test_presets_are_discovered():
    assert PRESETS, "no preset YAML found under conf/*/"
    assert ("model", "smollm2-135m") in PRESETS


def test_compose_default_config():
    composed = _compose([])
    cfg = to_train_config(composed)
    assert isinstance(cfg, ESTrainConfig)
    assert dataclasses.asdict(cfg)["es"] == dataclasses.asdict(ESConfig())


def test_compose_with_command_line_overrides():
    cfg = to_train_config(_compose(["es.population=4", "es.estimator=antithetic", "task.name=countdown"]))
    assert cfg.es.population == 4 and cfg.es.estimator == "antithetic" and cfg.task.name == "countdown"


def test_compose_refuses_a_key_missing_from_the_schema():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="es.popsize"):
        _compose(["es.popsize=4"])


def _compose_for(primary: str, overrides: list[str]):
    """Compose with another entry point's primary config and convert it with that entry point's own checks."""
    from hydra import compose, initialize_config_dir

    if primary == "es_train":
        return to_train_config(_compose(overrides))
    if primary == "es_compare":
        from es_ray.launch.compare.run import register_configs as register, to_compare_config as convert
    else:
        from es_ray.grpo.config import register_configs as register, to_grpo_config as convert
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return convert(compose(config_name=primary, overrides=overrides + ["run.dir=/tmp/compose-check"]))


@pytest.mark.parametrize("group,option", PRESETS, ids=[f"{g}/{o}" for g, o in PRESETS])
def test_compose_every_preset(group, option):
    """Every preset composes and validates with at least one entry point (experiment presets are es-train's or
    es-compare's); model and cluster presets with es-train itself."""
    prefix = "" if group in _default_groups() else "+"
    override = [f"{prefix}{group}={option}"]
    if group != "experiment":
        assert isinstance(to_train_config(_compose(override)), ESTrainConfig)
        return
    errors = []
    for primary in ("es_train", "es_compare", "grpo_train"):
        try:
            _compose_for(primary, override)
            return
        except Exception as exc:  # noqa: BLE001 - collected and shown when no entry point takes the preset
            errors.append(f"{primary}: {type(exc).__name__}: {exc}")
    pytest.fail(f"experiment={option} composes with no entry point:\n" + "\n".join(errors))


ENTRY_POINTS = {
    "es_train": "es-train",
    "grpo_train": "grpo-train",
    "es_compare": "es-compare",
    "es_eval": "es-eval",
    "es_drift": "es-drift",
}


def test_help_lists_only_presets_that_compose_and_each_one_converts():
    """`<entry point> --help` lists an experiment only where it composes, and each listed one also passes that
    entry point's own checks; every experiment preset is listed by some entry point."""
    import subprocess
    import sys

    from es_ray.runtime.entry import composable_presets

    bindir = Path(sys.executable).parent
    listed = {}
    for primary, prog in ENTRY_POINTS.items():
        out = subprocess.run([str(bindir / prog), "--help"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-1000:]
        line = next((x for x in out.stdout.splitlines() if x.startswith("experiment: ")), "experiment: ")
        listed[primary] = [x for x in line.removeprefix("experiment: ").split(", ") if x]
        for option in listed[primary]:
            if primary in ("es_train", "grpo_train", "es_compare"):
                _compose_for(primary, [f"experiment={option}"])  # composes and passes the entry point's checks
    assert listed["es_train"] == ["es_reference_gsm8k"]
    assert listed["es_compare"] == ["coverage", "cpu_demo", "paper_easy", "paper_hard", "sequence"]
    every = {p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")}
    assert every == {o for options in listed.values() for o in options}
    register_configs()
    assert composable_presets("es_train")["experiment"] == ["es_reference_gsm8k"]
