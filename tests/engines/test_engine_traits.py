"""Engines asked, not named (es_ray/engines/__init__.py ENGINES): GRPO's colocation turns on the sleep mode of an
engine that has one, and es-eval builds in its own process only an engine that may run there. A stand-in vLLM
module stands for the build, so the tests import no vLLM."""

from __future__ import annotations

import os
import sys
import types
from types import SimpleNamespace

import pytest

from es_ray.core.config import ConfigError
from es_ray.engines import ENGINES, engines_that
from es_ray.engines.vllm import SLEEP_MODE_ENV
from es_ray.grpo.colocated import check_sleep_mode


def colocated_cfg(engine: str, gpus: int = 1, device: str = "auto"):
    """What check_sleep_mode reads of a GRPOTrainConfig."""
    return SimpleNamespace(
        engine=SimpleNamespace(name=engine, device=device), cluster=SimpleNamespace(gpus_per_actor=gpus)
    )


def stand_in_vllm(monkeypatch, sleeps: bool) -> None:
    llm = type("LLM", (), {"sleep": lambda self: None, "wake_up": lambda self, tags: None} if sleeps else {})
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=llm))


def test_colocation_on_a_gpu_turns_on_the_sleep_mode_of_an_engine_that_has_one(monkeypatch):
    monkeypatch.delenv(SLEEP_MODE_ENV, raising=False)
    stand_in_vllm(monkeypatch, sleeps=True)
    check_sleep_mode(colocated_cfg("vllm"))
    assert ENGINES.get("vllm").sleep_mode and os.environ[SLEEP_MODE_ENV] == "1"


def test_a_build_without_sleep_mode_is_refused_naming_the_key(monkeypatch):
    monkeypatch.delenv(SLEEP_MODE_ENV, raising=False)
    stand_in_vllm(monkeypatch, sleeps=False)
    with pytest.raises(ConfigError, match="grpo.colocate=false"):
        check_sleep_mode(colocated_cfg("vllm"))
    assert SLEEP_MODE_ENV not in os.environ


@pytest.mark.parametrize("engine,gpus", [("hf", 1), ("vllm", 0)])
def test_nothing_sleeps_without_the_trait_or_off_a_gpu(monkeypatch, engine, gpus):
    monkeypatch.delenv(SLEEP_MODE_ENV, raising=False)
    stand_in_vllm(monkeypatch, sleeps=False)  # would be refused, were it asked
    check_sleep_mode(colocated_cfg(engine, gpus, "cpu"))
    assert SLEEP_MODE_ENV not in os.environ


def test_only_the_transformers_engine_runs_an_evaluation_in_process():
    assert engines_that("in_process") == ("hf",)
    assert engines_that("sleep_mode") == ("vllm",)


def test_the_es_config_asks_the_engine_for_its_low_rank_ranks(monkeypatch):
    """es.perturbation=lowrank: the ranks come from the engine's own module through its traits (``lowrank_ranks``),
    refused with the config; an engine that serves any rank (transformers) accepts it."""
    from es_ray.engines import vllm
    from es_ray.es.config import to_train_config

    monkeypatch.setattr(vllm, "lowrank_ranks", lambda: (1, 8))
    lowrank = {"perturbation": "lowrank", "rank": 3}
    with pytest.raises(ConfigError, match=r"es.rank=3: engine.name=vllm serves low-rank members at ranks 1, 8 only"):
        to_train_config({"engine": {"name": "vllm", "device": "cpu"}, "es": lowrank})
    to_train_config({"engine": {"name": "hf", "device": "cpu"}, "es": lowrank})
