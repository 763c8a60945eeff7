"""grpo.colocate=true on a GPU: the share of the card the rollout engine passes to vLLM is the one the start-up check
added up beside the learner (es_ray.memory_plan.engine_share, called by both), so what the check accepts is what
vLLM maps at every wake-up; and the plan's vLLM batch defaults are vLLM 0.32's own per-device rule."""

from __future__ import annotations

import itertools
import types

import pytest

from es_ray.core.config import ConfigError
from es_ray.grpo.colocated import planned_engine_config
from es_ray.grpo.config import to_grpo_config
from es_ray.memory_plan import (
    CARD_NAMES,
    GiB,
    PRESETS,
    card_bytes,
    preset,
    startup_check,
    usable_bytes,
    vllm_batch_defaults,
)

CARDS = (40, 80, 141)
RESIDENT = ("weights", "fp32 master", "AdamW moments", "reference model", "allocator slack")
"""The learner's lines that stay on the device while vLLM is awake (gradients and activations are freed)."""


def colocated(model: str, fsdp: int, dtype: str, offload: str, max_model_len: int, **grpo):
    return to_grpo_config(
        {
            "model": {"path": PRESETS[model]["hub"]},
            "engine": {"name": "vllm", "device": "cuda", "max_model_len": max_model_len},
            "cluster": {"num_actors": fsdp, "gpus_per_actor": 1},
            "grpo": {
                "colocate": True,
                "fsdp_size": fsdp,
                "dtype": dtype,
                "offload": offload,
                "micro_batch_size": 8,
                "prompts_per_step": 8,
                "group_size": 8,
                "gradient_checkpointing": True,
                **grpo,
            },
        }
    )


def awake_bytes(plan, share: float, reported: int) -> tuple[int, int]:
    """(vLLM's share of the card + the learner's resident lines, vLLM's share + the learner's build on the device),
    added up here from the plan's lines, not through MemoryPlan.gpus."""
    mapped = int(share * reported)
    resident = sum(line.nbytes for line in plan.lines if line.part == "learner" and line.item in RESIDENT)
    build = sum(line.nbytes for line in plan.lines if line.item == "learner build (device)")
    return mapped + resident, mapped + build


def test_every_colocated_config_the_check_accepts_fits_with_the_share_vllm_is_given():
    accepted = refused = 0
    rows = []
    for model, card_gb, fsdp, dtype, offload, max_len in itertools.product(
        PRESETS, CARDS, (1, 2, 4, 8), ("float32", "bf16_mixed"), ("none", "optimizer", "all"), (0, 2048)
    ):
        cfg = colocated(model, fsdp, dtype, offload, max_len)
        reported, name = card_bytes(card_gb), CARD_NAMES[card_gb]
        try:
            plan = startup_check("grpo", cfg, reported=reported, gpu=True, shape=preset(model), device_name=name)
        except ConfigError as err:
            assert "grpo." in str(err) or "engine." in str(err)  # names a key to change
            refused += 1
            continue
        accepted += 1
        share = planned_engine_config(cfg, reported, name).engine.gpu_memory_utilization
        assert 0 < share <= 1
        assert share * reported >= plan.part("vllm"), (model, card_gb, fsdp)  # vLLM gets at least what it needs
        awake, build = awake_bytes(plan, share, reported)
        usable = usable_bytes(reported)
        assert awake <= usable and build <= usable, (
            model,
            card_gb,
            fsdp,
            dtype,
            offload,
            max_len,
            share,
            awake / GiB,
            usable / GiB,
        )
        rows.append((model, card_gb, fsdp, share))
    assert accepted > 100 and refused > 0, (accepted, refused)


def test_the_issues_7b_case_gets_a_share_that_fits_beside_the_learner():
    """Qwen2.5-7B, bf16_mixed, fsdp 2, max_model_len 2048 on an 80 GB card: the engine used to ask for 0.58 of the
    card (room for an ES replica), 46 GiB beside a 42.6 GiB resident learner on 77.5 usable."""
    cfg = colocated("qwen2.5-7b", 2, "bf16_mixed", "none", 2048)
    reported, name = card_bytes(80), CARD_NAMES[80]
    plan = startup_check("grpo", cfg, reported=reported, gpu=True, shape=preset("qwen2.5-7b"), device_name=name)
    share = planned_engine_config(cfg, reported, name).engine.gpu_memory_utilization
    awake, _ = awake_bytes(plan, share, reported)
    assert share < 0.5 and awake <= usable_bytes(reported)
    assert plan.total >= awake  # the check added up what vLLM maps


def test_a_share_set_by_hand_that_cannot_fit_is_refused_naming_the_key_and_the_share_that_fits():
    cfg = colocated("qwen2.5-7b", 2, "bf16_mixed", "none", 2048)
    cfg = type(cfg)(
        **{**cfg.__dict__, "engine": type(cfg.engine)(**{**cfg.engine.__dict__, "gpu_memory_utilization": 0.9})}
    )
    reported = card_bytes(80)
    with pytest.raises(
        ConfigError,
        match=r"engine\.gpu_memory_utilization=0\.\d\d or lower \(vLLM needs at least "
        r"0\.\d\d",
    ):
        startup_check("grpo", cfg, reported=reported, gpu=True, shape=preset("qwen2.5-7b"), device_name="H100")
    assert planned_engine_config(cfg, reported).engine.gpu_memory_utilization == 0.9  # a share set by hand is kept


@pytest.mark.parametrize(
    "gib,name",
    [
        (79.2, "NVIDIA A100-SXM4-80GB"),
        (79.6, "NVIDIA H100 80GB HBM3"),
        (140.4, "NVIDIA H200"),
        (39.4, "NVIDIA A100-SXM4-40GB"),
        (22.0, "NVIDIA L4"),
        (178.4, "NVIDIA B200"),
    ],
)
def test_batch_defaults_are_vllms_own_rule(monkeypatch, gib, name):
    """vLLM's EngineArgs.get_batch_defaults (vllm/engine/arg_utils.py; the same function in the CPU build, which the
    test runs with a GPU platform's answers) against the plan's vllm_batch_defaults."""
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    from vllm.usage.usage_lib import UsageContext

    platform = types.SimpleNamespace(
        get_device_total_memory=lambda device_id=0: int(gib * GiB),
        get_device_name=lambda device_id=0: name,
        is_tpu=lambda: False,
        is_cpu=lambda: False,
    )
    monkeypatch.setattr(arg_utils, "current_platform", platform)
    tokens, seqs = arg_utils.EngineArgs.get_batch_defaults(1)
    assert vllm_batch_defaults(int(gib * GiB), name) == {
        "max_num_batched_tokens": tokens[UsageContext.LLM_CLASS],
        "max_num_seqs": seqs[UsageContext.LLM_CLASS],
    }
