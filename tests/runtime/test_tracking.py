"""Trackers: every backend gets the same metric names, steps and parameters, offline; bad run.trackers is refused
before any work in every entry point; a tiny ES run on Ray lands in all of them."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from es_ray.es.config import ESTrainConfig
from es_ray.core.config import ConfigError, RunConfig
from es_ray.runtime.validation import validate_run
from es_ray.runtime.tracking import TRACKERS, Tracker
from paths import FIXTURES, REPO

CONF_DIR = REPO / "conf"
STEPS = [0, 1, 2]


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """Offline W&B (WANDB_MODE=offline, as a user without network sets it), no MLflow URI set; W&B's own caches
    kept out of the home directory."""
    for var in (
        "WANDB_PROJECT",
        "WANDB_API_KEY",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
        "MLFLOW_ALLOW_FILE_STORE",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))


# -- reading each backend back ---------------------------------------------------------------------------------


def wandb_records(run_dir: Path) -> list:
    """The records of the offline run's .wandb file (a LevelDB-style log of protobuf records: 32 KiB blocks, each
    record chunk behind a 7-byte header of crc32, length, type; the file opens with ':W&B', magic, version)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, out, chunk = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # still being written
            break
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(chunk)
            out.append(rec)
            chunk = b""
    return out


def wandb_history(run_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], dict]:
    """{metric: [(step, value)]} and the run's config, from the offline run."""
    deadline = time.monotonic() + 60
    records = wandb_records(run_dir)
    while not records or records[-1].WhichOneof("record_type") != "exit":  # W&B's service may still be writing
        assert time.monotonic() < deadline, "the offline W&B run was not closed within 60 s"
        time.sleep(0.2)
        records = wandb_records(run_dir)
    history: dict[str, list[tuple[int, float]]] = {}
    config = {}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
            for k, v in row.items():
                if not k.startswith("_"):
                    history.setdefault(k, []).append((row["_step"], v))
        elif kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
    return history, config


