"""Without starting Ray: which of Ray's errors count as a lost actor (and what a memory kill says), a local Ray
start that times out (one retry with a longer wait, then one line), the Ray processes a driver starts kept out of
its process group, a run dir whose start failed reused by the same command, and the ledger's peak memory kept."""

from __future__ import annotations

import dataclasses
import json

import pytest

from es_ray.core.config import ConfigError
from es_ray.es.config import ESTrainConfig

# Ray 2.60's memory monitor message, as a driver received it (numbers from a kill on a 2-core, 24 GiB machine)
RAY_OOM = (
    "Task was killed due to the node running out of memory.\nMemory on the node (IP: 127.0.0.1, ID: 8f2e) where "
    "the task (actor ID: 3c1a, name=ESWorker.__init__, pid=41237, memory used=2.04GB) was running was 22.91GB / "
    "24.00GB (0.954583), which exceeds the memory usage threshold of 0.95. Ray killed this worker (ID: 77aa) "
    "because it was the most recently scheduled task; to see more information about memory usage on this "
    "node, use `ray logs raylet.out -ip 127.0.0.1`.\nTop 10 memory users:\nPID\tMEM(GB)\tCOMMAND\n"
    "41237\t2.04\tray::ESWorker.evaluate\n41102\t1.98\tray::ESWorker.evaluate\n39001\t1.20\tpython -m "
    "pytest\n38000\t0.50\tother\nRefer to the documentation on how to address the out of memory issue."
)


def test_every_error_that_means_a_dead_actor_takes_the_replacement_path():
    import ray.exceptions as e

    from es_ray.runtime.actors import is_lost_actor

    lost = [
        e.OutOfMemoryError(RAY_OOM),
        e.NodeDiedError("node gone"),
        e.WorkerCrashedError(),
        e.ActorDiedError(),
        e.ObjectLostError("00" * 28, b"", ""),
    ]
    assert all(is_lost_actor(x) for x in lost)
    # an OutOfMemoryError raised inside the call reaches the driver as RayTaskError(OutOfMemoryError): lost too
    assert is_lost_actor(e.RayTaskError("evaluate", "tb", e.OutOfMemoryError(RAY_OOM)).as_instanceof_cause())
    # the actor's own bug is not a dead actor: raised as it is, never retried
    assert not is_lost_actor(e.RayTaskError("evaluate", "tb", ValueError("bug")).as_instanceof_cause())


def test_a_memory_kill_says_who_used_what_and_which_key_lowers_it():
    import ray.exceptions as e

    from es_ray.runtime.actors import lost_reason

    line = lost_reason(e.OutOfMemoryError(RAY_OOM), "ESWorker.evaluate")
    assert "\n" not in line
    assert line.startswith(
        "killed by Ray's memory monitor during ESWorker.evaluate (node memory 22.91GB of "
        "24.00GB (95%); threshold 0.95; the killed worker pid 41237 used 2.04GB; largest: pid "
        "41237 2.04 GB ray::ESWorker.evaluate; pid 41102 1.98 GB ray::ESWorker.evaluate; pid "
        "39001 1.20 GB python -m pytest)"
    )
    assert "cluster.num_actors=" in line and "RAY_memory_usage_threshold" in line
    assert lost_reason(e.NodeDiedError("x"), "ESWorker.update") == "NodeDiedError during ESWorker.update"


def _eval_group_kwargs(monkeypatch) -> dict:
    """The keywords es-eval gives its actor group (cluster, placement and group stubbed: nothing starts)."""
    import es_ray.runtime.actors as actors
    import es_ray.runtime.cluster as cluster
    import es_ray.runtime.placement as placement
    from es_ray.evaluation import es_eval
    from es_ray.evaluation.config import EvalJobConfig

    seen = {}

    class Started(Exception):
        pass

    def start_group(*args, **kw):
        seen.update(kw)
        raise Started

    monkeypatch.setattr(cluster, "connect", lambda *a, **k: None)
    monkeypatch.setattr(placement, "place", lambda *a, **k: type("Placed", (), {"release": lambda self: None})())
    monkeypatch.setattr(actors, "start_group", start_group)
    with pytest.raises(Started):
        es_eval._run_chunks(EvalJobConfig(), [], lambda chunk: None, in_process=False)
    return seen


