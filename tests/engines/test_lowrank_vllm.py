"""Population batching on vLLM (es.perturbation=lowrank): member m's requests go through LoRA slot m + 1, filled in
place inside vLLM's worker from the replica's factors (``es_fill_lora``); the weights hold cast(master) throughout.

Checked against the full-rank path of the same perturbation (``perturb`` writes W + sign * sigma * E_m merged,
through vLLM's loader): greedy completions token for token, and teacher-forced log-probs within fp32 rounding (the
LoRA term (x A) B^T is added beside x W^T rather than merged into W, so the logits differ in their last bits; the
tiny model's greedy margins are far wider); a member's completions in the shared batch equal its completions alone,
greedy and sampled (common random numbers); the engine holds cast(master) afterwards, bit for bit; a rank vLLM's
LoRA does not serve is refused before the engine is built. The CPU LoRA kernel that replaces vLLM's is checked on
its own against the per-token formula.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from helpers import PROMPTS, SKIP_VLLM, replica_spec

from es_ray.core.config import ConfigError, EngineConfig, SamplingConfig
from es_ray.engines.base import make_engine
from es_ray.engines.vllm_extension import ESExtension
from es_ray.lowrank import LowRankSlots
from es_ray.strategy import Member, ask, zscore

pytestmark = SKIP_VLLM
MEMBERS = [Member(0, 0, 1), Member(1, 0, -1), Member(2, 3, 1)]
ITERATION, SIGMA, RANK = 2, 0.05, 8
"""sigma large next to the tiny model's weights (std 0.02), so the members' greedy completions differ; rank 8 is
one vLLM's LoRA serves."""
GREEDY = SamplingConfig(max_new_tokens=8, temperature=0.0)
SAMPLED = SamplingConfig(max_new_tokens=8, temperature=1.0, top_p=1.0)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    env = dict(os.environ)  # vLLM's engine sets process environment variables; later tests get them back
    torch.set_num_threads(2)
    eng = make_engine(
        str(tiny_model_dir),
        EngineConfig(name="vllm", dtype="float32", device="cpu", enforce_eager=True),
        LowRankSlots(len(MEMBERS), RANK),
    )
    eng.replica_host().setup(replica_spec(7, perturbation="lowrank", rank=RANK))
    yield eng
    eng.close()
    os.environ.clear()
    os.environ.update(env)


