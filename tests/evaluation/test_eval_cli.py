"""es-eval and es-drift as subprocesses (the real CLIs), plus their Hydra presets."""

from __future__ import annotations

import json
import os
import subprocess
import types
from pathlib import Path

import pytest


from es_ray.evaluation.config import DriftJobConfig, EvalJobConfig, register_configs, validate_drift, validate_eval

from es_ray.core.config import ConfigError, to_config
from es_ray.tasks import EVAL_TASKS
from paths import FIXTURES, REPO

CONF_DIR = REPO / "conf"
ALL_TASKS = f"eval.tasks=[{','.join(EVAL_TASKS)}]"  # the paper's eight, gated GPQA included (local fixtures)
TINY = [
    "eval.n=2",
    "eval.k=[1,2]",
    "eval.limit=2",
    "eval.max_new_tokens=8",
    f"eval.data_dir={FIXTURES}",
    "run.progress=false",
    ALL_TASKS,
]


def cli(prog: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([prog, *args], capture_output=True, text=True, timeout=timeout, env=env)


# -- presets and validation --------------------------------------------------------------------------------


def _compose(name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def test_es_eval_preset_composes_with_overrides():
    cfg = _compose(
        "es_eval",
        [
            "eval.tasks=[gpqa,math500]",
            "eval.n=4",
            "eval.k=[1,4]",
            "+eval.paths.gpqa=/x.jsonl",
            "cluster.num_actors=2",
            "engine.name=hf",
        ],
    )
    ev = to_config(cfg, EvalJobConfig)
    assert isinstance(ev, EvalJobConfig)
    assert ev.eval.tasks == ["gpqa", "math500"] and ev.eval.k == [1, 4] and ev.eval.paths == {"gpqa": "/x.jsonl"}
    assert validate_eval(ev) is ev
    default = to_config(_compose("es_eval", []), EvalJobConfig)
    assert default.eval.tasks == [t for t in EVAL_TASKS if t != "gpqa"]  # gated on the Hub: not by default
    assert default.eval.k == [1, 16, 32] and default.eval.n >= 32
    validate_eval(default)


def test_es_drift_preset_composes():
    cfg = to_config(
        _compose("es_drift", ["base=/a", "tuned=/b", "thresholds=[0.001]", "run.dir=/tmp/x"]), DriftJobConfig
    )
    assert (cfg.base, cfg.tuned, cfg.thresholds, cfg.run.dir) == ("/a", "/b", [0.001], "/tmp/x")
    assert validate_drift(cfg) is cfg
    with pytest.raises(ConfigError, match="tuned="):
        validate_drift(DriftJobConfig())


@pytest.mark.parametrize(
    "change,key",
    [
        ({"n": 2, "k": [1, 4]}, "eval.n"),
        ({"k": []}, "eval.k"),
        ({"k": [0]}, "eval.k"),
        ({"tasks": ["nope"]}, "eval.tasks"),
        ({"tasks": []}, "eval.tasks"),
        ({"temperature": 0.0, "n": 4, "k": [1]}, "eval.temperature"),
        ({"limit": -1}, "eval.limit"),
        ({"paths": {"mbpp": "/x"}, "tasks": ["gpqa"]}, "eval.paths"),
    ],
)
def test_validate_eval_refuses_naming_the_key(change, key):
    cfg = EvalJobConfig()
    for k, v in change.items():
        setattr(cfg.eval, k, v)
    with pytest.raises(ConfigError) as info:
        validate_eval(cfg)
    assert key in str(info.value)


def test_greedy_single_sample_is_allowed():
    cfg = EvalJobConfig()
    cfg.eval.temperature, cfg.eval.n, cfg.eval.k = 0.0, 1, [1]
    assert validate_eval(cfg) is cfg


@pytest.mark.parametrize(
    "args,expected",
    [
        (["eval.n=2", "eval.k=[1,4]"], "eval.n"),
        (["eval.tasks=[nope]"], "eval.tasks"),
        (["run.dir=relative/dir"], "run.dir"),
        (["model.path=/nonexistent/model"], "model.path"),
        (
            ["eval.tasks=[gpqa]", "+eval.paths.gpqa=/nonexistent/gpqa.jsonl"],
            "eval.paths.gpqa='/nonexistent/gpqa.jsonl' does not exist",
        ),
    ],
)
def test_es_eval_refuses_bad_input_before_any_work(args, expected, tmp_path):
    extra = [] if any(a.startswith("run.dir") for a in args) else [f"run.dir={tmp_path / 'run'}"]
    res = cli("es-eval", *args, *extra, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert expected in res.stderr
    assert not (tmp_path / "run" / "results.json").exists()


# -- end to end ----------------------------------------------------------------------------------------------


def _check_results(run_dir: Path, n: int, ks: list[int], limit: int) -> dict:
    results = json.loads((run_dir / "results.json").read_text())
    assert list(results["tasks"]) == list(EVAL_TASKS)
    for name, t in results["tasks"].items():
        assert t["problems"] == limit and t["n"] == n, name
        assert set(t["pass@k"]) == {str(k) for k in ks}
        assert all(0.0 <= v <= 1.0 for v in t["pass@k"].values())
        if name in ("mbpp", "countdown"):
            assert t["maj@k"] is None  # no canonical answer to vote on
        else:
            assert set(t["maj@k"]) == {str(k) for k in ks}
        assert t["skipped_rows"] >= 1  # every fixture has a malformed row
        assert set(t["grader_failures"]) >= {"timeout", "crash", "error"}
        assert t["tokens"]["generated"] > 0
        assert t["entropy"]["mean_per_token"] > 0 and t["entropy_t1"]["mean_per_token"] > 0
        assert Path(t["source"]).parent == FIXTURES
        if name in ("math500", "aime24", "aime25", "amc23"):  # strict boxed answers, with their format counts
            assert set(t["answer_checks"]) == {"correct_without_box", "correct_restating", "pass@k_without_them"}
    assert results["entropy"]["mean_per_token"] > 0
    temps = results["settings"]["entropy_temperatures"]
    assert temps[-1] == 1.0 and (len(temps) == 1) == (results["settings"]["temperature"] in (0, 1.0))
    if len(temps) == 2:  # sampled below T = 1: the sampling distribution is the sharper one
        assert results["entropy"]["mean_per_token"] < results["entropy_t1"]["mean_per_token"]
    assert results["sandbox"]["network"]
    md = (run_dir / "results.md").read_text()
    for name in EVAL_TASKS:
        assert f"| {name} |" in md
    assert "pass@1" in md and "maj@1" in md
    lines = (run_dir / "samples.jsonl").read_text().splitlines()
    assert len(lines) == len(EVAL_TASKS) * limit * n
    return results


def _samples(run_dir: Path) -> list[tuple]:
    rows = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    return [(r["task"], r["problem"], r["sample"], r["text"], r["score"]) for r in rows]


def test_es_eval_on_the_tiny_model_runs_every_eval_task_from_fixtures(tiny_model_dir, tmp_path):
    """All eight evaluation sets from local files, generation spread over two Ray actors; the same run in one
    process gives the same samples (each chunk has its own seed)."""
    ray_dir, local_dir = tmp_path / "ray", tmp_path / "local"
    res = cli(
        "es-eval",
        f"model.path={tiny_model_dir}",
        *TINY,
        "cluster.num_actors=2",
        "engine.batch_size=4",
        f"run.dir={ray_dir}",
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert "| gpqa |" in res.stdout
    results = _check_results(ray_dir, n=2, ks=[1, 2], limit=2)
    assert results["settings"]["actors"] == 2
    res = cli(
        "es-eval",
        f"model.path={tiny_model_dir}",
        *TINY,
        "cluster.num_actors=0",
        "engine.batch_size=4",
        f"run.dir={local_dir}",
    )
    assert res.returncode == 0, res.stderr[-4000:]
    _check_results(local_dir, n=2, ks=[1, 2], limit=2)
    assert _samples(ray_dir) == _samples(local_dir)


def test_one_actor_on_this_machine_is_replaced_by_this_process(monkeypatch):
    """in_process_reason: one chunk (or cluster.num_actors=1) for a local, not yet started Ray on CPU with the
    transformers engine runs in this process; more chunks than one actor, a cluster address, GPUs or vLLM keep
    the actors."""
    import sys

    from es_ray.evaluation.es_eval import in_process_reason
    from es_ray.evaluation.worker import Chunk

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setitem(sys.modules, "ray", None)  # no Ray imported, so none running (whatever ran before this test)
    one, two = [Chunk("gsm8k", 0, (0, 1), 1)], [Chunk("gsm8k", 0, (0,), 1), Chunk("gsm8k", 1, (1,), 2)]

    def reason(chunks, engine="hf", **cluster):
        cfg = EvalJobConfig()
        cfg.engine.name = engine
        for key, value in cluster.items():
            setattr(cfg.cluster, key, value)
        return in_process_reason(cfg, chunks)

    assert "one chunk" in reason(one, num_actors=2) and "no local Ray" in reason(one, num_actors=2)
    assert "cluster.num_actors=1" in reason(two, num_actors=1)
    assert reason(two, num_actors=0) == "cluster.num_actors=0"
    assert reason(two, num_actors=2) == ""  # two actors each take a chunk
    assert reason(one, num_actors=2, address="auto")  # a local Ray too (runtime.cluster.LOCAL_ADDRESSES)
    assert reason(one, num_actors=2, address="127.0.0.1:9") == ""  # an existing cluster (a closed loopback port)
    assert reason(one, num_actors=2, gpus_per_actor=1.0) == ""
    assert reason(one, engine="vllm", num_actors=2) == ""
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")
    assert reason(one, num_actors=2) == ""
    monkeypatch.delenv("RAY_ADDRESS")

    class Running:  # a Ray already running in this process (es-compare's driver between its training stages)
        node = types.SimpleNamespace(head=True)  # ray._private.worker._global_node: init started it here
        _private = types.SimpleNamespace(worker=types.SimpleNamespace(_global_node=node))
        alive = 1

        @staticmethod
        def is_initialized():
            return True

        @staticmethod
        def nodes():
            return [{"Alive": True}] * Running.alive + [{"Alive": False}]  # a node that died does not count

    monkeypatch.setitem(sys.modules, "ray", Running)
    assert "one-node Ray this process started" in reason(one, num_actors=2)  # no actor process and its imports
    assert "cluster.num_actors=1" in reason(two, num_actors=1)
    assert reason(two, num_actors=2) == ""
    Running.alive = 2  # another node joined: the actors may go there
    assert reason(one, num_actors=2) == ""
    Running.alive, Running.node.head = 1, False  # a Ray joined by address (`ray start` here): its CPUs are shared
    assert reason(one, num_actors=2) == ""


def test_chunks_run_here_put_back_what_the_worker_changed(monkeypatch):
    """es-compare's driver lives on after an evaluation it ran itself: torch's thread count and the grader's pool
    are put back, also when a chunk fails."""
    import torch

    import es_ray.evaluation.es_eval as es_eval
    import es_ray.grading.mathverify as mathverify

    before = torch.get_num_threads()

    class Worker:  # changes what an EvalWorker changes (Actor's threads, configure_default_pool)
        def __init__(self, cfg):
            torch.set_num_threads(before + 1)
            mathverify.configure_default_pool(1, 5.0)

        def run_chunk(self, chunk):
            if chunk == "bad":
                raise RuntimeError("a chunk failed")
            return {"chunk": chunk}

    monkeypatch.setattr(es_eval, "EvalWorker", Worker)
    seen: list = []
    assert es_eval._run_here(EvalJobConfig(), ["a", "b"], seen.append) == [{"chunk": "a"}, {"chunk": "b"}]
    assert seen == ["a", "b"] and torch.get_num_threads() == before and mathverify._default is None
    with pytest.raises(RuntimeError, match="a chunk failed"):
        es_eval._run_here(EvalJobConfig(), ["a", "bad"], seen.append)
    assert torch.get_num_threads() == before and mathverify._default is None


def test_es_eval_with_one_chunk_runs_in_this_process_and_says_so(tiny_model_dir, tmp_path, ray_local):
    """The CLI with cluster.num_actors=2 and one chunk of work: no Ray started, the log line says why, and the
    samples are those an actor gives the same chunk (the test's Ray named by its address keeps the actor path)."""
    from es_ray.evaluation.config import to_eval_config
    from es_ray.evaluation.es_eval import run

    args = {
        "eval": {
            "tasks": ["gsm8k"],
            "paths": {"gsm8k": str(FIXTURES / "gsm8k.jsonl")},
            "n": 2,
            "k": [1, 2],
            "limit": 2,
            "max_new_tokens": 8,
            "entropy": True,
        },
        "engine": {"dtype": "float32", "device": "cpu", "batch_size": 8},
        "cluster": {"num_actors": 2},
    }
    local_dir, ray_dir = tmp_path / "local", tmp_path / "ray"
    res = cli(
        "es-eval",
        f"model.path={tiny_model_dir}",
        "eval.tasks=[gsm8k]",
        f"eval.data_dir={FIXTURES}",
        "eval.n=2",
        "eval.k=[1,2]",
        "eval.limit=2",
        "eval.max_new_tokens=8",
        "engine.dtype=float32",
        "engine.device=cpu",
        "engine.batch_size=8",
        "cluster.num_actors=2",
        "run.progress=false",
        f"run.dir={local_dir}",
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert "es-eval: evaluating in this process (one chunk of work" in res.stdout, res.stdout[-2000:]
    assert "Started a local Ray instance" not in res.stdout + res.stderr
    local = json.loads((local_dir / "results.json").read_text())
    assert local["settings"]["actors"] == 0
    address = ray_local.get_runtime_context().gcs_address  # a cluster named by its address: the actor path
    on_ray = run(
        to_eval_config(
            {
                "model": {"path": str(tiny_model_dir)},
                **args,
                "cluster": {**args["cluster"], "address": address},
                "run": {"dir": str(ray_dir), "progress": False, "trackers": []},
            }
        )
    )
    assert on_ray["settings"]["actors"] == 2
    assert _samples(local_dir) == _samples(ray_dir)
    assert local["tasks"]["gsm8k"]["pass@k"] == on_ray["tasks"]["gsm8k"]["pass@k"]
    assert local["tasks"]["gsm8k"]["entropy"] == on_ray["tasks"]["gsm8k"]["entropy"]


def test_es_drift_between_a_checkpoint_and_a_perturbed_copy(tiny_model_dir, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    tuned = tmp_path / "tuned"
    shutil.copytree(tiny_model_dir, tuned)
    weights = load_file(str(tuned / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for name, t in weights.items():
        if "mlp" in name or "embed" in name:
            weights[name] = t + 1e-3 * torch.randn(t.shape, generator=g)
    save_file(weights, str(tuned / "model.safetensors"), metadata={"format": "pt"})
    root = tmp_path / "runs"  # run.root: a timestamped drift-* directory is made under it
    res = cli("es-drift", f"base={tiny_model_dir}", f"tuned={tuned}", f"run.root={root}", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "total" in res.stdout and "mlp" in res.stdout
    (out,) = root.glob("drift-*")
    report = json.loads((out / "drift.json").read_text())
    by = report["by_module_type"]
    assert by["attention"]["nonzero"] == 0 and by["norm"]["nonzero"] == 0
    assert by["mlp"]["nonzero"] == by["mlp"]["numel"] and by["embedding"]["nonzero"] > 0
    # |N(0, 1e-3^2)| < 1.5e-3 with probability 2 * Phi(1.5) - 1 = 0.866
    assert by["mlp"]["share_below"]["0.0015"] == pytest.approx(0.866, abs=0.02)
    assert report["total"]["l2"] > 0
    assert (out / "drift_hist.png").read_bytes()[:4] == b"\x89PNG"
    res = cli("es-drift", f"base={tiny_model_dir}", f"run.dir={out}", timeout=300)
    assert res.returncode == 2 and "tuned=" in res.stderr


@pytest.mark.slow
def test_es_eval_on_the_default_model(tmp_path):
    """The real SmolLM2-135M-Instruct (model.path empty) over all eight eval tasks, kept tiny: 1 problem each."""
    run_dir = tmp_path / "run"
    res = cli(
        "es-eval",
        ALL_TASKS,
        "eval.n=2",
        "eval.k=[1,2]",
        "eval.limit=1",
        "eval.max_new_tokens=16",
        f"eval.data_dir={FIXTURES}",
        "run.progress=false",
        "cluster.num_actors=1",
        f"run.dir={run_dir}",
    )
    assert res.returncode == 0, res.stderr[-4000:]
    results = _check_results(run_dir, n=2, ks=[1, 2], limit=1)
    assert results["model"].startswith("embedded")
    # a trained model is far from uniform over its 49k-token vocabulary (log 49152 = 10.8 nats)
    assert results["entropy"]["mean_per_token"] < 8
