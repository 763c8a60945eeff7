"""Population batching on the transformers engine (es.perturbation=lowrank): member m's rows in a shared batch see
cast(master) + sign * sigma * E_m through a low-rank term, never written into the weights.

Checked against the full-rank path of the same perturbation (``Replica.perturb`` writes W + sign * sigma * E_m
merged): logits agree to fp32 rounding, greedy completions token for token; a member's completions in the shared
batch equal its completions alone; the engine holds cast(master) afterwards, bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import replica_spec
from torch import nn

from es_ray.core.config import EngineConfig, SamplingConfig
from es_ray.engines.base import make_engine
from es_ray.engines.hf_lowrank import LowRankTerms, population_calls
from es_ray.lowrank import LowRankSlots
from es_ray.strategy import Member

PROMPTS = ["Hello, how are you?", "What is 2 + 2?", "Name a colour.", "Count to three, then stop."]
MEMBERS = [Member(0, 0, 1), Member(1, 0, -1), Member(2, 3, 1)]
ITERATION, SIGMA, RANK = 2, 0.05, 4
"""sigma large next to the tiny model's weights (std 0.02), so the members' greedy completions differ."""
GREEDY = SamplingConfig(max_new_tokens=8, temperature=0.0)
SAMPLED = SamplingConfig(max_new_tokens=8, temperature=1.0, top_p=1.0)


def build(model_dir, dtype: str = "float32", perturbation: str = "lowrank", batch_size: int = 8):
    torch.set_num_threads(2)
    eng = make_engine(
        str(model_dir),
        EngineConfig(name="hf", dtype=dtype, device="cpu", batch_size=batch_size),
        LowRankSlots(members=len(MEMBERS), rank=RANK),
    )
    eng.replica_host().setup(replica_spec(7, perturbation=perturbation, rank=RANK))
    return eng


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine(request, tiny_model_dir):
    eng = build(tiny_model_dir, request.param)
    eng.test_dtype = getattr(torch, request.param)
    return eng


def _prompts(engine) -> list[str]:
    return [engine.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


def _ids(completions) -> list[tuple[int, ...]]:
    return [c.token_ids for c in completions]


@pytest.mark.parametrize(
    "prompts, members, batch_size, want",
    [
        (4, 3, 8, [(0, 4, [0, 1]), (0, 4, [2])]),
        (4, 3, 64, [(0, 4, [0, 1, 2])]),
        (4, 2, 3, [(0, 3, [0]), (0, 3, [1]), (3, 4, [0, 1])]),
        (5, 2, 5, [(0, 5, [0]), (0, 5, [1])]),
    ],
)
def test_population_calls_cut_prompts_as_generate_does(prompts, members, batch_size, want):
    calls = population_calls(prompts, members, batch_size)
    assert [(c.start, c.stop, list(m)) for c, m in calls] == want
    assert all((c.stop - c.start) * len(m) <= batch_size for c, m in calls)


def test_lowrank_forward_equals_merged_perturbation(engine):
    """Hooks active, rows member-major: member m's logits equal a forward with W + sign * sigma * E_m written."""
    if engine.test_dtype != torch.float32:
        pytest.skip("compares with merged weights, which bf16 rounds")
    host = engine.replica_host()
    enc = engine._encode(_prompts(engine))
    p = enc["input_ids"].shape[0]
    with torch.inference_mode():
        plain = engine.model(**enc).logits
        with LowRankTerms(engine.model, host.replica.member_factors(ITERATION, MEMBERS, SIGMA)) as terms:
            terms.select(range(len(MEMBERS)))
            batched = engine.model(**{k: v.repeat(len(MEMBERS), 1) for k, v in enc.items()}).logits
        for i, m in enumerate(MEMBERS):
            host.perturb(ITERATION, m.noise_id, m.sign, SIGMA)
            try:
                merged = engine.model(**enc).logits
            finally:
                host.restore()
            got = batched[i * p : (i + 1) * p]
            assert (merged - plain).abs().max() > 1e-2  # the perturbation moves the logits
            torch.testing.assert_close(got, merged, atol=1e-4, rtol=0)


@pytest.mark.parametrize("batch_size", [8, 3])
def test_greedy_members_equal_their_own_generation(engine, batch_size):
    """Each member's greedy completions from the shared batch equal (a) the member generated alone through the same
    low-rank path, (b) in fp32, the full-rank path perturb(member) + generate + restore."""
    host = engine.replica_host()
    prompts = _prompts(engine)
    engine.cfg = dataclasses.replace(engine.cfg, batch_size=batch_size)
    try:
        together = host.generate_members(ITERATION, MEMBERS, SIGMA, prompts, GREEDY, seed=0)
        alone = [host.generate_members(ITERATION, [m], SIGMA, prompts, GREEDY, seed=0)[0] for m in MEMBERS]
        assert [_ids(c) for c in together] == [_ids(c) for c in alone]
        assert len({tuple(_ids(c)) for c in together}) == len(MEMBERS)  # the members generate differently
        if engine.test_dtype == torch.float32:
            merged = []
            for m in MEMBERS:
                host.perturb(ITERATION, m.noise_id, m.sign, SIGMA)
                try:
                    merged.append(engine.generate(prompts, GREEDY, seed=0))
                finally:
                    host.restore()
            assert [_ids(c) for c in together] == [_ids(c) for c in merged]
    finally:
        engine.cfg = dataclasses.replace(engine.cfg, batch_size=8)


