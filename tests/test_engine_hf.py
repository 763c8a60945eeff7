"""Engine contract on the transformers engine (tiny model): exact perturb/restore, determinism, token counts."""

from __future__ import annotations

import pytest
import torch

from es_ray.config import EngineConfig, SamplingConfig
from es_ray.engines.base import make_engine
from es_ray.replica import ReplicaSpec
from es_ray.strategy import ask, zscore

PROMPTS = ["Hello, how are you?", "What is 2 + 2?", "Name a colour.", "Count to three."]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine(request, tiny_model_dir):
    torch.set_num_threads(2)
    eng = make_engine(str(tiny_model_dir), EngineConfig(name="hf", dtype=request.param, device="cpu"))
    eng.es_setup(ReplicaSpec(run_seed=7, engine_dtype=request.param))
    return eng


def _prompts(engine):
    return [engine.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


def _engine_weights(engine):
    return {k: v.detach().clone() for k, v in engine.params.items()}


def test_perturb_generate_restore_is_exact(engine):
    greedy = SamplingConfig(max_new_tokens=8, temperature=0.0)
    before_w = _engine_weights(engine)
    before_text = [c.text for c in engine.generate(_prompts(engine), greedy, seed=0)]
    master = {k: v.clone() for k, v in engine.replica.master.items()}
    engine.es_call("perturb", 3, 5, 1, 0.05)
    perturbed = _engine_weights(engine)
    assert any(not torch.equal(perturbed[k], before_w[k]) for k in before_w)
    engine.generate(_prompts(engine), greedy, seed=0)
    engine.es_call("restore")
    after_w = _engine_weights(engine)
    for k in before_w:
        assert torch.equal(after_w[k], before_w[k]), k
    for k in master:
        assert torch.equal(engine.replica.master[k], master[k]), k
    assert [c.text for c in engine.generate(_prompts(engine), greedy, seed=0)] == before_text


def test_perturbed_weights_equal_cast_of_master_plus_noise(engine):
    engine.es_call("perturb", 1, 2, -1, 0.01)
    dtype = next(iter(engine.params.values())).dtype
    for name, theta in engine.replica.master.items():
        eps = engine.replica.noise.noise(1, 2, name, theta.shape)
        expected = torch.add(theta, eps, alpha=-0.01).to(dtype)  # fp32 master + sign * sigma * eps, then cast
        assert torch.equal(engine.params[name].detach(), expected), name
    engine.es_call("restore")


def test_update_changes_engine_to_cast_of_new_master(engine):
    members = ask(4)
    before = engine.es_call("checksum")
    stats = engine.es_call("update", 0, members, list(zscore([0.1, 0.5, 0.2, 0.9])), 0.01)
    assert stats["update_norm"] > 0 and engine.es_call("checksum") != before
    dtype = next(iter(engine.params.values())).dtype
    for name, theta in engine.replica.master.items():
        assert torch.equal(engine.params[name].detach(), theta.to(dtype)), name


def test_sampling_is_seeded_and_counts_tokens(engine):
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, top_p=0.9)
    a = engine.generate(_prompts(engine), sampling, seed=11)
    b = engine.generate(_prompts(engine), sampling, seed=11)
    assert [c.text for c in a] == [c.text for c in b]
    assert all(1 <= c.num_tokens <= 6 for c in a)
    c = engine.generate(_prompts(engine), sampling, seed=12)
    assert [x.text for x in c] != [x.text for x in a]


def test_read_weights_are_fp32_in_hf_names(engine):
    w = engine.read_weights()
    assert "model.embed_tokens.weight" in w and all(t.dtype == torch.float32 for t in w.values())