def test_a_memory_kills_advice_names_keys_its_command_accepts(monkeypatch):
    """es-train, grpo-train and es-eval each get advice in their own keys (es-eval has eval.max_new_tokens, not
    sampling.max_new_tokens)."""
    import re

    import ray.exceptions as e

    from es_ray.core.config import flatten
    from es_ray.evaluation.config import EvalJobConfig
    from es_ray.grpo.config import GRPOTrainConfig
    from es_ray.runtime.actors import lost_reason

    commands = {ESTrainConfig: {}, GRPOTrainConfig: {}, EvalJobConfig: _eval_group_kwargs(monkeypatch)}
    for schema, kw in commands.items():
        line = lost_reason(e.OutOfMemoryError(RAY_OOM), "Worker.run", *([kw["tokens_key"]] if kw else []))
        keys = set(re.findall(r"\b([a-z_]+\.[a-z_.]+)=", line))
        assert keys, line
        assert keys <= set(flatten(dataclasses.asdict(schema()))), (schema.__name__, keys)


def test_a_local_start_that_times_out_is_retried_with_a_longer_wait(monkeypatch):
    from ray._private import services

    import es_ray.runtime.cluster as cluster

    monkeypatch.setattr(cluster, "machine_state", lambda: (0.5, 2, 10.0))  # an idle machine: Ray's own 30 s first
    seen, log = [], []

    def init():
        seen.append((services.ConsolePopen.__name__, services.get_node.__name__))
        if len(seen) == 1:
            raise Exception(
                "The current node timed out during startup. This could happen because some of the "
                "raylet failed to startup or the GCS has become overloaded."
            )

    cluster.start_local(init, log.append)
    assert seen == [("SessionPopen", "patient"), ("SessionPopen", "patient")]
    assert log == [
        "the local Ray did not start within 30 s (load average 0.5 on 2 CPUs); trying once more, waiting up to 180 s"
    ]
    assert services.ConsolePopen.__name__ == "ConsolePopen" and services.get_node.__name__ == "get_node"


def test_a_local_start_that_fails_is_one_line_naming_what_to_do(monkeypatch):
    import es_ray.runtime.cluster as cluster

    monkeypatch.setattr(cluster, "machine_state", lambda: (31.0, 2, 0.7))
    calls = []

    def init():
        calls.append(1)
        raise Exception("The current node timed out during startup. This could happen ...\nmore lines")

    with pytest.raises(ConfigError) as err:
        cluster.start_local(init, lambda line: None)
    assert len(calls) == 2  # the loaded machine started with the long wait, and was retried once
    text = str(err.value)
    assert "\n" not in text and "timed out during startup" in text
    assert "load average 31.0 on 2 CPUs, 0.7 GiB memory available" in text
    assert "cluster.num_cpus=" in text and "free memory" in text and "Retry" in text

    calls.clear()

    def broken():
        calls.append(1)
        raise RuntimeError("raylet exited with code 1")

    with pytest.raises(ConfigError, match="raylet exited with code 1"):
        cluster.start_local(broken, lambda line: None)
    assert len(calls) == 1  # not a timeout: no retry


def test_the_wait_for_a_new_node_is_lengthened(monkeypatch):
    from ray._private import services

    import es_ray.runtime.cluster as cluster

    answers = iter([RuntimeError("not yet"), RuntimeError("not yet"), {"node": 1}])

    def get_node(*args):
        out = next(answers)
        if isinstance(out, Exception):
            raise out
        return out

    monkeypatch.setattr(services, "get_node", get_node)
    monkeypatch.setattr(cluster.time, "sleep", lambda s: None)
    with cluster._startup_wait(60.0):
        assert services.get_node("gcs", "id") == {"node": 1}
    assert services.get_node is get_node


@pytest.mark.parametrize("kernel_fate_sharing", [True, False])
def test_ray_gets_a_session_of_its_own_only_where_the_kernel_ends_it_with_the_driver(kernel_fate_sharing, monkeypatch):
    """Without the kernel's parent-death signal (macOS) Ray's reaper ends Ray's processes by signalling its own
    process group: there they must stay in the driver's, or a driver killed outright leaves them running."""
    import os
    import subprocess
    import sys

    import ray._private.utils
    from ray._private import services

    import es_ray.runtime.cluster as cluster

    monkeypatch.setattr(ray._private.utils, "detect_fate_sharing_support", lambda: kernel_fate_sharing)
    with cluster._own_session():
        child = services.ConsolePopen(
            [sys.executable, "-c", "import os; print(os.getsid(0))"], stdout=subprocess.PIPE, text=True
        )
        out, _ = child.communicate(timeout=60)
    assert (int(out) == child.pid) is kernel_fate_sharing  # a session leader: a session of its own
    assert (int(out) == os.getsid(0)) is not kernel_fate_sharing


