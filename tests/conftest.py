"""Shared fixtures: a tiny randomly initialised Llama (real tokenizer) and one local Ray cluster per module."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

# Tests send nothing off this machine, telemetry included. Set here, before any test imports these libraries (some
# read them at import), and inherited by every subprocess, Ray node and actor the tests start. Forced, not
# defaulted: a developer's own setting must not turn reporting back on inside the suite.
NO_TELEMETRY = {
    # A Ray head that `ray start` or ray.cluster_utils.Cluster starts (not ray.init) POSTs to usage-stats.ray.io:
    # a full report after 60 s when enabled, and a one-off "disabled" report even with --disable-usage-stats. The
    # flag stops the first; only the URL, a closed loopback port, stops the second.
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/",
    # vLLM's GPU worker reports each engine it builds to stats.vllm.ai
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_USAGE_STATS_SERVER": "http://127.0.0.1:9",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    # models and tokenizers come from local directories only; a hub id must fail here, not download
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}
os.environ.update(NO_TELEMETRY)
# Every Ray node the tests start (ray_local, ray.cluster_utils.Cluster, a submitted job's) runs its workers at the
# tests' own priority, as cluster.worker_niceness does for the CLI's local Ray: at Ray's default of 15, the other
# pytest-xdist process's in-process torch work would starve this one's actors.
os.environ["RAY_worker_niceness"] = "0"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """2 layers, hidden 64, head_dim 32, the SmolLM2 tokenizer and chat template; random weights, fixed seed."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from es_ray.models import resolve_model

    src = resolve_model("")
    tok = AutoTokenizer.from_pretrained(src)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def ray_local(request):
    """One local Ray per test module (Ray's testing advice); test helpers and the module's own folder (what it
    hands an actor by reference) importable by its workers."""
    import ray

    ours = list(dict.fromkeys([str(TESTS_DIR), str(request.path.parent)]))
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in ours]
    os.environ["PYTHONPATH"] = os.pathsep.join(ours + rest)
    # address="local": always a new Ray of the test's own, never one that `ray start` left running on this machine
    # (ray.init() without an address joins that one, and another test run's cluster would then serve this one)
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def no_ray_left_running(request):
    """A module that leaves a Ray running (a real connect() where a stand-in was meant) fails here, at its own
    teardown, and not in the next module whose ray_local fixture then cannot start its own."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
        pytest.fail(f"{request.module.__name__} left a Ray running; use the ray_local fixture or a stand-in")


# -- the fast tier: `pytest -m fast` --------------------------------------------------------------------------------
# Marked here by rule, not test by test: a test that is neither slow nor ray is fast unless its module (by name, in
# whichever folder of tests/ it sits) is listed below
# (its tests load a model or vLLM, or start CLIs and other processes, most of them) or the test itself asks for the
# tiny model or a Ray, or its own code starts a process or a CLI.
NOT_FAST_MODULES = {
    # vLLM, models, learners, process groups
    "test_engine_contract",
    "test_lowrank_vllm",
    "test_vllm_gpu_contracts",
    "test_vllm_gpu_settings",
    "test_grpo_colocated_vllm",
    "test_grpo_fsdp",
    "test_grpo_learner",
    "test_grpo_sync",
    "test_grpo_strict_collectives",
    "test_checkpoint",
    "test_checkpoint_parts",
    "test_lowrank_hf",
    "test_interpolate",
    "test_kl",
    "test_tracking",
    "test_prefix",
    # the CLIs and what they start
    "test_cli",
    "test_grpo_cli",
    "test_eval_cli",
    "test_launch_submit",
    "test_placement",
    "test_runtime",
    "test_interrupt_breaker",
    # installs, builds, scripts, sandboxed programs
    "test_packaging",
    "test_install_resolves",
    "test_setup_script",
    "test_gpu_smoke",
    "test_config_reference",
    "test_grading_sandbox",
    "test_sandbox_hostile",
    "test_grading_mathverify",
    "test_launch_files",
    # pure, but Monte Carlo checks of the paired tests' size: minutes
    "test_eval_paired",
}
HEAVY_FIXTURES = {"tiny_model_dir", "ray_local"}
HEAVY_CALLS = ("subprocess", "Popen", "sys.executable", "main(", "vllm")
"""Text in a test's own source that starts a process, a CLI entry point or vLLM."""


def is_fast(item) -> bool:
    import inspect

    if item.get_closest_marker("slow") or item.get_closest_marker("ray"):
        return False
    if Path(str(item.fspath)).stem in NOT_FAST_MODULES or HEAVY_FIXTURES & set(getattr(item, "fixturenames", ())):
        return False
    try:
        source = inspect.getsource(item.function)
    except (AttributeError, OSError, TypeError):
        return False
    return not any(call in source for call in HEAVY_CALLS)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_fast(item):
            item.add_marker(pytest.mark.fast)
