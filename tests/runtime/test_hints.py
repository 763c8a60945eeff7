"""Every hint names a key its own command accepts: the unknown-key hints of each entry point, es-eval's task
errors (es-eval has no task.path), the task loaders' refusals in the trainers, and es-submit's address hint."""

from __future__ import annotations

import dataclasses
import json
import re
import typing

import pytest

from es_ray.runtime.entry import SECTIONS, check_overrides


def _schemas() -> dict:
    from es_ray.es.config import ESTrainConfig
    from es_ray.evaluation.config import DriftJobConfig, EvalJobConfig, InterpolateJobConfig
    from es_ray.grpo.config import GRPOTrainConfig
    from es_ray.launch.compare.run import CompareConfig

    return {
        "es_train": ESTrainConfig,
        "grpo_train": GRPOTrainConfig,
        "es_eval": EvalJobConfig,
        "es_drift": DriftJobConfig,
        "es_interpolate": InterpolateJobConfig,
        "es_compare": CompareConfig,
    }


def accepts(schema, key: str) -> bool:
    """Whether ``key`` (dotted; a <placeholder> or any name under a dict field) is a key of ``schema``."""
    node = schema
    for part in key.split("."):
        if node is dict:
            return True
        if not dataclasses.is_dataclass(node):
            return False
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            return False
        hint = typing.get_type_hints(node)[part]
        node = dict if typing.get_origin(hint) is dict else hint
    return True


SET_KEY = re.compile(r"(?<![\w./-])([a-z_][a-z0-9_]*(?:\.[a-z0-9_<>]+)+)=")
MEANT = re.compile(r"did you mean ([a-z0-9_.]+)\?")


def named_keys(text: str) -> list[str]:
    """The keys a message asks the user to set: ``key=`` and ``did you mean key?``."""
    return SET_KEY.findall(text) + MEANT.findall(text)


def _register_all():
    from es_ray.es.config import register_configs as es
    from es_ray.evaluation.config import register_configs as ev
    from es_ray.grpo.config import register_configs as grpo
    from es_ray.launch.compare.run import register_configs as compare

    for register in (es, ev, grpo, compare):
        register()


def test_the_sections_table_is_each_schemas_top_level_keys():
    schemas = _schemas()
    assert set(SECTIONS) == set(schemas)
    for name, schema in schemas.items():
        assert SECTIONS[name] == tuple(f.name for f in dataclasses.fields(schema)), name


@pytest.mark.parametrize(
    "config_name, override, must_say",
    [
        ("grpo_train", "es.population=4", "es.* is a section of es-train, es-compare, not of grpo-train"),
        ("es_train", "grpo.lr=1e-6", "grpo.* is a section of grpo-train, es-compare, not of es-train"),
        ("es_eval", "task.path=/data/x.jsonl", "eval.paths.<task>="),
        ("es_eval", "sampling.temperature=1.0", "eval.temperature"),
        ("es_train", "es.popualtion=8", "did you mean es.population?"),
        ("grpo_train", "grpo.group_sise=8", "did you mean grpo.group_size?"),
        ("es_drift", "run.dri=/x", "did you mean run.dir?"),
    ],
)
def test_an_unknown_key_hint_names_keys_of_its_own_command(config_name, override, must_say):
    _register_all()
    text = check_overrides(config_name, [override])
    assert text and must_say in text, text
    assert "task.operations" not in text
    schema = _schemas()[config_name]
    hint = text.partition(f"{override!r}: ")[2]  # after the echo of the user's own override
    assert hint, text
    for key in named_keys(hint):
        assert accepts(schema, key), f"{config_name}: {text!r} names {key}, which it does not accept"