def mlflow_history(run_dir: Path | str) -> tuple[dict[str, list[tuple[int, float]]], dict]:
    """{metric: [(step, value)]} and the parameters of the one run in the store (run_dir/mlruns, or a URI)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(run_dir if isinstance(run_dir, str) else (run_dir / "mlruns").as_uri())
    (exp,) = [e for e in client.search_experiments() if e.name == "es-ray"]
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    history = {
        k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)) for k in run.data.metrics
    }
    return history, run.data.params


def tensorboard_history(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    return {k: [(e.step, e.value) for e in acc.Scalars(k)] for k in acc.Tags()["scalars"]}


# -- each backend ------------------------------------------------------------------------------------------------


def _log_three_steps(run_dir: Path, trackers: list[str]) -> None:
    run_dir.mkdir(exist_ok=True)
    cfg = ESTrainConfig(run=RunConfig(dir=str(run_dir), trackers=trackers))
    cfg.task.operations = "+" * 600  # longer than MLflow's 500-character parameter value limit
    tracker = Tracker(run_dir, len(STEPS), cfg, trackers, progress=False)
    for t in STEPS:
        tracker.log(
            t,
            {
                "reward/mean": 0.5 + t,
                "es/checksums_verified": True,
                "perf/tokens": 10 * t,
                "eval/reward": float("nan"),
                "note": "text",
            },
        )
    tracker.close()


EXPECTED = {
    "reward/mean": [(t, 0.5 + t) for t in STEPS],
    "es/checksums_verified": [(t, 1.0) for t in STEPS],
    "perf/tokens": [(t, 10.0 * t) for t in STEPS],
}


def test_a_tensorboard_writer_that_cannot_open_fails_the_first_row_not_the_close(tmp_path, monkeypatch):
    """The writer opens in a thread (its import of torch overlaps the actors' start): an error there is raised by
    the first row, and a run that stops before any row closes without it."""
    import torch.utils.tensorboard as tb

    def refuse(*a, **kw):
        raise PermissionError("tensorboard dir not writable")

    monkeypatch.setattr(tb, "SummaryWriter", refuse)
    cfg = ESTrainConfig(run=RunConfig(dir=str(tmp_path), trackers=["tensorboard"]))
    tracker = Tracker(tmp_path, 2, cfg, ["tensorboard"], progress=False)
    with pytest.raises(PermissionError, match="not writable"):
        tracker.log(0, {"reward/mean": 0.5})
    Tracker(tmp_path, 2, cfg, ["tensorboard"], progress=False).close()  # no row: nothing to raise


def test_registry_is_the_one_list_of_names():
    assert TRACKERS.names() == ("tensorboard", "wandb", "mlflow")


def test_jsonl_is_always_written_and_keeps_everything(tmp_path):
    _log_three_steps(tmp_path, [])
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == STEPS
    assert rows[0]["eval/reward"] is None and rows[0]["note"] == "text"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_tensorboard(tmp_path):
    _log_three_steps(tmp_path, ["tensorboard"])
    assert tensorboard_history(tmp_path) == EXPECTED


def test_wandb_offline_under_the_run_dir(tmp_path):
    _log_three_steps(tmp_path, ["wandb"])
    history, config = wandb_history(tmp_path)
    assert history == EXPECTED
    assert config["es.population"] == ESTrainConfig().es.population
    assert config["run.trackers"] == ["wandb"] and config["task.operations"] == "+" * 600


def test_mlflow_file_store_under_the_run_dir(tmp_path):
    _log_three_steps(tmp_path, ["mlflow"])
    history, params = mlflow_history(tmp_path)
    assert history == EXPECTED
    assert params["es.population"] == str(ESTrainConfig().es.population)
    assert params["run.trackers"] == "['mlflow']"
    assert params["task.operations"] == "+" * 500  # cut to the limit every MLflow server takes


def test_mlflow_tracking_uri_from_the_environment(tmp_path, monkeypatch):
    store = (tmp_path / "elsewhere").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    _log_three_steps(tmp_path / "run", ["mlflow"])
    assert not (tmp_path / "run" / "mlruns").exists()
    assert mlflow_history(store)[0] == EXPECTED


# -- refusals ----------------------------------------------------------------------------------------------------


def test_unknown_tracker_is_refused_naming_the_accepted_ones():
    with pytest.raises(ConfigError, match=r"run\.trackers='neptune' is not one of tensorboard, wandb, mlflow"):
        validate_run(RunConfig(trackers=["tensorboard", "neptune"]))


@pytest.mark.parametrize("name,module", [("wandb", "wandb"), ("mlflow", "mlflow"), ("tensorboard", "tensorboard")])
def test_missing_package_is_refused_naming_the_install(monkeypatch, name, module):
    monkeypatch.setitem(sys.modules, module, None)  # import (and find_spec) now fail as if not installed
    with pytest.raises(ConfigError, match=f"run.trackers={name} needs the {module} package") as info:
        validate_run(RunConfig(trackers=[name]))
    if name != "tensorboard":
        assert f"pip install 'es-ray[{name}]'" in str(info.value)


def test_vllm_missing_is_refused_naming_the_extra(monkeypatch):
    from es_ray.core.config import ClusterConfig, EngineConfig
    from es_ray.runtime.validation import validate_cluster

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ConfigError, match=r"engine\.name=vllm needs the vllm package.*pip install 'es-ray\[vllm\]'"):
        validate_cluster(ClusterConfig(), EngineConfig(name="vllm"))
    validate_cluster(ClusterConfig(address="127.0.0.1:9"), EngineConfig(name="vllm"))  # the cluster's nodes have it


def test_tensorboard_gets_the_config_as_hparams_of_the_same_run(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    _log_three_steps(tmp_path, ["tensorboard"])
    acc = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    data = plugin_data_pb2.HParamsPluginData.FromString(content)
    hp = {k: v.ListFields()[0][1] for k, v in data.session_start_info.hparams.items()}
    assert hp["es.population"] == ESTrainConfig().es.population and hp["run.trackers"] == "['tensorboard']"
    assert [p.name for p in (tmp_path / "tensorboard").iterdir() if p.is_dir()] == []  # no second run for them


def test_tensorboard_hparams_declare_the_metrics_runs_are_ranked_by(tmp_path):
    """The HPARAMS tab ranks runs by the metrics the experiment declares; each is a scalar tag of the same run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    from es_ray.runtime.tracking import ranked_metrics

    _log_three_steps(tmp_path, ["tensorboard"])
    acc = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/experiment"]
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content).experiment
    declared = [m.name.tag for m in experiment.metric_infos]
    assert declared == ["reward/mean", "eval/reward", "eval/pass_at_1"]
    assert "reward/mean" in acc.Tags()["scalars"]  # the tab reads its value from the run's own scalars
    assert len(experiment.hparam_infos) > 50 and "es.population" in {h.name for h in experiment.hparam_infos}
    eval_params = {"eval.tasks": ["gsm8k", "csqa"], "eval.k": [1, 16]}
    assert ranked_metrics(eval_params, "es-eval") == [
        "eval/gsm8k/pass_at_1",
        "eval/gsm8k/pass_at_16",
        "eval/gsm8k/mean_reward",
        "eval/csqa/pass_at_1",
        "eval/csqa/pass_at_16",
        "eval/csqa/mean_reward",
    ]
    assert ranked_metrics({**eval_params, "methods": ["es", "grpo"]}, "es-compare") == [
        "compare/es/pass_at_1",
        "compare/es/pass_at_16",
        "compare/grpo/pass_at_1",
        "compare/grpo/pass_at_16",
    ]


