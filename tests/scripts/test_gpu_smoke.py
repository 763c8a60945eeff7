"""scripts/gpu_smoke.py, the GPU machine's one device check, run on CPU on its tiny model: the same code path (engine,
ES full rank and low rank, counter noise, a bf16_mixed GRPO learner, the sharded learner in a
world-size-1 gloo group), so the script cannot rot between GPU runs."""

from __future__ import annotations

import json
import subprocess
import sys

from paths import REPO


def test_gpu_smoke_runs_tiny_on_cpu():
    res = subprocess.run(
        [sys.executable, "scripts/gpu_smoke.py", "--tiny", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    figures = json.loads(res.stdout.strip().splitlines()[-1])
    assert figures["ok"] and len(figures["checks"]) == 14 and all(figures["checks"].values())
    sharded = figures["models"]["tiny-qwen2"]["sharded_learner"]
    assert sharded["backend"] == "gloo" and sharded["chunk_tensors"] > 0 and sharded["build_host_rise_bytes"] > 0
    assert sharded["grad_norm"] > 1e-3  # the offloaded step's gradients were clipped
    model = figures["models"]["tiny-qwen2"]
    assert model["learner_group_backends"] == {"cpu": "GLOO"} and model["colocated_sync"]["host_copy_bytes"] == 0
    assert 0 < model["colocated_share"]["share"] < 1
    assert figures["unconfirmed_here"] and "only a multi-GPU machine with vLLM confirms" in res.stdout
    model = figures["models"]["tiny-qwen2"]
    assert model["restore_bit_mismatches"] == 0 and model["perturb_changed_elements"] > 0
    assert model["update"]["realised_cos"] > 0.9 and model["lowrank_members_differing_alone"] == []
    assert model["counter_noise"]["bit_exact"] == [True, True] and len(model["grpo"]["loss"]) == 2
    assert model["es_replica_planned_bytes"] > 0 and model["grpo_learner_planned_bytes"] > 0
    assert model["es_iteration_s"] > 0 and model["bare_batched_generation_s"] > 0


def test_lowrank_check_catches_rows_given_the_wrong_member(tmp_path, monkeypatch):
    """The low-rank check can fail: with each batched row handed its neighbour's factors (a member-mapping bug),
    both its greedy comparison and its logit bound say so."""
    import argparse
    import importlib.util

    import torch

    from es_ray.replica import Replica

    spec = importlib.util.spec_from_file_location("gpu_smoke", REPO / "scripts" / "gpu_smoke.py")
    smoke_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke_mod)
    from es_ray.core.config import EngineConfig, SamplingConfig
    from es_ray.engines.hf import HFEngine

    smoke_mod.build_model_dir(smoke_mod.TINY["tiny-qwen2"], torch.device("cpu"), 0, tmp_path)
    engine = HFEngine(str(tmp_path), EngineConfig(name="hf", device="cpu", batch_size=32, threads=1))
    args = argparse.Namespace(population=4, sigma=1e-2, rank=4, repeats=3)
    prompts, greedy = list(smoke_mod.PROMPTS[:4]), SamplingConfig(max_new_tokens=8, temperature=0.0)
    honest = smoke_mod.Smoke(torch.device("cpu"))
    smoke_mod.check_lowrank(honest, engine, prompts, greedy, args, "tiny", {})
    assert honest.checks == {"tiny/lowrank_batched_equals_alone": True}

    real = Replica.member_factors

    def rolled(self, iteration, members, sigma):  # row block i gets member i - 1's term (alone: unchanged)
        return {n: (a.roll(1, 0), b.roll(1, 0)) for n, (a, b) in real(self, iteration, members, sigma).items()}

    monkeypatch.setattr(Replica, "member_factors", rolled)
    broken, fig = smoke_mod.Smoke(torch.device("cpu")), {}
    smoke_mod.check_lowrank(broken, engine, prompts, greedy, args, "tiny", fig)
    assert broken.checks == {"tiny/lowrank_batched_equals_alone": False}
    gaps = fig["lowrank_logits"]
    assert gaps["batched_vs_alone_gap"] > gaps["bound"] and fig["lowrank_members_differing_alone"]
    engine.close()
