"""Placement groups for the ES actors: the fit check's arithmetic and messages, the options per rank, the early
failure of `es-train` on a cluster too small for it, and the config keys."""

from __future__ import annotations

import ast
import contextlib
import os
import re
import subprocess
import sys

import pytest

from es_ray.es.config import ESTrainConfig, validate

from es_ray.core.config import ClusterConfig, ConfigError, RunConfig
from es_ray.runtime.placement import fit_problem, needs

GPU_NODE = {"CPU": 16.0, "GPU": 1.0}
HEAD = {"CPU": 8.0}


def cluster(**kw) -> ClusterConfig:
    return ClusterConfig(**{"num_actors": 2, "cpus_per_actor": 1.0, "gpus_per_actor": 0.0, **kw})


def test_needs_counts_per_actor_and_drops_zero_resources():
    need = needs(cluster(num_actors=8, gpus_per_actor=1, cpus_per_actor=4))
    assert need.bundle == {"CPU": 4.0, "GPU": 1.0}
    assert need.total == {"CPU": 32.0, "GPU": 8.0}
    assert needs(cluster(cpus_per_actor=0)).bundle == {}


def test_too_few_gpus_says_how_many_it_needs_and_has():
    msg = fit_problem(needs(cluster(num_actors=8, gpus_per_actor=1)), [HEAD, GPU_NODE, GPU_NODE])
    assert "cluster.num_actors=8 x cluster.gpus_per_actor=1 needs 8 GPUs" in msg
    assert "the cluster has 2 on 3 node(s)" in msg
    assert "cluster.wait_for_resources_s" in msg


def test_too_few_cpus_is_reported_as_cpus():
    msg = fit_problem(needs(cluster(num_actors=4, cpus_per_actor=2)), [{"CPU": 2.0}])
    assert "needs 8 CPUs; the cluster has 2" in msg


def test_an_actor_larger_than_any_node_is_refused_even_when_the_total_fits():
    msg = fit_problem(needs(cluster(num_actors=1, gpus_per_actor=2)), [GPU_NODE, GPU_NODE])
    assert "cluster.gpus_per_actor=2: each actor needs that many GPUs on one node; the largest node has 1" in msg


def test_a_driver_with_extra_actors_counts_them():
    msg = fit_problem(needs(cluster(num_actors=4, gpus_per_actor=1), count=5), [GPU_NODE] * 4)
    assert "5 actors (cluster.num_actors=4 + 1) x cluster.gpus_per_actor=1 needs 5 GPUs; the cluster has 4" in msg


def test_fitting_requests_pass():
    eight = needs(cluster(num_actors=8, gpus_per_actor=1, cpus_per_actor=4))
    assert fit_problem(eight, [HEAD, {"CPU": 96, "GPU": 8}]) == ""
    assert fit_problem(needs(cluster(num_actors=2, gpus_per_actor=0.5)), [GPU_NODE]) == ""


@pytest.mark.parametrize(
    "key, value",
    [("placement", "strict"), ("wait_for_resources_s", -1.0), ("worker_niceness", -1), ("worker_niceness", 20)],
)
def test_bad_cluster_keys_are_refused(key, value):
    cfg = ESTrainConfig(cluster=ClusterConfig(**{key: value}))
    with pytest.raises(ConfigError, match=f"cluster.{key}"):
        validate(cfg)


@pytest.mark.ray
@pytest.mark.parametrize("ray_address", [None, "local"])
def test_a_local_ray_gives_its_actors_the_niceness_and_variables_asked(ray_address):
    """cluster.worker_niceness reaches the raylet connect() starts (Ray's own default would be 15), with RAY_ADDRESS
    unset or "local" (both start a new Ray), and so do the actors' variables (runtime_env's, passed through the
    raylet's environment: a job runtime_env would keep the raylet from handing actors its prestarted workers),
    while the driver's own environment is as it was. A process of its own: connect() joins nothing and this
    module's ray_local may be running. Niceness adds to the driver's, which the kernel caps at 19."""
    code = (
        "import os, ray\n"
        "from es_ray.core.config import ClusterConfig\n"
        "from es_ray.runtime.cluster import connect\n"
        "connect(ClusterConfig(num_cpus=1, worker_niceness=3))\n"
        "seen = lambda: (os.nice(0), os.environ.get('TOKENIZERS_PARALLELISM'), os.environ.get('ES_RAY_QUIET'))\n"
        "actor = ray.get(ray.remote(num_cpus=0)(seen).remote())\n"
        "ray.shutdown()\n"
        "print(repr((seen(), actor)))\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RAY_ADDRESS", "RAY_worker_niceness", "TOKENIZERS_PARALLELISM", "ES_RAY_QUIET")
    }
    env.update({"RAY_ADDRESS": ray_address} if ray_address else {})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    driver, actor = ast.literal_eval(out.stdout.splitlines()[-1])
    assert actor[0] == min(19, driver[0] + 3)
    assert actor[1:] == ("false", "1") and driver[1:] == (None, None)


def test_run_root_must_be_absolute():
    with pytest.raises(ConfigError, match="run.root"):
        validate(ESTrainConfig(run=RunConfig(root="relative/runs")))


