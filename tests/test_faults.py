"""Injected faults on a local Ray with the tiny model: a killed, hung or corrupted actor, and the run still ends
bit for bit where the same run without the fault ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from es_ray.config import validate

from es_ray.core.config import ConfigError
from es_ray.driver import run
from test_ray_es import tiny_cfg

pytestmark = pytest.mark.ray

ITERATIONS = 4


def faulty_cfg(model_dir, run_dir, **over):
    """Two actors, population 4, a checkpoint every 2 iterations; `over` as in tiny_cfg (section__field)."""
    base = dict(cluster__num_actors=2, es__iterations=ITERATIONS, run__checkpoint_every=2, eval__every=0)
    return tiny_cfg(model_dir, run_dir, **{**base, **over})


def final_weights(summary: dict) -> dict[str, torch.Tensor]:
    return load_file(Path(summary["final_checkpoint"]) / "model.safetensors")


def log_rows(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (run_dir / name).read_text().splitlines()]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ from the run without the fault: {different[:5]}"


def alive_es_actors() -> list:
    """What the run left holding CPUs on the local cluster (every ES actor holds one): empty when all are gone.

    (Ray's state API needs the dashboard, which the test cluster does not start.)"""
    import time

    import ray

    for _ in range(40):  # a killed actor's CPU returns to the pool within a moment
        held = ray.cluster_resources().get("CPU", 0) - ray.available_resources().get("CPU", 0)
        if held <= 0:
            return []
        time.sleep(0.25)
    return [f"{held:g} CPU still held"]


@pytest.fixture(scope="module")
def clean_run(ray_local, tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("clean")
    summary = run(faulty_cfg(tiny_model_dir, run_dir))
    return run_dir, final_weights(summary)


def test_killed_actor_and_odd_replica_are_rebuilt_and_the_run_is_unchanged(clean_run, tiny_model_dir, tmp_path):
    """Actor 0's replica is corrupted after iteration 1 (es.on_mismatch=rebuild: rebuilt in place from the
    initial weights + 2 updates); then it dies mid-evaluation of iteration 3 (replaced: iter_2 + 1 update)."""
    clean_dir, clean = clean_run
    cfg = faulty_cfg(tiny_model_dir, tmp_path, faults__corrupt_replica_at_iteration=1, es__on_mismatch="rebuild",
                     faults__kill_actor_at_iteration=3, faults__kill_actor_phase="evaluate")
    assert_same_weights(final_weights(run(cfg)), clean)
    assert [r["checksum"] for r in log_rows(tmp_path, "seed_log.jsonl")] == \
        [r["checksum"] for r in log_rows(clean_dir, "seed_log.jsonl")]
    rows = log_rows(tmp_path, "metrics.jsonl")
    assert rows[1]["recovery/rebuilds"] == 1 and rows[1]["recovery/replacements"] == 0
    event = rows[3]
    assert event["recovery/replacements"] == 1 and event["recovery/seconds"] > 0
    assert event["recovery/replayed"] == 1
    # no weight crossed the network: what the driver sent is a tiny fraction of the model
    assert 0 < event["recovery/bytes_sent"] < event["recovery/model_bytes"] / 100
    assert not any("recovery/seconds" in r for i, r in enumerate(rows) if i not in (1, 3))
    assert not alive_es_actors(), "actors left running after the run"


def test_actor_killed_in_the_update_and_a_hung_actor_are_replaced(clean_run, tiny_model_dir, tmp_path):
    """Actor 1 dies before applying update 1 (rebuilt from the initial weights + update 0, then given update 1);
    at iteration 2 it hangs and is killed after faults.actor_timeout_s."""
    cfg = faulty_cfg(tiny_model_dir, tmp_path, faults__kill_actor_at_iteration=1, faults__kill_actor_phase="update",
                     faults__hang_actor_at_iteration=2, faults__actor_rank=1, faults__actor_timeout_s=8.0)
    assert_same_weights(final_weights(run(cfg)), clean_run[1])
    rows = log_rows(tmp_path, "metrics.jsonl")
    assert rows[1]["recovery/replacements"] == 1 and rows[1]["recovery/replayed"] == 1
    assert rows[2]["recovery/replacements"] >= 1 and rows[2]["timing_s/iteration"] >= 8.0
    assert not alive_es_actors()


@pytest.mark.parametrize("over, key", [
    ({"faults__kill_actor_at_iteration": 9}, "faults.kill_actor_at_iteration"),
    ({"faults__corrupt_replica_at_iteration": -2}, "faults.corrupt_replica_at_iteration"),
    ({"faults__actor_rank": 2}, "faults.actor_rank"),
    ({"faults__kill_actor_phase": "generate"}, "faults.kill_actor_phase"),
    ({"faults__hang_actor_at_iteration": 1, "faults__actor_timeout_s": 0.0}, "faults.actor_timeout_s"),
    ({"es__on_mismatch": "ignore"}, "es.on_mismatch"),
    ({"run__resume": True, "run__dir": ""}, "run.resume"),
])
def test_bad_fault_settings_are_refused_naming_the_key(tiny_model_dir, tmp_path, over, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        faulty_cfg(tiny_model_dir, tmp_path, **over)
    assert validate(faulty_cfg(tiny_model_dir, tmp_path))  # the same settings without the bad one are fine
