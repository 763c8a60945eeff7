"""Shared fixtures: a tiny randomly initialised Llama (real tokenizer) and one local Ray head per session, which each
module that asks for Ray joins and leaves."""

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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """2 layers, hidden 64, head_dim 32, the SmolLM2 tokenizer and chat template; random weights, fixed seed."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from es_ray.models import resolve_model

    src = resolve_model("")
    tok = AutoTokenizer.from_pretrained(src)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def _tests_importable() -> None:
    """tests/ on PYTHONPATH: Ray workers and the CLIs tests start import test helpers (es_test_tasks) by name."""
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(TESTS_DIR) not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), *parts])


def _token_auth() -> None:
    """RAY_AUTH_MODE=token in this process and what it starts, as a new local ray.init sets it: the head then asks
    for the token and this process's drivers send it. Ray reads the mode once per process, so it reads it again."""
    from ray._raylet import Config

    os.environ["RAY_AUTH_MODE"] = "token"
    Config.initialize("")


@pytest.fixture(scope="session")
def ray_head():
    """The session's Ray head, started the first time a module asks for ray_local and stopped at the end: a start and
    a shutdown cost seconds each, once per module before. `ray start` in its own temp dir (helpers.start_ray_head),
    not ray.cluster_utils.Cluster, which writes its address to /tmp/ray, where any bare ray.init() on this machine
    (a CLI under test, another engineer's run) would then join it. Its workers inherit its environment, set here."""
    import shutil
    import tempfile

    from helpers import kill_processes_of, start_ray_head

    _tests_importable()
    if "RAY_AUTH_MODE" not in os.environ:  # token authentication, as the first local ray.init turned it on before
        _token_auth()
    temp_dir = tempfile.mkdtemp(prefix="esray", dir="/tmp")
    try:
        yield start_ray_head(temp_dir, dict(os.environ))[0]
    finally:
        kill_processes_of(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_local(ray_head, request):
    """The session's Ray head (2 CPUs, as a local Ray of the module's own had), joined by this module's driver and left
    at its end, so a module without Ray sees none initialised. Its own namespace keeps named actors and placement
    groups apart; an earlier module's actors and groups end with its driver, and their CPUs are free before any test
    here runs. (Ray's key-value store outlives a driver: es_ray's progress keys carry the job id, new per driver.)"""
    import ray
    from helpers import alive_es_actors

    _tests_importable()
    ray.init(address=ray_head, namespace=request.module.__name__, configure_logging=False, log_to_driver=False)
    if held := alive_es_actors(wait_s=60):
        ray.shutdown()
        pytest.fail(f"the session's Ray head: {held[0]} by an earlier module 60 s after it ended")
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