def _prompts(engine) -> list[str]:
    return [engine.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


def _ids(completions) -> list[tuple[int, ...]]:
    return [c.token_ids for c in completions]


def _merged(engine, member: Member, run):
    """``run()`` with the member written into the weights by the full-rank path, then restored."""
    host = engine.replica_host()
    host.perturb(ITERATION, member.noise_id, member.sign, SIGMA)
    try:
        return run()
    finally:
        host.restore()


def _slot_logprobs(engine, position: int, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """Teacher-forced log-probs of the completion through the LoRA slot of the member at ``position`` of the last
    generate_members call (the slots keep their contents until the next one)."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from es_ray.engines.vllm import LORA_PATH, member_lora_name

    ids = list(prompt_ids) + list(completion_ids)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    lora = LoRARequest(member_lora_name(position), position + 1, LORA_PATH)
    out = engine.llm.generate([engine._prompt(ids)], params, lora_request=lora, use_tqdm=False)[0]
    return [float(out.prompt_logprobs[j][ids[j]].logprob) for j in range(len(prompt_ids), len(ids))]


def test_greedy_members_equal_the_full_rank_path_and_themselves_alone(engine):
    """(a) each member's greedy completions in the shared batch equal the merged full-rank path's
    (perturb + generate + restore) and its own generated alone (through slot 1); (b) the members differ."""
    host = engine.replica_host()
    prompts = _prompts(engine)
    plain = _ids(engine.generate(prompts, GREEDY, seed=0))
    together = [_ids(c) for c in host.generate_members(ITERATION, MEMBERS, SIGMA, prompts, GREEDY, seed=0)]
    alone = [_ids(host.generate_members(ITERATION, [m], SIGMA, prompts, GREEDY, seed=0)[0]) for m in MEMBERS]
    merged = [_ids(_merged(engine, m, lambda: engine.generate(prompts, GREEDY, seed=0))) for m in MEMBERS]
    assert together == alone
    assert together == merged
    assert len({tuple(ids) for ids in together}) == len(MEMBERS)  # antithetic pair and other noise all differ
    assert all(ids != plain for ids in together)


def test_slot_logprobs_equal_the_full_rank_path_within_fp32_rounding(engine):
    host = engine.replica_host()
    prompts = _prompts(engine)
    prompt_ids = engine.tokenizer(prompts[1], add_special_tokens=False)["input_ids"]
    together = host.generate_members(ITERATION, MEMBERS, SIGMA, prompts, GREEDY, seed=0)
    for position, member in enumerate(MEMBERS):
        completion = list(together[position][1].token_ids)
        through_slot = torch.tensor(_slot_logprobs(engine, position, prompt_ids, completion))
        merged = torch.tensor(_merged(engine, member, lambda: engine.token_logprobs(prompt_ids, completion)))
        plain = torch.tensor(engine.token_logprobs(prompt_ids, completion))
        torch.testing.assert_close(through_slot, merged, atol=1e-4, rtol=0)
        assert (plain - merged).abs().max() > 1e-2  # the perturbation moves the log-probs


def test_sampled_members_share_seeds_per_prompt(engine):
    """Sampling: the same seed per prompt position for every member (common random numbers), so a member's sampled
    completions in the batch equal its own alone, and a new seed gives new ones."""
    host = engine.replica_host()
    prompts = _prompts(engine)
    together = [_ids(c) for c in host.generate_members(ITERATION, MEMBERS, SIGMA, prompts, SAMPLED, seed=11)]
    assert together[2] == _ids(host.generate_members(ITERATION, [MEMBERS[2]], SIGMA, prompts, SAMPLED, seed=11)[0])
    assert together != [_ids(c) for c in host.generate_members(ITERATION, MEMBERS, SIGMA, prompts, SAMPLED, seed=12)]


def test_weights_stay_cast_master(engine):
    """(c) generate_members writes no weight: the engine holds cast(master) bit for bit, before and after an update
    (written through the LoRA-wrapped layers' loader)."""
    host = engine.replica_host()
    prompts = _prompts(engine)
    before, checksum = _ids(engine.generate(prompts, GREEDY, seed=0)), host.checksum()
    host.generate_members(ITERATION, MEMBERS, SIGMA, prompts, GREEDY, seed=0)
    assert engine._rpc(ESExtension.es_mismatches) == [{}]
    assert host.checksum() == checksum
    assert _ids(engine.generate(prompts, GREEDY, seed=0)) == before
    stats = host.update(ITERATION, ask(4), list(zscore([0.1, 0.5, 0.2, 0.9])), SIGMA)
    assert stats["realised_cos"] == pytest.approx(1.0, abs=1e-3) and host.checksum() != checksum
    host.generate_members(ITERATION + 1, MEMBERS, SIGMA, prompts, GREEDY, seed=0)
    assert engine._rpc(ESExtension.es_mismatches) == [{}]


@pytest.mark.parametrize("order", ["by_member", "interleaved"])
def test_cpu_lora_kernel_equals_the_per_token_formula(order):
    """The CPU LoRA kernel that replaces vLLM's (``vllm_extension._add_lora_linear``): per run of one slot's tokens
    (members in order) or all slots at once (any order), against y += (x A_l^T) B_l^T token by token; tokens of slot
    -1 (no adapter) are left alone, which vLLM's own CPU kernels get wrong (they read the last slot)."""
    from types import SimpleNamespace

    from vllm.lora.punica_wrapper.utils import compute_meta

    from es_ray.engines.vllm_extension import _add_lora_linear

    gen = torch.Generator().manual_seed(0)
    slots, rank, inp, sizes = 3, 8, 16, (12, 4, 4)  # a packed qkv-like layer: three slices
    a = tuple(torch.randn(slots, 1, rank, inp, generator=gen) for _ in sizes)
    b = tuple(torch.randn(slots, 1, size, rank, generator=gen) for size in sizes)
    counts = {0: 10, 1: 6, -1: 4, 2: 8}
    runs = [[slot] * n for slot, n in counts.items()]
    if order == "interleaved":  # round robin: 0, 1, -1, 2, 0, 1, ...
        runs = [[slot for slot in group if slot is not None] for group in itertools.zip_longest(*runs)]
    index = torch.tensor([slot for run in runs for slot in run])
    x, y = torch.randn(len(index), inp, generator=gen), torch.randn(len(index), sum(sizes), generator=gen)
    expected = y.clone()
    for t, slot in enumerate(index.tolist()):
        if slot >= 0:
            expected[t] += torch.cat([(x[t] @ a[s][slot, 0].T) @ b[s][slot, 0].T for s in range(len(sizes))])
    wrapper = SimpleNamespace(
        token_lora_indices=index, is_prefill=True, no_lora=False, prefill_metadata=compute_meta(index)[:3]
    )
    assert (len(wrapper.prefill_metadata[0]) > 4 * slots) == (order == "interleaved")  # the dense path
    _add_lora_linear(wrapper, y, x, a, b, 1.0, sizes)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_lowrank_ranks_are_vllms():
    from es_ray.engines.vllm import lowrank_ranks

    ranks = lowrank_ranks()
    assert RANK in ranks and 3 not in ranks


def test_unsupported_rank_is_refused(tiny_model_dir):
    """(d) before any engine is built, naming es.rank and the ranks vLLM serves."""
    with pytest.raises(ConfigError, match=r"es\.rank=3: vLLM serves LoRA ranks 1, 8, 16"):
        make_engine(
            str(tiny_model_dir),
            EngineConfig(name="vllm", dtype="float32", device="cpu", enforce_eager=True),
            LowRankSlots(2, 3),
        )


@pytest.mark.parametrize("counts", [{0: 5, 1: 5, 2: 5}, {1: 3, 2: 3}, {0: 5, 1: 4, 2: 5}])
def test_cpu_lora_kernel_batches_equal_runs(counts, monkeypatch):
    """Runs of equally many tokens, one per slot in order (a decode step of members with as many requests each): the
    kernel batches them (``_lora_equal_runs``) and equals the per-token formula; unequal runs take the loop."""
    from types import SimpleNamespace

    from vllm.lora.punica_wrapper.utils import compute_meta

    from es_ray.engines import vllm_extension

    batched = []
    equal_runs = vllm_extension._lora_equal_runs
    monkeypatch.setattr(vllm_extension, "_lora_equal_runs", lambda *a: batched.append(1) or equal_runs(*a))
    gen = torch.Generator().manual_seed(1)
    slots, rank, inp, sizes = 3, 8, 16, (12, 4, 4)
    a = tuple(torch.randn(slots, 1, rank, inp, generator=gen) for _ in sizes)
    b = tuple(torch.randn(slots, 1, size, rank, generator=gen) for size in sizes)
    index = torch.tensor([slot for slot, n in counts.items() for _ in range(n)])
    x, y = torch.randn(len(index), inp, generator=gen), torch.randn(len(index), sum(sizes), generator=gen)
    expected = y.clone()
    for t, slot in enumerate(index.tolist()):
        expected[t] += 0.5 * torch.cat([(x[t] @ a[s][slot, 0].T) @ b[s][slot, 0].T for s in range(len(sizes))])
    wrapper = SimpleNamespace(
        token_lora_indices=index, is_prefill=True, no_lora=False, prefill_metadata=compute_meta(index)[:3]
    )
    vllm_extension._add_lora_linear(wrapper, y, x, a, b, 0.5, sizes)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    assert len(batched) == (len(set(counts.values())) == 1)


def test_lowrank_term_off_is_refused_off_the_cpu_build():
    """The switch patches the CPU build's Punica wrapper; on a GPU the kernels are another class (and run in vLLM's
    engine-core process), so the patch would leave the term on silently: refused instead."""
    from es_ray.engines.vllm import VLLMEngine

    eng = object.__new__(VLLMEngine)  # no engine is built: the refusal comes before anything vLLM holds
    eng.device = "cuda"
    with pytest.raises(NotImplementedError, match="CPU build only"):
        with eng.lowrank_term_off():
            pass