def test_es_evals_task_errors_name_eval_paths_never_task_path(tmp_path):
    from es_ray.evaluation.config import EvalJobConfig
    from es_ray.evaluation.worker import in_eval_keys, load_eval_task
    from es_ray.tasks.base import TaskLoadError

    cfg = EvalJobConfig()
    cfg.eval.paths = {"gsm8k": str(tmp_path / "missing.jsonl")}
    with pytest.raises(TaskLoadError) as err:
        load_eval_task(cfg, "gsm8k")
    hub = in_eval_keys(
        "task math500: could not load HuggingFaceH4/MATH-500 split 'test': ConnectionError: no. "
        "Download it elsewhere and point task.path= at a local JSONL file in the same schema.",
        "math500",
    )
    rows = tmp_path / "gsm.jsonl"
    rows.write_text("".join(json.dumps({"question": f"{i}?", "answer": f"#### {i}"}) + "\n" for i in range(5)))
    cfg.eval.paths = {"countdown": str(rows)}
    with pytest.raises(TaskLoadError) as skipped:
        load_eval_task(cfg, "countdown")
    assert "every row was skipped" in str(skipped.value)
    for text in (str(err.value), hub, str(skipped.value)):
        assert "task.name" not in text, text
        assert "task.path" not in text and "eval.paths." in text, text
        for key in named_keys(text):
            assert accepts(EvalJobConfig, key), (text, key)
    assert "eval.data_dir=" in hub


def test_the_trainers_task_refusals_name_keys_the_trainers_accept(tmp_path):
    from es_ray.core.config import TaskConfig
    from es_ray.tasks import load_task
    from es_ray.tasks.base import TaskLoadError

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i}?", "answer": f"#### {i}"}) + "\n" for i in range(40)))
    texts = []
    for cfg in (
        TaskConfig(name="gsm8k", path=str(path)),
        TaskConfig(name="countdown", path=str(path)),
        TaskConfig(name="gsm8k", path=str(tmp_path / "none.jsonl")),
        TaskConfig(name="gsm8k", reward="m"),
    ):
        with pytest.raises((TaskLoadError, ValueError)) as err:
            load_task(cfg)
        texts.append(str(err.value))
    schemas = _schemas()
    for text in texts:
        keys = named_keys(text)
        assert keys, text
        for name in ("es_train", "grpo_train"):
            assert all(accepts(schemas[name], k) for k in keys), (name, text, keys)


def test_es_submits_address_hint_does_not_promise_an_empty_address():
    from es_ray.core.config import ConfigError
    from es_ray.runtime.cluster import check_address, check_address_syntax

    with pytest.raises(ConfigError) as bad:
        check_address_syntax("ftp://x", key="--address")
    with pytest.raises(ConfigError) as down:
        check_address("http://127.0.0.1:1", key="--address", timeout=1.0)
    for err in (bad, down):
        text = str(err.value)
        assert "leave --address empty" not in text and "127.0.0.1:8265" in text, text
    with pytest.raises(ConfigError, match="leave cluster.address empty to start a local Ray"):
        check_address("127.0.0.1:1", timeout=1.0)


def test_an_entry_of_a_map_without_the_plus_is_told_to_add_it():
    _register_all()
    text = check_overrides("es_compare", ["from_run.es=/abs/run"])
    assert "write +from_run.es=" in text, text
    text = check_overrides("es_eval", ["eval.paths.gpqa=/abs/gpqa.jsonl"])
    assert "write +eval.paths.gpqa=" in text, text


def test_es_eval_draws_no_bar_into_a_log_file(monkeypatch):
    """run.progress=true, stderr redirected: no tqdm frames (the trainers' rule, tracking.shows_bar)."""
    import sys

    import tqdm

    from es_ray.evaluation import es_eval
    from es_ray.evaluation.config import EvalJobConfig
    from es_ray.runtime.tracking import shows_bar

    def no_bar(*a, **kw):
        raise AssertionError("a bar was drawn although stderr is not a terminal")

    monkeypatch.setattr(tqdm, "tqdm", no_bar)
    monkeypatch.setattr(es_eval, "_run_chunks", lambda cfg, chunks, done, local: ["ran"])
    cfg = EvalJobConfig()
    cfg.run = dataclasses.replace(cfg.run, progress=True)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert not shows_bar(True) and es_eval._run_with_progress(cfg, [], True) == ["ran"]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert shows_bar(True) and not shows_bar(False)
