"""Prompts shared by several rows run once (es_ray/metrics/prefix.py): grouping, and transformers generation with the
shared prefill giving the same completions as generation with every prompt prefilled (greedy and sampled, float32,
several prompt lengths so that the rows are left-padded; the embedded model)."""

from __future__ import annotations

import pytest

from es_ray.metrics.prefix import prompt_groups, shares_prompts


def test_prompt_groups_keep_first_appearance_order():
    assert prompt_groups(["a", "b", "a", "c", "b"]) == [[0, 2], [1, 4], [3]]
    assert prompt_groups([[1, 2], (1, 2), [3]]) == [[0, 1], [2]]
    assert shares_prompts(["x", "y", "x"]) and not shares_prompts(["x", "y"]) and not shares_prompts([])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_shared_prefill_generates_what_a_full_prefill_does(monkeypatch, temperature):
    """On the embedded SmolLM2-135M (the tiny random model's greedy output is one token repeated)."""
    import es_ray.engines.hf as hf
    from es_ray.core.config import EngineConfig, SamplingConfig
    from es_ray.models import resolve_model

    engine = hf.HFEngine(resolve_model(""), EngineConfig(threads=1, batch_size=8))
    questions = ["What is 2 + 2?", "Name a prime number larger than ten, please.", "Hi"]
    prompts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    rows = [prompts[i % 3] for i in range(12)] + prompts[:2]  # batches of 8 and 6 rows, 3 prompts in each
    sampling = SamplingConfig(max_new_tokens=12, temperature=temperature, top_p=0.9 if temperature else 1.0)
    calls = []
    real = hf.shared_prefill
    monkeypatch.setattr(hf, "shared_prefill", lambda *a: calls.append(len(a[3])) or real(*a))
    shared = engine.generate(rows, sampling, seed=3)
    assert calls == [3, 3]  # each batch prefilled its 3 distinct prompts once
    monkeypatch.setattr(hf, "shared_prefill", lambda *a: None)
    full = engine.generate(rows, sampling, seed=3)
    assert [c.token_ids for c in shared] == [c.token_ids for c in full]
    assert len({c.token_ids for c in shared}) > 1
