"""scripts/gpu_smoke.py, the GPU machine's one device check, run on CPU on its tiny model: the same code path (engine,
ES full rank and low rank, counter noise, a bf16_mixed GRPO learner), so the script cannot rot between GPU runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_smoke_runs_tiny_on_cpu():
    res = subprocess.run([sys.executable, "scripts/gpu_smoke.py", "--tiny", "--device", "cpu"], capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    figures = json.loads(res.stdout.strip().splitlines()[-1])
    assert figures["ok"] and len(figures["checks"]) == 9 and all(figures["checks"].values())
    model = figures["models"]["tiny-qwen2"]
    assert model["restore_bit_mismatches"] == 0 and model["perturb_changed_elements"] > 0
    assert model["update"]["realised_cos"] > 0.9 and model["lowrank_members_differing_alone"] == []
    assert model["counter_noise"]["bit_exact"] == [True, True] and len(model["grpo"]["loss"]) == 2
    assert model["es_replica_planned_bytes"] > 0 and model["grpo_learner_planned_bytes"] > 0
    assert model["es_iteration_s"] > 0 and model["bare_batched_generation_s"] > 0