def test_a_start_that_times_out_leaves_no_process_running(monkeypatch):
    """Ray records its node only once it registered: after a timeout, ray.shutdown alone leaves the GCS and raylet
    that start began (and their workers) running beside the retry's for the life of the driver."""
    import subprocess
    import sys

    from ray._private import services

    import es_ray.runtime.cluster as cluster

    monkeypatch.setattr(cluster, "machine_state", lambda: (0.5, 2, 10.0))
    started = []

    def init():  # as Ray's start_ray_process: through services.ConsolePopen, then the node never registers
        head = services.ConsolePopen(
            [
                sys.executable,
                "-c",
                "import subprocess, sys, time; print(subprocess.Popen("
                "[sys.executable, '-c', 'import time; time.sleep(300)']).pid, flush=True); "
                "time.sleep(300)",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append((head, int(head.stdout.readline())))  # a raylet and the worker it prestarted
        raise Exception(
            "The current node timed out during startup. This could happen because some of the raylet "
            "failed to startup or the GCS has become overloaded."
        )

    with pytest.raises(cluster.ClusterStartError):
        cluster.start_local(init, lambda line: None)
    assert len(started) == 2  # the first try and the retry
    for head, worker in started:
        assert head.poll() is not None, "a failed start's process is still running"
        head.stdout.close()
        assert _gone(worker), "a failed start's worker is still running"


def _gone(pid: int, wait_s: float = 10.0) -> bool:
    """Whether process ``pid`` ended (a zombie waiting for init to reap it counts as ended)."""
    import time
    from pathlib import Path

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


def _cfg(run_dir, **es):
    cfg = ESTrainConfig()
    return dataclasses.replace(
        cfg, run=dataclasses.replace(cfg.run, dir=str(run_dir)), es=dataclasses.replace(cfg.es, **es)
    )


def test_a_run_dir_whose_start_failed_is_reused_by_the_same_command(tmp_path):
    from es_ray.runtime.rundir import open_run_dir, unlock_run_dir

    run_dir = tmp_path / "run"
    open_run_dir(_cfg(run_dir), "es")  # a start that failed before its first iteration: config.json only
    unlock_run_dir(run_dir)
    assert open_run_dir(_cfg(run_dir), "es") == run_dir.resolve()
    unlock_run_dir(run_dir)
    (run_dir / "ledger.json").write_text("{}")
    (run_dir / "seed_log.jsonl").write_text("")
    assert open_run_dir(_cfg(run_dir), "es") == run_dir.resolve()  # a ledger of its start, an empty log: the same
    unlock_run_dir(run_dir)
    with pytest.raises(ConfigError, match="holds another run"):  # other settings: another run
        open_run_dir(_cfg(run_dir, sigma=0.5), "es")
    (run_dir / "seed_log.jsonl").write_text(json.dumps({"iteration": 0}) + "\n")
    with pytest.raises(ConfigError, match="holds another run"):  # an iteration committed: never overwritten
        open_run_dir(_cfg(run_dir), "es")


class _Group:
    role, ranks, created_at, replacements = "es", [0, 1], 0.0, 0

    class cls:
        peak_memory = None

    def __init__(self, answers):
        self.answers = answers

    def ask_all(self, method, timeout_s=60.0):
        return self.answers


def test_the_ledger_keeps_the_peak_memory_read_so_far():
    from es_ray.core.config import ClusterConfig
    from es_ray.runtime.ledger import Ledger

    ledger = Ledger("grpo")
    ledger.add_group(_Group([{"peak_rss_bytes": 5, "peak_gpu_bytes": None}] * 2), ClusterConfig())
    ledger.add_group(_Group([None, {"peak_rss_bytes": 7, "peak_gpu_bytes": None}]), ClusterConfig())  # 0 is busy
    assert ledger.actors["es_0"]["peak_rss_bytes"] == 5 and ledger.actors["es_0"]["unanswered"]
    assert ledger.actors["es_1"]["peak_rss_bytes"] == 7
    ledger.add_group(_Group([]), ClusterConfig(), ask=False)  # a step's record asks nothing and forgets nothing
    assert [ledger.actors[f"es_{r}"]["peak_rss_bytes"] for r in (0, 1)] == [5, 7]
    assert ledger.to_dict(False)["peak_rss_bytes_max"] == 7