def test_eval_summary_names_match_the_declared_metrics():
    """es-eval's and es-compare's summary rows carry every metric their hparams declare (no rank by a missing tag)."""
    from es_ray.evaluation.es_eval import tracker_metrics as eval_metrics
    from es_ray.runtime.tracking import ranked_metrics
    from es_ray.launch.compare.run import tracker_metrics as compare_metrics

    results = {
        "entropy": {"mean_per_token": 0.5},
        "tokens_generated": 10,
        "timing_s": {"total": 1.0},
        "tasks": {"gsm8k": {"pass@k": {"1": 0.1, "16": 0.5}, "maj@k": None, "mean_reward": 0.2, "entropy": None}},
    }
    assert set(ranked_metrics({"eval.tasks": ["gsm8k"], "eval.k": [1, 16]}, "es-eval")) <= set(eval_metrics(results))
    report = {
        "methods": {
            m: {"average": {"1": 0.1, "16": 0.4}, "entropy": {"mean_per_token": 0.3}, "ledger": None}
            for m in ("es", "grpo")
        }
    }
    declared = ranked_metrics({"methods": ["es", "grpo"], "eval.k": [1, 16]}, "es-compare")
    assert set(declared) <= set(compare_metrics(report))


def test_wandb_mode_follows_wandb(monkeypatch, tmp_path):
    """WANDB_MODE wins; unset, online (W&B's default) when an API key is configured, offline when none is."""
    from es_ray.runtime.tracking import WandbBackend

    monkeypatch.setenv("HOME", str(tmp_path))  # where `wandb login` keeps the key (~/.netrc)
    assert WandbBackend.mode() == "offline"  # the fixture's WANDB_MODE
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert WandbBackend.mode() == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    assert WandbBackend.mode() == "offline"  # no key anywhere
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert WandbBackend.mode() is None  # `wandb login` ran: online
    (tmp_path / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert WandbBackend.mode() is None


def _convert(primary: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    if primary == "es_train":
        from es_ray.es.config import register_configs as register, to_train_config as convert
    elif primary == "grpo_train":
        from es_ray.grpo.config import register_configs as register, to_grpo_config as convert
    elif primary == "es_eval":
        from es_ray.evaluation.config import register_configs as register, to_eval_config as convert
    else:
        from es_ray.launch.compare.run import register_configs as register, to_compare_config as convert
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return convert(compose(config_name=primary, overrides=overrides + ["run.dir=/tmp/tracking-check"]))


ENTRY_POINTS = ("es_train", "grpo_train", "es_eval", "es_compare")


@pytest.mark.parametrize("primary", ENTRY_POINTS)
def test_every_entry_point_takes_and_checks_run_trackers(primary, monkeypatch):
    assert _convert(primary, ["run.trackers=[tensorboard,wandb,mlflow]"]).run.trackers == [
        "tensorboard",
        "wandb",
        "mlflow",
    ]
    assert _convert(primary, []).run.trackers == ["tensorboard"]
    with pytest.raises(ConfigError, match="run.trackers='nope'"):
        _convert(primary, ["run.trackers=[nope]"])
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"pip install 'es-ray\[wandb\]'"):
        _convert(primary, ["run.trackers=[wandb]"])


# -- es-eval and es-compare summaries ----------------------------------------------------------------------------


def test_eval_and_compare_summaries_use_names_every_backend_takes():
    from es_ray.evaluation.es_eval import tracker_metrics as eval_metrics
    from es_ray.launch.compare.run import tracker_metrics as compare_metrics

    task = {"pass@k": {"1": 0.25, "4": 0.5}, "maj@k": None, "mean_reward": 0.3, "entropy": {"mean_per_token": 0.7}}
    out = eval_metrics(
        {
            "tasks": {"math500": task},
            "entropy": {"mean_per_token": 0.7},
            "tokens_generated": 9,
            "timing_s": {"total": 1.5},
        }
    )
    assert out == {
        "eval/math500/pass_at_1": 0.25,
        "eval/math500/pass_at_4": 0.5,
        "eval/math500/mean_reward": 0.3,
        "eval/math500/entropy": 0.7,
        "eval/entropy": 0.7,
        "eval/tokens": 9,
        "timing_s/total": 1.5,
    }
    method = {
        "average": {"1": 0.25},
        "entropy": {"mean_per_token": 0.5},
        "drift": {"l2": 0.1},
        "ledger": {"tokens_generated": 100, "wall_s": 3.0, "peak_gpu_bytes_max": None},
    }
    out = compare_metrics({"methods": {"es": method, "base": {**method, "drift": None, "ledger": None}}})
    assert out == {
        "compare/es/pass_at_1": 0.25,
        "compare/es/entropy": 0.5,
        "compare/es/drift_l2": 0.1,
        "compare/es/tokens_generated": 100,
        "compare/es/wall_s": 3.0,
        "compare/base/pass_at_1": 0.25,
        "compare/base/entropy": 0.5,
    }


def test_es_eval_logs_its_summary_once_with_the_config(tiny_model_dir, tmp_path):
    from es_ray.evaluation.es_eval import run

    cfg = _convert(
        "es_eval",
        [
            f"model.path={tiny_model_dir}",
            "eval.tasks=[math500,csqa]",
            "eval.n=2",
            "eval.k=[1,2]",
            "eval.limit=2",
            "eval.max_new_tokens=4",
            f"eval.data_dir={FIXTURES}",
            "cluster.num_actors=0",
            "run.progress=false",
            "run.trackers=[wandb,mlflow]",
        ],
    )
    cfg.run.dir = str(tmp_path)
    results = run(cfg)
    names = {f"eval/{t}/{m}" for t in ("math500", "csqa") for m in ("pass_at_1", "pass_at_2", "mean_reward")}
    for history, params in (wandb_history(tmp_path), mlflow_history(tmp_path)):
        assert names <= set(history) and all(len(steps) == 1 and steps[0][0] == 0 for steps in history.values())
        for t in ("math500", "csqa"):
            assert history[f"eval/{t}/pass_at_1"] == [(0, pytest.approx(results["tasks"][t]["pass@k"]["1"]))]
        assert str(params["eval.limit"]) == "2"


# -- a tiny ES run on Ray ----------------------------------------------------------------------------------------


@pytest.mark.ray
def test_tiny_es_run_lands_in_every_tracker(ray_local, tiny_model_dir, tmp_path):
    from helpers import tiny_cfg

    from es_ray.es.driver import run

    run_dir = tmp_path / "es"
    run(tiny_cfg(tiny_model_dir, run_dir, es__iterations=2, run__trackers=["tensorboard", "wandb", "mlflow"]))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    names = {"reward/mean", "reward/std", "es/update_norm", "perf/tokens_per_s", "timing_s/generate"}
    expected = {k: [(t, pytest.approx(float(rows[t][k]))) for t in (0, 1)] for k in names}
    wb, config = wandb_history(run_dir)
    ml, params = mlflow_history(run_dir)
    tb = tensorboard_history(run_dir)
    for got in (wb, ml, tb):
        assert {k: got[k] for k in names} == expected
    assert set(wb) == set(ml) == set(tb)  # the same names everywhere
    assert config["es.iterations"] == 2 and params["es.iterations"] == "2"
    assert config["run.seed"] == 3 and params["model.path"] == str(tiny_model_dir)


# -- progress bars -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task, shown", [("arithmetic", "heldout_reward=0.750"), ("gsm8k", "heldout_pass@1=0.500")])
def test_progress_names_what_it_shows_and_a_resumed_run_counts_from_its_start(
    tmp_path, capsys, monkeypatch, task, shown
):
    """On a terminal: the bar shows the task's moving held-out metric (the reward where it is dense)."""
    import dataclasses

    monkeypatch.setattr("es_ray.runtime.tracking.on_terminal", lambda: True)
    cfg = ESTrainConfig()
    cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, name=task))
    tracker = Tracker(tmp_path, 4, cfg, [], progress=True, start=2)
    tracker.log(2, {"reward/mean": 0.25, "eval/reward": 0.75, "eval/pass_at_1": 0.5})
    tracker.log(3, {"reward/mean": 0.3})  # no evaluation this step: the last held-out value stays shown
    tracker.close()
    err = capsys.readouterr().err.replace("\r", "\n").splitlines()
    assert not [line for line in err if "1/4" in line or "0/4" in line], err
    last = [line for line in err if "4/4" in line][-1]
    assert "train_reward=0.300" in last and shown in last and "mean=" not in last, last