@pytest.mark.ray
def test_options_place_each_rank_in_its_own_bundle(ray_local):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from es_ray.runtime.placement import place

    placement = place(cluster(num_actors=2, cpus_per_actor=0.5, placement="spread"), "test", count=3)
    try:
        opts = [placement.options(rank) for rank in range(3)]
        assert all(isinstance(o["scheduling_strategy"], PlacementGroupSchedulingStrategy) for o in opts)
        assert [o["scheduling_strategy"].placement_group_bundle_index for o in opts] == [0, 1, 2]
        assert opts[0]["num_cpus"] == 0.5 and opts[0]["num_gpus"] == 0.0
        assert placement.group.bundle_specs == [{"CPU": 0.5}] * 3
        with pytest.raises(ValueError, match="rank 3"):
            placement.options(3)
    finally:
        placement.release()
    assert placement.group is None


@pytest.mark.ray
def test_a_cluster_too_small_fails_before_any_actor_starts(ray_local):
    from es_ray.runtime.placement import place

    with pytest.raises(ConfigError, match=r"needs 64 GPUs; the cluster has \d+ on 1 node"):
        place(cluster(num_actors=64, gpus_per_actor=1))


@pytest.mark.ray
def test_es_train_on_a_cluster_with_too_few_gpus_fails_early_with_the_numbers(tmp_path, tiny_model_dir):
    res = subprocess.run(
        [
            "es-train",
            f"model.path={tiny_model_dir}",
            "cluster.num_actors=64",
            "es.population=64",
            "cluster.gpus_per_actor=1",
            "cluster.num_cpus=2",
            "engine.device=cpu",
            "es.iterations=1",
            f"run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert re.search(
        r"cluster.num_actors=64 x cluster.gpus_per_actor=1 needs 64 GPUs; the cluster has \d+ on 1 node", res.stderr
    ), res.stderr[-2000:]
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip(), "an iteration ran"
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.ray
def test_waiting_for_an_autoscaler_gives_up_with_the_numbers(ray_local):
    from es_ray.runtime.placement import place

    with pytest.raises(ConfigError, match=r"not reserved within 1 s: .*needs 3 CPUs; the cluster has 2"):
        place(cluster(num_actors=3, cpus_per_actor=1, wait_for_resources_s=1.0))


def _connect_seeing(monkeypatch, fail: bool = False) -> list[dict]:
    """connect() with ray.init replaced: each call's keyword arguments and the variables os.environ held then."""
    import ray

    from es_ray.core.config import ClusterConfig
    from es_ray.runtime.cluster import connect

    calls = []

    def init(**kwargs):
        calls.append({**kwargs, "environ": {k: os.environ.get(k) for k in ("TOKENIZERS_PARALLELISM", "ES_RAY_QUIET")}})
        if fail:
            raise RuntimeError("no Ray today")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    from es_ray.core.config import ConfigError

    # a start that fails is one line naming the cause (es_ray.runtime.cluster.ClusterStartError), after one try: it
    # did not time out
    with pytest.raises(ConfigError, match="did not start [(]no Ray today[)]") if fail else contextlib.nullcontext():
        connect(ClusterConfig(num_cpus=1), verbose=False)
    return calls


@pytest.mark.parametrize("fail", [False, True])
def test_a_new_local_ray_gets_the_actors_variables_through_the_environment_put_back_after(monkeypatch, fail):
    """No job runtime_env for a Ray connect() starts (it would keep the raylet from handing actors its prestarted
    workers): the variables are in os.environ while ray.init starts the raylet, and the driver's own environment is
    as it was afterwards, a shell's value included, whether ray.init returned or raised."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    monkeypatch.delenv("ES_RAY_QUIET", raising=False)
    (call,) = _connect_seeing(monkeypatch, fail)
    assert call.get("runtime_env") is None and call["_system_config"] == {"worker_niceness": 0}
    assert call["environ"] == {"TOKENIZERS_PARALLELISM": "false", "ES_RAY_QUIET": "1"}
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true" and "ES_RAY_QUIET" not in os.environ


def test_a_joined_cluster_gets_the_actors_variables_as_the_jobs_runtime_env(monkeypatch):
    """RAY_ADDRESS naming a cluster (Ray Jobs' supervisor sets it): its raylets are not this driver's children, so the
    variables go as the job's runtime_env, no system settings, and the driver's environment is left alone."""
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    (call,) = _connect_seeing(monkeypatch)
    assert call["runtime_env"]["env_vars"]["TOKENIZERS_PARALLELISM"] == "false"
    assert call["runtime_env"]["env_vars"]["ES_RAY_QUIET"] == "1" and "_system_config" not in call
    assert call["environ"]["TOKENIZERS_PARALLELISM"] is None


def test_a_verbose_run_clears_a_shells_quiet_flag_for_its_actors():
    from es_ray.runtime.cluster import runtime_env

    assert runtime_env(verbose=True)["env_vars"]["ES_RAY_QUIET"] == "0"
    assert runtime_env(verbose=False)["env_vars"]["ES_RAY_QUIET"] == "1"
