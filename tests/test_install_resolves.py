"""Every install the README names resolves: pip's resolver, as a dry run (`pip install --dry-run --ignore-installed
--report`: metadata only, nothing installed), on what scripts/setup.sh installs on a CPU machine and on a GPU node
and on what docker/Dockerfile installs, each under the constraints file it passes. A conflict fails in one line
naming the pin and the requirement that refuses it (scripts/lock.py explain). Needs the package index; skipped,
saying why, where it cannot be reached. Each resolve takes 50-80 s here (2 cores, shared)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("scripts_lock", ROOT / "scripts" / "lock.py")
lock = sys.modules["scripts_lock"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(lock)


@pytest.fixture(scope="module")
def index_reachable():
    """Skips when pip cannot reach the default index (the GPU resolve reads nothing else)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in lock.NETWORK_SETTINGS}
    res = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "--timeout", "15", "--retries", "0",
                          "pip"], env={**env, "PIP_CONFIG_FILE": os.devnull}, capture_output=True, text=True,
                         timeout=120)
    if res.returncode != 0:
        pytest.skip("pip cannot reach the package index: " + (res.stderr.strip().splitlines() or ["?"])[-1])


@pytest.mark.parametrize("target", ["cpu", "gpu", "docker"])
def test_the_install_resolves_under_its_constraints(target, index_reachable, tmp_path):
    problem = lock.check(target, tmp_path)
    if problem and target == "cpu" and "+cpu" in problem and "finds no" in problem:
        pytest.skip(f"no index here serves torch's CPU wheel, which the CPU install needs: {problem}")
    if problem and problem.startswith("no Python"):
        pytest.skip(problem)
    assert problem is None, problem