def test_the_bar_shows_the_members_done_within_an_iteration_and_plain_lines_do_not(tmp_path, capsys, monkeypatch):
    """On a terminal the bar moves within an iteration (members scored, beside the metrics) and drops the position
    once the iteration is logged; without one, a position prints nothing (one line a step stays one line)."""
    monkeypatch.setattr("es_ray.runtime.tracking.on_terminal", lambda: True)
    tracker = Tracker(tmp_path, 2, ESTrainConfig(), [], progress=True)
    assert tracker.bar
    tracker.held_out(-1, {"eval/reward": 0.5, "eval/pass_at_1": 0.25})
    tracker.position(3, 8, "members")
    mid = capsys.readouterr().err.replace("\r", "\n").splitlines()[-1]
    assert "members=3/8" in mid and "heldout_reward=0.500" in mid and "0/2" in mid, mid
    tracker.log(0, {"reward/mean": 0.25})
    tracker.close()
    last = capsys.readouterr().err.replace("\r", "\n").splitlines()
    last = [line for line in last if "1/2" in line][-1]
    assert "members" not in last and "train_reward=0.250" in last, last

    monkeypatch.setattr("es_ray.runtime.tracking.on_terminal", lambda: False)
    (tmp_path / "plain").mkdir()
    plain = Tracker(tmp_path / "plain", 2, ESTrainConfig(), [], progress=True)
    assert not plain.bar
    plain.position(3, 8, "members")
    plain.log(0, {"reward/mean": 0.25})
    plain.close()
    out = capsys.readouterr()
    assert "members" not in out.out + out.err and len(out.out.splitlines()) == 1, out


