"""The benchmark harnesses' own logic (benchmarks/run_ab.py, benchmarks/startup.py), without the runs they time."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_run_ab_expands_the_vllm_preload_to_the_libraries_vllm_would_preload():
    pytest.importorskip("vllm")
    from run_ab import parse_env

    env = parse_env(["LD_PRELOAD=vllm", "OMP_NUM_THREADS=1", "EMPTY="])
    libs = env["LD_PRELOAD"].split(":")
    assert libs and all(os.path.isfile(lib) for lib in libs)
    assert any("libgomp" in os.path.basename(lib) for lib in libs)  # torch's, as vllm/platforms/cpu.py finds it
    assert env["OMP_NUM_THREADS"] == "1" and env["EMPTY"] == ""


def test_startup_phases_read_off_a_trace_split_the_command_and_count_only_the_work_out_of_the_fixed_cost():
    """A hand-written trace of a driver (pid 1) and one actor (pid 2): every phase is the span the docstring names."""
    from startup import phases

    t = 100.0
    ev = [(1, "process", "up", t + 0.5), (1, "entry", "begin", t + 0.6), (1, "ray_start", "begin", t + 2.0),
          (1, "ray_start", "end", t + 6.0), (1, "start_actors", "begin", t + 6.0), (2, "process", "up", t + 7.0),
          (2, "actor_init", "begin", t + 8.0), (2, "engine_build", "begin", t + 8.5),
          (2, "model_load", "begin", t + 9.0), (2, "model_load", "end", t + 10.0),
          (2, "engine_build", "end", t + 12.0), (2, "actor_init", "end", t + 13.0),
          (1, "start_actors", "end", t + 13.5), (1, "work", "begin", t + 13.5), (1, "work", "end", t + 20.0),
          (1, "checkpoint", "begin", t + 20.0), (1, "checkpoint", "end", t + 22.0), (1, "entry", "end", t + 22.0)]
    got = phases([{"pid": p, "event": e, "edge": g, "t": x} for p, e, g, x in ev], t, t + 25.0)
    assert got["python_s"] == pytest.approx(0.5)
    assert got["ray_start_s"] == pytest.approx(4.0)
    assert got["actor_spawn_s"] == pytest.approx(2.0)  # actors asked for until the first __init__ runs
    assert got["model_load_s"] == pytest.approx(1.0)
    assert got["engine_build_s"] == pytest.approx(2.5)  # make_engine less the model load in it
    assert got["work_s"] == pytest.approx(6.5) and got["checkpoint_s"] == pytest.approx(2.0)
    assert got["shutdown_s"] == pytest.approx(3.0)
    assert got["total_s"] == pytest.approx(25.0) and got["fixed_s"] == pytest.approx(25.0 - 6.5)
