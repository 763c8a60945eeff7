"""Every install the README names resolves: pip's resolver, as a dry run (`pip install --dry-run --ignore-installed
--report`: metadata only, nothing installed), on what scripts/setup.sh installs on a CPU machine and on a GPU node
and on what docker/Dockerfile installs, each under the constraints file it passes. A conflict fails in one line
naming the pin and the requirement that refuses it (scripts/lock.py explain). Needs the package index; skipped,
saying why, where it cannot be reached. Each resolve takes 25-80 s here (2 cores, shared), mostly waiting on the
index, so the three run at once and the file takes about as long as the slowest."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from paths import REPO as ROOT

_spec = importlib.util.spec_from_file_location("scripts_lock", ROOT / "scripts" / "lock.py")
lock = sys.modules["scripts_lock"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(lock)


@pytest.fixture(scope="module")
def index_reachable():
    """Skips when pip cannot reach the default index (the GPU resolve reads nothing else)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in lock.NETWORK_SETTINGS}
    res = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "--timeout", "15", "--retries", "0", "pip"],
        env={**env, "PIP_CONFIG_FILE": os.devnull},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if res.returncode != 0:
        pytest.skip("pip cannot reach the package index: " + (res.stderr.strip().splitlines() or ["?"])[-1])


TARGETS = ("cpu", "gpu", "docker")


@pytest.fixture(scope="module")
def resolves(index_reachable, request, tmp_path_factory) -> Iterator[dict[str, Future]]:
    """lock.check of each target the session runs, all started at once (each is pip in a subprocess, in its own
    work dir): {target: its future}, so a resolve that raises fails its own test only."""
    wanted = {
        item.callspec.params["target"]
        for item in request.session.items  # a -k run starts only its own
        if item.module is request.module and hasattr(item, "callspec")
    }
    with ThreadPoolExecutor(len(TARGETS)) as pool:
        yield {t: pool.submit(lock.check, t, tmp_path_factory.mktemp(f"resolve-{t}")) for t in TARGETS if t in wanted}


@pytest.mark.parametrize("target", TARGETS)
def test_the_install_resolves_under_its_constraints(target, resolves):
    problem = resolves[target].result()
    if problem and target == "cpu" and "+cpu" in problem and "finds no" in problem:
        pytest.skip(f"no index here serves torch's CPU wheel, which the CPU install needs: {problem}")
    if problem and problem.startswith("no Python"):
        pytest.skip(problem)
    assert problem is None, problem
