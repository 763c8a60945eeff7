"""Injected faults on a local Ray with the tiny model: a killed, hung or corrupted actor, and the run still ends
bit for bit where the same run without the fault ends."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import alive_es_actors, assert_same_weights, final_weights, log_rows, processes_of, tiny_cfg

from es_ray.es.config import validate

from es_ray.core.config import ConfigError
from es_ray.es.driver import run
from es_ray.runtime.actors import once
from paths import REPO

pytestmark = pytest.mark.ray

ITERATIONS = 4


def faulty_cfg(model_dir, run_dir, **over):
    """Two actors, population 4, a checkpoint every 2 iterations; `over` as in tiny_cfg (section__field)."""
    base = dict(cluster__num_actors=2, es__iterations=ITERATIONS, run__checkpoint_every=2, eval__every=0)
    return tiny_cfg(model_dir, run_dir, **{**base, **over})


@pytest.fixture(scope="module")
def clean_run(ray_local, tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("clean")
    summary = run(faulty_cfg(tiny_model_dir, run_dir))
    return run_dir, final_weights(summary)


def test_killed_actor_and_odd_replica_are_rebuilt_and_the_run_is_unchanged(clean_run, tiny_model_dir, tmp_path):
    """Actor 0's replica is corrupted after iteration 1 (es.on_mismatch=rebuild: rebuilt in place from the
    initial weights + 2 updates); then it dies mid-evaluation of iteration 3 (replaced: iter_2 + 1 update)."""
    clean_dir, clean = clean_run
    cfg = faulty_cfg(
        tiny_model_dir,
        tmp_path,
        faults__corrupt_replica_at_iteration=1,
        es__on_mismatch="rebuild",
        faults__kill_actor_at_iteration=3,
        faults__kill_actor_phase="evaluate",
    )
    assert_same_weights(final_weights(run(cfg)), clean)
    assert [r["checksum"] for r in log_rows(tmp_path, "seed_log.jsonl")] == [
        r["checksum"] for r in log_rows(clean_dir, "seed_log.jsonl")
    ]
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
    cfg = faulty_cfg(
        tiny_model_dir,
        tmp_path,
        faults__kill_actor_at_iteration=1,
        faults__kill_actor_phase="update",
        faults__hang_actor_at_iteration=2,
        faults__actor_rank=1,
        faults__actor_timeout_s=8.0,
    )
    assert_same_weights(final_weights(run(cfg)), clean_run[1])
    rows = log_rows(tmp_path, "metrics.jsonl")
    assert rows[1]["recovery/replacements"] == 1 and rows[1]["recovery/replayed"] == 1
    assert rows[2]["recovery/replacements"] >= 1 and rows[2]["timing_s/iteration"] >= 8.0
    assert not alive_es_actors()


def test_memory_killed_actor_is_replaced_and_the_run_is_unchanged(clean_run, tiny_model_dir, tmp_path, capsys):
    """Actor 1's evaluation of iteration 1 fails with Ray's OutOfMemoryError (its memory monitor's message): the
    actor is replaced as a dead one is, the log line says what used the memory and which key lowers it, and the
    run ends bit for bit where the undisturbed one does."""
    cfg = faulty_cfg(
        tiny_model_dir, tmp_path, faults__kill_actor_at_iteration=1, faults__kill_actor_by="oom", faults__actor_rank=1
    )
    assert_same_weights(final_weights(run(cfg)), clean_run[1])
    rows = log_rows(tmp_path, "metrics.jsonl")
    assert rows[1]["recovery/replacements"] == 1 and rows[1]["recovery/replayed"] == 1
    out = capsys.readouterr().out
    assert "killed by Ray's memory monitor during evaluate" in out and "cluster.num_actors=" in out
    assert "the killed worker pid" in out and "threshold 0.95" in out
    assert not alive_es_actors()


@pytest.mark.parametrize(
    "over, key",
    [
        ({"faults__kill_actor_at_iteration": 9}, "faults.kill_actor_at_iteration"),
        ({"faults__corrupt_replica_at_iteration": -2}, "faults.corrupt_replica_at_iteration"),
        ({"faults__actor_rank": 2}, "faults.actor_rank"),
        ({"faults__kill_actor_phase": "generate"}, "faults.kill_actor_phase"),
        ({"faults__kill_actor_by": "sigkill"}, "faults.kill_actor_by"),
        ({"faults__hang_actor_at_iteration": 1, "faults__actor_timeout_s": 0.0}, "faults.actor_timeout_s"),
        ({"es__on_mismatch": "ignore"}, "es.on_mismatch"),
        ({"run__resume": True, "run__dir": ""}, "run.resume"),
    ],
)
def test_bad_fault_settings_are_refused_naming_the_key(tiny_model_dir, tmp_path, over, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        faulty_cfg(tiny_model_dir, tmp_path, **over)
    assert validate(faulty_cfg(tiny_model_dir, tmp_path))  # the same settings without the bad one are fine


# -- transient unavailability, the SIGTERM bound -------------------------------------------------------------------


class Flaky:
    """Raises Ray's ActorUnavailableError on its first ``fails`` calls (as a transient network fault does)."""

    def __init__(self, fails: int):
        self.fails, self.calls = fails, 0

    def ready(self) -> dict:
        return {}

    def _answer(self, x):
        import ray

        self.calls += 1
        if self.calls <= self.fails:
            raise ray.exceptions.ActorUnavailableError("transient (test)", None)
        return x, self.calls

    def work(self, x):
        return self._answer(x)

    @once
    def step(self, x):
        return self._answer(x)


def _flaky_group(fails: list[int], retries: int = 2):
    from es_ray.core.config import ClusterConfig, FaultPolicy
    from es_ray.runtime.actors import ActorGroup
    from es_ray.runtime.placement import Placement

    made = iter(fails)  # the first actor fails fails[0] times, its replacement fails[1] times
    return ActorGroup(
        "flaky",
        Flaky,
        1,
        lambda rank: (next(made),),
        Placement(ClusterConfig(num_actors=1, cpus_per_actor=0), None),
        FaultPolicy(unavailable_retries=retries, max_replacements=1),
        log=lambda msg: None,
    )


def test_a_transient_unavailability_is_retried_before_it_counts_as_death(ray_local):
    group = _flaky_group([2, 0])
    assert group.call(0, Flaky.work, "a") == ("a", 3) and group.replacements == 0  # two retries, same actor
    group.kill()
    group = _flaky_group([5, 0])
    assert group.call(0, Flaky.work, "b") == ("b", 1) and group.replacements == 1  # retries spent: replaced
    group.kill()


def test_a_method_not_safe_to_repeat_is_never_sent_again_to_the_same_actor(ray_local):
    group = _flaky_group([1, 0])
    assert group.call(0, Flaky.step, "c") == ("c", 1) and group.replacements == 1
    group.kill()


_GUARDED = """
import sys, time
from es_ray.runtime.signals import InterruptGuard
with InterruptGuard(float(sys.argv[1])):
    print("ready", flush=True)
    while True:  # stuck where nothing checks for the signal (a stop-time checkpoint on a lost node)
        time.sleep(0.05)
"""


@pytest.mark.parametrize("stop_timeout_s, signals, bound_s", [(1.0, 1, 8.0), (600.0, 2, 5.0)])
def test_sigterm_ends_a_stuck_run_within_the_stop_timeout_and_a_second_one_at_once(stop_timeout_s, signals, bound_s):
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [sys.executable, "-c", _GUARDED, str(stop_timeout_s)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    assert proc.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    for _ in range(signals):
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM and time.monotonic() - t0 < bound_s
    assert ("a second signal" if signals == 2 else "faults.stop_timeout_s=1 s passed") in out


_LOCAL_RAY = """
import time
import ray
from es_ray.runtime.signals import InterruptGuard
ray.init(address="local", num_cpus=1, include_dashboard=False, configure_logging=False, log_to_driver=False)
with InterruptGuard(600.0):  # the handlers first: a signal before them would meet Ray's own (exit code 15)
    print(ray._private.worker._global_node.get_session_dir_path(), flush=True)
    while True:
        time.sleep(0.05)
"""


def test_no_ray_process_outlives_a_driver_stopped_by_two_signals():
    """A driver with its own local Ray, stuck, gets SIGTERM twice: it exits at once and takes its Ray with it."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", _LOCAL_RAY], stdout=subprocess.PIPE, text=True, cwd=REPO)
    session = Path(proc.stdout.readline().strip()).name
    assert session.startswith("session_")
    assert processes_of(session), "the local Ray's processes were not found by their session"
    for _ in range(2):
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    deadline = time.monotonic() + 20
    while processes_of(session) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_of(session), processes_of(session)
