"""grpo-train: bad input refused with a message naming the key; presets compose; a tiny real run on the embedded
default model writes metrics, a ledger and a loadable checkpoint."""

from __future__ import annotations

import json
import subprocess

import pytest

from es_ray.core.config import ConfigError
from es_ray.grpo.config import to_grpo_config


@pytest.mark.parametrize(
    "section, override, key",
    [
        ("grpo", {"group_size": 1}, "grpo.group_size"),
        ("grpo", {"loss_type": "ppo"}, "grpo.loss_type"),
        ("grpo", {"beta": -0.1}, "grpo.beta"),
        ("grpo", {"prompts_per_step": 0}, "grpo.prompts_per_step"),
        ("grpo", {"adv_scale": "rank"}, "grpo.adv_scale"),
        ("sampling", {"temperature": 0.0}, "sampling.temperature"),
        ("engine", {"name": "nope"}, "engine.name"),
        ("run", {"dir": "relative/dir"}, "run.dir"),
        ("grpo", {"nope": 1}, "grpo.nope"),
    ],
)
def test_bad_input_is_refused_naming_the_key(section, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        to_grpo_config({section: override})


def test_presets_compose_into_the_schema():
    from hydra import compose, initialize_config_dir

    from es_ray.runtime.entry import CONF_DIR
    from es_ray.grpo.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for overrides in ([], ["cluster=local"], ["grpo.loss_type=dapo", "grpo.clip_eps_high=0.28", "grpo.beta=0.04"]):
            cfg = to_grpo_config(compose(config_name="grpo_train", overrides=overrides))
            assert cfg.grpo.group_size >= 2 and cfg.sampling.temperature > 0


def grpo_train(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["grpo-train", *args], capture_output=True, text=True, timeout=timeout)


def test_cli_refuses_bad_input_before_any_work(tmp_path):
    res = grpo_train("grpo.group_size=1", f"run.dir={tmp_path / 'run'}", timeout=300)
    assert res.returncode == 2 and "grpo.group_size" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_grpo_train_on_default_model_writes_loadable_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    res = grpo_train(
        "grpo.steps=2",
        "grpo.prompts_per_step=1",
        "grpo.group_size=2",
        "sampling.max_new_tokens=4",
        "eval.every=0",
        "run.progress=false",
        f"run.dir={run_dir}",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for key in (
        "reward/mean",
        "reward/std",
        "grpo/loss",
        "grpo/kl",
        "grpo/clip_frac",
        "grpo/entropy",
        "grpo/grad_norm",
        "completions/mean_length",
        "timing_s/generate",
        "timing_s/train",
        "timing_s/sync",
    ):
        assert all(key in r for r in rows), key
    assert all(r["sync/max_logprob_diff"] <= r["sync/tolerance"] for r in rows)
    # One prompt, two completions, beta 0: a group whose rewards are all equal has zero advantages and so exactly
    # zero gradient; a group that differs must move the weights. The seeded run has at least one such group.
    assert any(r["reward/std"] > 0 for r in rows), rows
    assert all((r["grpo/grad_norm"] > 0) == (r["reward/std"] > 0) for r in rows), rows
    assert list((run_dir / "tensorboard").iterdir())
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["tokens_generated"] == sum(r["perf/tokens"] for r in rows) > 0
    assert ledger["actors"]["learner_0"]["peak_rss_bytes"] > 500 << 20  # fp32 weights alone are 0.5 GB
    final = run_dir / "checkpoints" / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    assert sum(p.numel() for p in model.parameters()) == 134515008
    assert json.loads((final / "grpo_meta.json").read_text())["step"] == 2


TAKE_LOCK = """
import sys
from pathlib import Path
from es_ray.core.config import ConfigError
from es_ray.runtime.rundir import lock_run_dir
try:
    lock_run_dir(Path(sys.argv[1]), "grpo")
except ConfigError as exc:
    print(exc)
else:
    print("free")
"""


def _lock_is_free(run_dir) -> str:
    """What a driver in another process finds: 'free', or the refusal's line."""
    import sys

    return subprocess.run(
        [sys.executable, "-c", TAKE_LOCK, str(run_dir)], capture_output=True, text=True, timeout=120
    ).stdout.strip()


@pytest.mark.parametrize("where", ["cluster", "resume"])
def test_a_run_that_fails_before_its_first_step_leaves_its_run_dir_free(tmp_path, tiny_model_dir, monkeypatch, where):
    """A failure between opening the run dir and training (the cluster or engine not starting; a resume's
    checkpoint refused) releases the run dir's lock in this process, which lives on (es-compare, a notebook): a
    second driver is not told another one runs there."""
    import es_ray.grpo.driver as driver
    import es_ray.runtime.cluster as cluster
    from helpers import grpo_tiny_cfg

    def fails(*args, **kw):
        raise RuntimeError("engine build failed")

    monkeypatch.setattr(
        cluster if where == "cluster" else driver, "connect" if where == "cluster" else "last_checkpoint", fails
    )
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="engine build failed"):
        driver.run(grpo_tiny_cfg(tiny_model_dir, run_dir, run={"resume": where == "resume"}))
    assert (run_dir / "config.json").is_file()
    assert _lock_is_free(run_dir) == "free"