def test_es_eval_and_es_drift_show_progress(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """On a terminal (stderr's isatty, which capsys replaces, taken as true) both draw their bars; a log file gets
    none (tests/runtime/test_hints.py)."""
    from es_ray.evaluation.es_drift import run_drift
    from es_ray.runtime import tracking

    monkeypatch.setattr(tracking, "on_terminal", lambda: True)
    from es_ray.evaluation.config import to_drift_config
    from es_ray.evaluation.es_eval import run

    cfg = _convert(
        "es_eval",
        [
            f"model.path={tiny_model_dir}",
            "eval.tasks=[math500,csqa]",
            "eval.n=1",
            "eval.k=[1]",
            "eval.limit=2",
            "eval.max_new_tokens=2",
            f"eval.data_dir={FIXTURES}",
            "cluster.num_actors=0",
            "run.progress=true",
            "run.trackers=[]",
        ],
    )
    cfg.run.dir = str(tmp_path / "eval")
    run(cfg)
    err = capsys.readouterr().err.replace("\r", "\n")
    assert "es-eval: 100%" in err and "4/4 [" in err and "problem" in err and "task=" in err, err[-2000:]
    run_drift(
        to_drift_config(
            {
                "base": str(tiny_model_dir),
                "tuned": str(tiny_model_dir),
                "run": {"dir": str(tmp_path / "drift"), "progress": True},
            }
        )
    )
    err = capsys.readouterr().err.replace("\r", "\n")
    assert "es-drift: 100%" in err and "tensor" in err, err[-2000:]