def test_sampled_members_are_seeded(engine):
    host = engine.replica_host()
    prompts = _prompts(engine)
    first = host.generate_members(ITERATION, MEMBERS, SIGMA, prompts, SAMPLED, seed=11)
    assert [_ids(c) for c in host.generate_members(ITERATION, MEMBERS, SIGMA, prompts, SAMPLED, seed=11)] == [
        _ids(c) for c in first
    ]
    assert [_ids(c) for c in host.generate_members(ITERATION, MEMBERS, SIGMA, prompts, SAMPLED, seed=12)] != [
        _ids(c) for c in first
    ]


def test_weights_stay_cast_master_and_hooks_are_removed(engine):
    host = engine.replica_host()
    prompts = _prompts(engine)
    before = engine.generate(prompts, GREEDY, seed=0)
    host.generate_members(ITERATION, MEMBERS, SIGMA, prompts, GREEDY, seed=0)
    assert host.replica.engine_mismatches() == {}
    assert not any(m._forward_hooks for m in engine.model.modules())
    assert _ids(engine.generate(prompts, GREEDY, seed=0)) == _ids(before)


def test_hooks_are_removed_on_error(engine):
    host = engine.replica_host()
    factors = host.replica.member_factors(ITERATION, MEMBERS, SIGMA)
    with pytest.raises(RuntimeError, match="not whole members"):
        with LowRankTerms(engine.model, factors) as terms:
            terms.select(range(len(MEMBERS)))
            engine.model(**engine._encode(_prompts(engine)[:2]))  # 2 rows for 3 members
    assert not any(m._forward_hooks for m in engine.model.modules())


def test_full_rank_replica_refuses_population_batching(tiny_model_dir):
    eng = build(tiny_model_dir, perturbation="full")
    with pytest.raises(RuntimeError, match="es.perturbation=lowrank"):
        eng.replica_host().generate_members(ITERATION, MEMBERS, SIGMA, ["Hi"], GREEDY, seed=0)


def test_linear_forwards_are_restored_on_exit_and_on_error(engine):
    """The term runs in a forward of each perturbed layer's own while the context is open; on exit, error or not,
    every module runs its class's forward again (nothing left in its instance dict) and the plain logits return."""
    host = engine.replica_host()
    factors = host.replica.member_factors(ITERATION, MEMBERS, SIGMA)
    enc = engine._encode(_prompts(engine)[:1])
    with torch.inference_mode():
        plain = engine.model(**enc).logits
        with LowRankTerms(engine.model, factors) as terms:
            assert all("forward" in engine.model.get_submodule(n.removesuffix(".weight")).__dict__ for n in factors)
            terms.select(range(1))
            assert not torch.equal(engine.model(**enc).logits, plain)
        with pytest.raises(RuntimeError, match="not whole members"):
            with LowRankTerms(engine.model, factors) as terms:
                terms.select(range(2))
                engine.model(**enc)  # 1 row for 2 members
        assert not any("forward" in m.__dict__ for m in engine.model.modules())
        assert torch.equal(engine.model(**enc).logits, plain)


def test_siblings_share_the_first_product(engine, monkeypatch):
    """q, k, v (and gate, up) read one input: one x A product per group and forward, the siblings taking their
    columns of it (the merged-weight test above checks the values)."""
    factors = engine.replica_host().replica.member_factors(ITERATION, MEMBERS, SIGMA)
    calls = []
    bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a, **k: calls.append(1) or bmm(*a, **k))
    with torch.inference_mode(), LowRankTerms(engine.model, factors) as terms:
        terms.select(range(len(MEMBERS)))
        engine.model(**{k: v.repeat(len(MEMBERS), 1) for k, v in engine._encode(_prompts(engine)[:1]).items()})
    assert terms.group_of and len(terms.group_of) < len(factors)  # attention and MLP groups, o/down alone
    assert len(calls) == len(terms.group_at) + len(factors) - len(terms.group_of)


@pytest.mark.parametrize("bias", [False, True])
def test_term_and_base_gemm_equal_the_merged_layer_with_and_without_bias(bias):
    """The forward replacement writes the term (plus the bias) first and accumulates x W^T into it: each member's rows
    equal x (W + B_s A^T)^T + b, for a layer with a bias (Qwen's q, k, v) and without, grouped siblings included."""
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "q_proj": nn.Linear(12, 10, bias=bias),
            "k_proj": nn.Linear(12, 6, bias=bias),
            "o_proj": nn.Linear(12, 12, bias=bias),
        }
    ).requires_grad_(False)
    members, rows, rank = 3, 4, 2
    factors = {
        f"{n}.weight": (torch.randn(members, 12, rank), torch.randn(members, m.out_features, rank))
        for n, m in model.items()
    }
    x = torch.randn(members * rows, 5, 12)
    with torch.inference_mode(), LowRankTerms(model, factors) as terms:
        terms.select(range(members))
        got = {n: m(x) for n, m in model.items()}
    assert terms.group_of  # q and k share their first product
    for n, m in model.items():
        a, b_s = factors[f"{n}.weight"]
        for i in range(members):
            merged = torch.nn.functional.linear(x[i * rows : (i + 1) * rows], m.weight + b_s[i] @ a[i].T, m.bias)
            torch.testing.assert_close(got[n][i * rows : (i + 1) * rows], merged, atol=1e-5, rtol=1e-5)
