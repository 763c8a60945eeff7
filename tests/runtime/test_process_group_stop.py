"""A SIGTERM to the driver's whole process group (`timeout -s TERM`, Slurm's time limit, systemd's stop) is a clean
stop: the local Ray the driver started is in a session of its own, so it lives until the driver has committed its
step and written its checkpoint, then goes with the driver."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import processes_of
from paths import REPO as ROOT, TESTS

pytestmark = pytest.mark.ray


_DRIVER = """
import time
import ray
from es_ray.core.config import ClusterConfig
from es_ray.runtime.cluster import connect
from es_ray.runtime.signals import Interrupted, InterruptGuard

connect(ClusterConfig(num_cpus=1))

@ray.remote(num_cpus=0)
def answer():
    return 42

with InterruptGuard(600.0) as guard:
    print(ray._private.worker._global_node.get_session_dir_path(), flush=True)
    try:
        while True:
            guard.check()
            time.sleep(0.05)
    except Interrupted:  # the whole group got the signal: the cluster must still answer
        print("after the signal, Ray answers", ray.get(answer.remote(), timeout=120), flush=True)
        raise SystemExit(143)
"""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # the driver starts a Ray of its own
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def test_a_signal_to_the_process_group_reaches_the_driver_only():
    proc = subprocess.Popen(
        [sys.executable, "-c", _DRIVER],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=_env(),
        start_new_session=True,
    )  # its own group, as a shell's job
    try:
        session = Path(proc.stdout.readline().strip()).name
        assert session.startswith("session_"), session
        assert processes_of(session)
        os.killpg(proc.pid, signal.SIGTERM)  # the driver's group, as `timeout` and Slurm send it
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, out[-3000:]
    assert "after the signal, Ray answers 42" in out, out[-3000:]
    deadline = time.monotonic() + 30
    while processes_of(session) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_of(session), processes_of(session)  # and then it went with the driver


def test_es_train_stopped_by_a_signal_to_its_group_commits_and_checkpoints(tiny_model_dir, tmp_path):
    from es_ray.runtime.checkpoint import read_meta, verify_dir

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            "es-train",
            f"model.path={tiny_model_dir}",
            "task.name=es_test_tasks:VowelTask",
            "task.train_size=8",
            "es.population=2",
            "es.sigma=0.02",
            "es.iterations=8",
            "es.prompts_per_iteration=4",
            "sampling.max_new_tokens=4",
            "engine.dtype=float32",
            "cluster.num_actors=1",
            "cluster.cpus_per_actor=1",
            "cluster.num_cpus=2",
            "eval.every=0",
            "run.progress=false",
            "run.trackers=[]",
            "faults.actor_delay_s=2",
            f"run.dir={run_dir}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=_env(),
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 400
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().strip()) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "Continue with: es-train run.resume=true run.dir=" in out, out[-3000:]
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    done = len(rows)
    assert 1 <= done < 8 and len((run_dir / "seed_log.jsonl").read_text().splitlines()) == done
    assert f"stopped by SIGTERM after {done} iteration(s); checkpoint" in out, out[-3000:]
    ckpt = run_dir / "checkpoints" / f"iter_{done:06d}"  # written by the actor: Ray outlived the signal
    verify_dir(ckpt)
    assert read_meta(ckpt, "es")["iteration"] == done
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["state"] == "stopped" and ledger["segments"][-1]["stop"] == "signal SIGTERM"
    assert ledger["steps"] == done and ledger["actors"]["es_0"]["peak_rss_bytes"] > 0


def test_a_driver_killed_outright_takes_its_ray_along():
    """SIGKILL to the driver alone (the OOM killer's, `kill -9`): its Ray, in a session of its own, does not outlive
    it (the kernel's parent-death signal Ray sets on the processes it starts)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _DRIVER],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=_env(),
        start_new_session=True,
    )
    try:
        session = Path(proc.stdout.readline().strip()).name
        assert session.startswith("session_"), session
        assert processes_of(session)
        proc.kill()  # the driver only, no chance to shut anything down
        proc.wait(timeout=60)
        deadline = time.monotonic() + 150  # the raylet's agents wait out their GCS call first (docs/resume.md)
        while processes_of(session) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = processes_of(session)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not left, left
