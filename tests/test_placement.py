"""Placement groups for the ES actors: the fit check's arithmetic and messages, the options per rank, the early
failure of `es-train` on a cluster too small for it, and the config keys."""

from __future__ import annotations

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


@pytest.mark.parametrize("key, value", [("placement", "strict"), ("wait_for_resources_s", -1.0),
                                        ("worker_niceness", -1), ("worker_niceness", 20)])
def test_bad_cluster_keys_are_refused(key, value):
    cfg = ESTrainConfig(cluster=ClusterConfig(**{key: value}))
    with pytest.raises(ConfigError, match=f"cluster.{key}"):
        validate(cfg)


@pytest.mark.ray
@pytest.mark.parametrize("ray_address", [None, "local"])
def test_a_local_ray_runs_its_actors_at_the_niceness_asked(ray_address):
    """cluster.worker_niceness reaches the raylet connect() starts (Ray's own default would be 15), with RAY_ADDRESS
    unset or "local" (both start a new Ray). A process of its own: connect() joins nothing and this module's
    ray_local may be running. Niceness adds to the driver's, which the kernel caps at 19."""
    code = ("import os, ray\n"
            "from es_ray.core.config import ClusterConfig\n"
            "from es_ray.runtime.cluster import connect\n"
            "connect(ClusterConfig(num_cpus=1, worker_niceness=3))\n"
            "nice = ray.get(ray.remote(num_cpus=0)(lambda: os.nice(0)).remote())\n"
            "ray.shutdown()\n"
            "print(os.nice(0), nice)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_worker_niceness")}
    env.update({"RAY_ADDRESS": ray_address} if ray_address else {})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    driver, actor = map(int, out.stdout.split()[-2:])
    assert actor == min(19, driver + 3)


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
        ["es-train", f"model.path={tiny_model_dir}", "cluster.num_actors=64", "es.population=64",
         "cluster.gpus_per_actor=1",
         "cluster.num_cpus=2", "engine.device=cpu", "es.iterations=1", f"run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert re.search(r"cluster.num_actors=64 x cluster.gpus_per_actor=1 needs 64 GPUs; the cluster has \d+ on 1 node",
                     res.stderr), res.stderr[-2000:]
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip(), "an iteration ran"
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.ray
def test_waiting_for_an_autoscaler_gives_up_with_the_numbers(ray_local):
    from es_ray.runtime.placement import place

    with pytest.raises(ConfigError, match=r"not reserved within 1 s: .*needs 3 CPUs; the cluster has 2"):
        place(cluster(num_actors=3, cpus_per_actor=1, wait_for_resources_s=1.0))
