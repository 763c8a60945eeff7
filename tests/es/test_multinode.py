"""ES across the nodes of Ray's multi-node test cluster (ray.cluster_utils.Cluster: a head without CPUs and two
one-CPU worker nodes on this machine): PACK vs SPREAD placement, and replicas on different nodes that stay
identical bit for bit, equal to a one-actor run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import tiny_cfg
from safetensors.torch import load_file

from es_ray.core.config import ClusterConfig
from paths import TESTS as TESTS_DIR

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    # the actors import the test task (tests/es_test_tasks.py); node processes inherit this environment
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, configure_logging=False, log_to_driver=False)
    yield cluster, [n.node_id for n in nodes]
    ray.shutdown()
    cluster.shutdown()


def _node_of(actor) -> str:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


@pytest.mark.parametrize("strategy, distinct_nodes", [("pack", 1), ("spread", 2)])
def test_pack_fills_one_node_and_spread_uses_both(two_nodes, strategy, distinct_nodes):
    import ray

    from es_ray.runtime.placement import place

    @ray.remote
    class Probe:
        pass

    # half a CPU each: both bundles fit on one node, so only the strategy decides
    placement = place(ClusterConfig(num_actors=2, cpus_per_actor=0.5, placement=strategy), "probe")
    try:
        actors = [Probe.options(**placement.options(rank)).remote() for rank in range(2)]
        nodes = {_node_of(a) for a in actors}
        assert len(nodes) == distinct_nodes and nodes <= set(two_nodes[1])
    finally:
        placement.release()
        _wait_all_cpus_free()


def _wait_all_cpus_free(timeout: float = 30.0) -> None:
    """A removed placement group frees its resources asynchronously; the next placement must see them free."""
    import time

    import ray

    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0):
        assert time.monotonic() < deadline, f"resources still held: {ray.available_resources()}"
        time.sleep(0.2)


def test_es_actors_on_two_nodes_stay_bit_identical(two_nodes, tiny_model_dir, tmp_path):
    from es_ray.es.driver import run, start_workers
    from es_ray.es.recovery import Replicas, ResumePoint
    from es_ray.runtime.placement import place

    small = dict(es__iterations=2, es__prompts_per_iteration=4)
    cfg = tiny_cfg(tiny_model_dir, tmp_path / "spread", cluster__num_actors=2, cluster__placement="spread", **small)
    placement = place(cfg.cluster, "es")
    workers, _ = start_workers(cfg, Replicas(tmp_path, None, ResumePoint()), placement=placement)
    assert sorted(_node_of(w) for w in workers) == sorted(two_nodes[1]), "the two actors share a node"
    workers.kill()
    placement.release()
    _wait_all_cpus_free()

    spread = run(cfg)
    one = run(tiny_cfg(tiny_model_dir, tmp_path / "one", cluster__num_actors=1, **small))
    rows = [json.loads(x) for x in (tmp_path / "spread" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["es/checksums_verified"] for r in rows)  # compared across nodes every iteration
    w2 = load_file(Path(spread["final_checkpoint"]) / "model.safetensors")
    w1 = load_file(Path(one["final_checkpoint"]) / "model.safetensors")
    base = load_file(Path(tiny_model_dir) / "model.safetensors")
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert any(not torch.equal(w2[k], base[k].float()) for k in w2), "training did not change the weights"


def test_node_lost_on_a_full_cluster_stops_cleanly_with_a_checkpoint_from_a_live_actor(
    two_nodes, tiny_model_dir, tmp_path, capsys
):
    """Both one-CPU nodes hold an actor (no spare capacity). The node of actor 0 is removed after the first
    iteration: its replacement cannot be placed, so within faults.placement_timeout_s the run stops, actor 1 (alive)
    writes the checkpoint of the committed iterations, and the message gives the resume command."""
    import threading
    import time

    import ray

    import es_ray.es.driver as driver
    from es_ray.es.state import SeedLog
    from es_ray.runtime.checkpoint import verify_dir

    cluster, _ = two_nodes
    cfg = tiny_cfg(
        tiny_model_dir,
        tmp_path,
        cluster__num_actors=2,
        cluster__placement="spread",
        es__iterations=8,
        es__prompts_per_iteration=4,
        faults__actor_delay_s=1.0,
        faults__placement_timeout_s=3.0,
    )
    groups, removed = [], {}
    start_workers = driver.start_workers

    def recording(*args, **kw):
        group, infos = start_workers(*args, **kw)
        groups.append(group)
        return group, infos

    def remove_actor_0_node():
        log = tmp_path / "seed_log.jsonl"
        while not (groups and log.is_file() and log.read_text().count("\n") >= 1):
            time.sleep(0.1)
        node_id = _node_of(groups[0][0])
        node = next(n for n in cluster.list_all_nodes() if n.node_id == node_id)
        cluster.remove_node(node)
        removed["at"] = time.monotonic()

    remover = threading.Thread(target=remove_actor_0_node, daemon=True)
    driver.start_workers = recording
    try:
        remover.start()
        with pytest.raises(SystemExit) as stop:
            driver.run(cfg)
    finally:
        driver.start_workers = start_workers
        remover.join(timeout=60)
        cluster.add_node(num_cpus=1)  # the next tests get two nodes again
        cluster.wait_for_nodes()
    took = time.monotonic() - removed["at"]
    out = capsys.readouterr().out
    assert stop.value.code == 75, out[-3000:]
    assert took < 90, f"the run took {took:.0f} s to stop after the node was lost"
    done = len(SeedLog.read(tmp_path / "seed_log.jsonl"))
    assert 1 <= done < 8
    verify_dir(tmp_path / "checkpoints" / f"iter_{done:06d}")
    assert "could not be placed within faults.placement_timeout_s=3 s" in out
    assert f"Continue with: es-train run.resume=true run.dir={tmp_path}" in out
    assert not any(p.name.startswith(".") for p in (tmp_path / "checkpoints").iterdir())
    assert ray.is_initialized()
