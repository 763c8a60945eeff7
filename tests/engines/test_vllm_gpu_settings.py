"""Settings vLLM's GPU kernels cannot run, refused before any engine is built (config level, CPU, no GPU needed):
low rank in float32 on a GPU (vLLM's Triton LoRA kernels take fp16/bf16 only), engine.batch_invariant where there is
no vLLM GPU kernel to make batch-invariant, and a batch-invariant request that this process's vLLM already read as off.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types

import pytest
import torch

from es_ray.es.config import ESTrainConfig, validate
from es_ray.core.config import ConfigError
from es_ray.engines.vllm import check_gpu_settings


def _cfg(perturbation: str = "full", **engine) -> ESTrainConfig:
    cfg = ESTrainConfig()
    cfg.engine = dataclasses.replace(cfg.engine, **engine)
    cfg.es = dataclasses.replace(cfg.es, perturbation=perturbation, rank=8)
    return cfg


def test_float32_lowrank_on_a_gpu_is_refused_naming_engine_dtype():
    with pytest.raises(ConfigError, match=r"^engine\.dtype=float32 with es\.perturbation=lowrank on a GPU"):
        check_gpu_settings("cuda", "float32", lowrank=True, batch_invariant=False)
    with pytest.raises(ConfigError, match="set engine.dtype=bfloat16"):
        validate(_cfg("lowrank", name="vllm", device="cuda", dtype="float32"))
    for dtype in ("bfloat16", "float16", "auto"):
        check_gpu_settings("cuda", dtype, lowrank=True, batch_invariant=False)
    check_gpu_settings("cuda", "float32", lowrank=False, batch_invariant=False)  # full rank: no LoRA kernel
    check_gpu_settings("cpu", "float32", lowrank=True, batch_invariant=False)  # CPU: es_ray's own LoRA kernel
    validate(_cfg("lowrank", name="hf", device="cuda", dtype="float32"))  # transformers: its own low-rank path


def test_batch_invariant_is_refused_where_vllm_has_no_gpu_kernels():
    with pytest.raises(
        ConfigError,
        match=r"engine\.batch_invariant=true needs an engine with a batch-invariant mode.*"
        r"engine\.name=hf has none: set engine\.name= one of vllm",
    ):
        validate(_cfg(name="hf", batch_invariant=True))
    with pytest.raises(ConfigError, match="set engine.batch_invariant=false"):
        validate(_cfg(name="vllm", device="cpu", batch_invariant=True))
    validate(_cfg(name="vllm", device="cuda", batch_invariant=True))
    validate(_cfg(name="vllm", device="auto", batch_invariant=True))  # the engine checks where it starts
    assert ESTrainConfig().engine.batch_invariant is False


def test_batch_invariance_refused_once_vllm_read_it_as_off(monkeypatch):
    """vLLM 0.32 reads VLLM_BATCH_INVARIANT in its GPU worker and, once, when its LoRA Triton kernels are imported:
    a process whose kernels were imported with it off cannot turn it on."""
    envs = pytest.importorskip("vllm.envs")
    from es_ray.engines.vllm import BATCH_INVARIANT_ENV, enable_batch_invariance

    envs.disable_envs_cache()  # an engine built earlier in this process cached vLLM's environment

    # setenv first, so the teardown restores the variable as it was: enable_batch_invariance sets it to 1 in this
    # process, and a local Ray started later by another module would pass it to vLLM's CPU workers (whose Triton-only
    # batch-invariant softmax then fails)
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "0")
    monkeypatch.delenv(BATCH_INVARIANT_ENV)
    monkeypatch.setitem(sys.modules, "vllm.lora.ops.triton_ops.utils", types.SimpleNamespace(is_batch_invariant=False))
    with pytest.raises(RuntimeError, match="start the engine in a fresh process"):
        enable_batch_invariance()
    monkeypatch.setitem(sys.modules, "vllm.lora.ops.triton_ops.utils", types.SimpleNamespace(is_batch_invariant=True))
    monkeypatch.delenv(BATCH_INVARIANT_ENV, raising=False)
    enable_batch_invariance()
    assert os.environ[BATCH_INVARIANT_ENV] == "1" and envs.VLLM_BATCH_INVARIANT


def test_memory_check_measures_every_worker_and_the_tightest_rank_decides(tiny_model_dir, monkeypatch):
    """check_es_memory asks each vLLM worker for its own device's free memory (``es_device_memory``, measured after
    its cache is sized); the actor process never touches CUDA. One rank short of memory refuses the run."""
    from helpers import replica_spec

    from es_ray.core.config import EngineConfig
    from es_ray.engines.vllm import VLLMEngine
    from es_ray.engines.vllm_extension import ESExtension
    from es_ray.memory_plan import GiB

    def no_cuda_here(*args, **kwargs):
        raise AssertionError("the actor process must not create a CUDA context")

    monkeypatch.setattr("torch.cuda.mem_get_info", no_cuda_here)
    engine = object.__new__(VLLMEngine)  # no vLLM: only what check_es_memory reads
    engine.model_dir, engine._gpu_share = str(tiny_model_dir), 0.5
    engine.cfg = EngineConfig(name="vllm", device="cuda", tensor_parallel_size=2)
    engine.dtype = torch.bfloat16
    engine.lowrank = None  # full-rank ES: no LoRA slots (VLLMEngine.__init__ sets it from es.perturbation)
    asked = []
    spec = replica_spec(0, optimizer="adam")
    for free in ((40 * GiB, 40 * GiB), (40 * GiB, 0)):
        engine._rpc = lambda method, *args, free=free: asked.append(method) or [(f, 80 * GiB) for f in free]
        if free[1]:
            engine.check_es_memory(spec)
        else:
            with pytest.raises(ConfigError):
                engine.check_es_memory(spec)
    assert asked == [ESExtension.es_device_memory, ESExtension.es_device_memory]
