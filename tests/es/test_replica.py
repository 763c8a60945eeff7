"""Replica exactness (docs/design.md "ES, precisely" 2, 3): exact restore, exact perturbation, identical replicas; the
update's health measured against what the engine holds; one spec built from the config."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch
from helpers import REPLICA_SEED, Engine, initial_params, replica_spec

from es_ray.es.config import ESConfig, ESTrainConfig
from es_ray.es.config import replica_spec as spec_from_config
from es_ray.noise import NoiseSource
from es_ray.replica import (
    Replica,
    ReplicaSpec,
    Shard,
    checksum,
    combine_checksums,
    gather_shards,
    gather_states,
    mismatches,
    tensor_checksum,
    update_health,
    update_sums,
)
from es_ray.strategy import ask, zscore

SEED = REPLICA_SEED
SIGMA = 0.05
DTYPES = [torch.bfloat16, torch.float32]


def make_replica(dtype=torch.bfloat16, params=None, **spec_kw):
    params = initial_params() if params is None else params
    engine = Engine(params, dtype)
    return Replica(params.items(), replica_spec(**spec_kw), engine.write, engine.read), engine


def clone(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in d.items()}


def possible_perturbed(master: torch.Tensor, eps: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """master + alpha * eps in fp32, computed in numpy: rounded once (fused multiply-add) or twice."""
    a32 = np.float32(alpha)
    m, e = master.numpy(), eps.numpy()
    once = (m.astype(np.float64) + np.float64(a32) * e.astype(np.float64)).astype(np.float32)
    twice = m + a32 * e
    return torch.from_numpy(once), torch.from_numpy(twice)


# -- perturb / restore ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("noise", ["per_tensor", "table"])
def test_perturb_then_restore_is_exact_and_master_unchanged(dtype, noise):
    replica, engine = make_replica(dtype, noise=noise, noise_table_size=1 << 12)
    master0 = clone(replica.master)
    initial_engine = clone(engine.weights)
    for it in range(3):
        for m in ask(4, "antithetic"):
            replica.perturb(it, m.noise_id, m.sign, SIGMA)
            assert any(not torch.equal(engine.weights[k], initial_engine[k]) for k in engine.weights)
            for k in master0:
                assert torch.equal(replica.master[k], master0[k]), f"perturb changed the master {k}"
            replica.restore()
            for k, v in replica.master.items():
                assert torch.equal(engine.weights[k], v.to(dtype)), k
    # many perturb/restore cycles: the engine is back to its initial weights bit for bit (no drift)
    for k in initial_engine:
        assert torch.equal(engine.weights[k], initial_engine[k])
    assert torch.equal(engine.weights["model.norm.weight"], torch.ones(8, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("sign", [1, -1])
def test_perturbed_engine_weights_are_cast_of_master_plus_sigma_eps(dtype, sign):
    replica, engine = make_replica(dtype)
    it, noise_id = 4, 2
    replica.perturb(it, noise_id, sign, SIGMA)
    src = NoiseSource(SEED)
    changed = 0
    for name, master in replica.master.items():
        eps = src.noise(it, noise_id, name, master.shape)
        once, twice = possible_perturbed(master, eps, sign * SIGMA)
        got = engine.weights[name]
        ok = (got == once.to(dtype)) | (got == twice.to(dtype))
        assert bool(ok.all()), f"{name}: {int((~ok).sum())} elements differ from cast(master + sign*sigma*eps)"
        changed += int((got != master.to(dtype)).sum())
    assert changed > 100  # the perturbation is visible in the engine dtype


def test_perturbed_iterator_yields_each_trainable_tensor_once_in_sorted_order():
    replica, _ = make_replica(torch.float32)
    names = [name for name, _ in replica.perturbed(0, 0, 1, SIGMA)]
    assert names == sorted(initial_params())


def test_equal_shaped_tensors_get_different_perturbations():
    replica, engine = make_replica(torch.float32)
    params = initial_params()
    replica.perturb(0, 0, 1, SIGMA)
    dq = engine.weights["model.layers.0.self_attn.q_proj.weight"] - params["model.layers.0.self_attn.q_proj.weight"]
    dv = engine.weights["model.layers.0.self_attn.v_proj.weight"] - params["model.layers.0.self_attn.v_proj.weight"]
    assert not torch.allclose(dq, dv, atol=1e-3)


# -- checksum ---------------------------------------------------------------------------------------------


def test_checksum_equal_for_equal_masters_and_sensitive_to_one_bit():
    a, _ = make_replica(torch.bfloat16)
    b, _ = make_replica(torch.float32)  # the engine dtype does not enter the master checksum
    assert a.checksum() == b.checksum()
    assert isinstance(a.checksum(), str) and len(a.checksum()) == 16
    for name in ("model.norm.weight", "model.layers.0.mlp.up_proj.weight"):
        for bit in (0, 22, 31):
            c, _ = make_replica(torch.bfloat16)
            flat = c.master[name].view(-1).view(torch.int32)
            flat[3] ^= 1 << bit
            assert c.checksum() != a.checksum(), (name, bit)


def test_tensor_checksum_flipping_one_bit_changes_it():
    t = torch.randn(50, generator=torch.Generator().manual_seed(0))
    base = tensor_checksum(t)
    assert base == tensor_checksum(t.clone())
    u = t.clone()
    u.view(torch.int32)[17] ^= 1
    assert tensor_checksum(u) != base
    h = t.to(torch.bfloat16)
    h2 = h.clone()
    h2.view(torch.int16)[5] ^= 1 << 3
    assert tensor_checksum(h2) != tensor_checksum(h)


def test_checksum_depends_on_names_and_values_not_on_order():
    t1, t2 = torch.ones(3), torch.zeros(3)
    assert checksum([("a", t1), ("b", t2)]) == checksum([("b", t2), ("a", t1)])
    assert checksum([("a", t1), ("b", t2)]) != checksum([("a", t2), ("b", t1)])
    assert checksum([("a", t1)]) != checksum([("c", t1)])


# -- identical replicas -----------------------------------------------------------------------------------


def run_sequence(replica: Replica, n_iter: int = 4, population: int = 6, estimator: str = "one_point"):
    members = ask(population, estimator)
    stats = []
    for it in range(n_iter):
        for m in members:  # evaluation phase: perturb and restore every member
            replica.perturb(it, m.noise_id, m.sign, 1e-3)
            replica.restore()
        rewards = np.random.default_rng(it).uniform(size=population)
        stats.append(replica.update(it, members, zscore(rewards), 1e-3))
    return stats


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("estimator", ["one_point", "antithetic"])
def test_two_replicas_fed_the_same_updates_stay_bit_identical(optimizer, estimator):
    kw = dict(optimizer=optimizer, lr=1e-3 if optimizer == "adam" else 5e-4, weight_decay=0.01, anchor_decay=0.1)
    a, ea = make_replica(torch.bfloat16, **kw)
    b, eb = make_replica(torch.float32, **kw)
    start = a.checksum()
    sa = run_sequence(a, estimator=estimator)
    sb = run_sequence(b, estimator=estimator)
    assert a.checksum() == b.checksum() != start
    for k in a.master:
        assert torch.equal(a.master[k], b.master[k]), k
        assert torch.equal(ea.weights[k], a.master[k].to(torch.bfloat16))
        assert torch.equal(eb.weights[k], b.master[k])
    assert [s["update_norm"] for s in sa] == [s["update_norm"] for s in sb]


def test_replicas_diverge_when_fed_different_fitness():
    a, _ = make_replica(torch.float32, lr=1e-3)
    b, _ = make_replica(torch.float32, lr=1e-3)
    members = ask(4)
    a.update(0, members, np.array([1.0, -1.0, 0.0, 0.0]), 1e-3)
    b.update(0, members, np.array([-1.0, 1.0, 0.0, 0.0]), 1e-3)
    assert a.checksum() != b.checksum()


# -- trainable --------------------------------------------------------------------------------------------


def test_trainable_regex_restricts_which_tensors_change():
    params = initial_params()
    replica, engine = make_replica(torch.bfloat16, trainable=r"self_attn\.(q|v)_proj", lr=1e-2)
    assert replica.names == ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight"]
    frozen = ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    replica.perturb(0, 0, 1, SIGMA)
    assert set(engine.writes) == set(replica.names)
    for k in frozen:
        assert torch.equal(engine.weights[k], params[k].to(torch.bfloat16)), k
    for k in replica.names:
        assert not torch.equal(engine.weights[k], params[k].to(torch.bfloat16)), k
    replica.update(0, ask(4), np.array([1.0, 0.5, -0.5, -1.0]), SIGMA)
    for k in frozen:
        assert torch.equal(engine.weights[k], params[k].to(torch.bfloat16)), k
    for k in replica.names:
        assert not torch.equal(replica.master[k], params[k]), k


def test_trainable_regex_matching_nothing_raises():
    with pytest.raises(ValueError, match="trainable"):
        make_replica(torch.bfloat16, trainable=r"^lm_head\.")


# -- update health ----------------------------------------------------------------------------------------


def test_realised_cos_is_measured_as_one_for_an_fp32_engine():
    replica, engine = make_replica(torch.float32, lr=1e-3)
    before = clone(replica.master)
    stats = replica.update(0, ask(4), np.array([1.0, -0.2, 0.3, -1.1]), 1e-3)
    delta = torch.cat([(replica.master[k] - before[k]).view(-1) for k in before]).double()
    assert stats["update_norm"] > 0
    assert stats["update_norm"] == pytest.approx(float(delta.norm()), rel=1e-3)
    # measured from the engine's tensors: fp32 holds the master up to its own rounding of theta + delta
    assert stats["realised_cos"] == pytest.approx(1.0, abs=1e-6)
    assert stats["realised_norm"] == pytest.approx(float(delta.norm()), rel=1e-6)


def test_realised_measures_what_the_engine_held_not_the_cast():
    """An update applied while a perturbation is still written: the engine's change includes removing it."""
    replica, engine = make_replica(torch.float32, lr=1e-4)
    replica.perturb(0, 0, 1, 0.5)
    stats = replica.update(0, ask(4), np.array([1.0, -0.2, 0.3, -1.1]), 1e-3)
    assert stats["realised_cos"] < 0.9  # the removed perturbation dominates the change
    assert stats["realised_norm"] > 2 * stats["update_norm"]
    for k, v in replica.master.items():
        assert torch.equal(engine.weights[k], v)


def test_an_engine_that_loses_a_write_fails_the_update():
    replica, engine = make_replica(torch.bfloat16, lr=1e-2)
    write = engine.write

    def engine_write_dropping_norm(named):
        write((n, t) for n, t in named if n != "model.norm.weight")

    replica.write = engine_write_dropping_norm
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        replica.update(0, ask(4), np.array([1.0, -1.0, 0.5, -0.5]), 1e-2)


def test_without_a_read_back_the_realised_update_is_absent():
    params = initial_params()
    engine = Engine(params, torch.bfloat16)
    replica = Replica(params.items(), replica_spec(lr=1e-3), engine.write)  # no read: nothing to measure
    stats = replica.update(0, ask(4), np.array([1.0, -0.2, 0.3, -1.1]), 1e-3)
    assert stats["update_norm"] > 0
    assert stats["realised_cos"] is None and stats["realised_norm"] is None
    none_read = Replica(params.items(), replica_spec(lr=1e-3), engine.write, lambda name: None)
    assert none_read.update(0, ask(4), np.array([1.0, -0.2, 0.3, -1.1]), 1e-3)["realised_cos"] is None


def test_realised_sums_and_mismatches_are_the_same_in_chunks(monkeypatch):
    import es_ray.replica as replica_module

    g = torch.Generator().manual_seed(3)
    master, delta = torch.randn(37, 11, generator=g), 1e-3 * torch.randn(37, 11, generator=g)
    held = (master - delta).bfloat16()
    r, d = (master.bfloat16().double() - held.double()).view(-1), delta.double().view(-1)
    expected = (float(d @ d), float(r @ d), float(r @ r))
    bad = master.bfloat16().clone()
    bad[5, 3] += 1
    bad[36, 0] += 1
    for chunk in (1 << 20, 30, 5):  # one chunk; 2 rows per chunk; one row per chunk (a row exceeds it)
        monkeypatch.setattr(replica_module, "CHUNK", chunk)
        assert update_sums(delta, master, held) == pytest.approx(expected, rel=1e-6)  # fp32 dots per chunk
        assert update_sums(delta, master, None) == pytest.approx(expected[:1], rel=1e-6)
        assert mismatches(master, master.bfloat16()) == 0
        assert mismatches(master, bad) == 2
    assert len(list(replica_module._row_chunks(master, held))) == 37
    kept = master.clone()
    update_sums(delta, master, master - delta)  # an fp32 engine: the cast is the master itself, left untouched
    assert torch.equal(master, kept)


# -- state ------------------------------------------------------------------------------------------------


def test_state_dict_round_trip_resumes_identically():
    kw = dict(optimizer="adam", lr=1e-3, anchor_decay=0.5)
    a, _ = make_replica(torch.bfloat16, **kw)
    members = ask(4)
    fits = [zscore(np.random.default_rng(i).uniform(size=4)) for i in range(4)]
    for it in range(2):
        a.update(it, members, fits[it], 1e-2)
    buf = io.BytesIO()
    torch.save({k: v for k, v in a.state_dict().items() if k != "shards"}, buf)  # what a checkpoint holds
    buf.seek(0)
    # a fresh replica from other weights: loading must restore the master, theta0 and Adam's state
    other = {k: torch.full_like(v, 0.5) for k, v in initial_params().items()}
    b, eb = make_replica(torch.bfloat16, params=other, **kw)
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert b.checksum() == a.checksum()
    assert b.opt.t == a.opt.t == 2
    for k in a.master:
        assert torch.equal(b.master[k], a.master[k])
        assert torch.equal(b.theta0[k], initial_params()[k])
        assert torch.equal(eb.weights[k], b.master[k].to(torch.bfloat16))  # load writes into the engine
    for it in range(2, 4):
        a.update(it, members, fits[it], 1e-2)
        b.update(it, members, fits[it], 1e-2)
    assert b.checksum() == a.checksum()
    for k in a.master:
        assert torch.equal(b.master[k], a.master[k])


# -- the spec ---------------------------------------------------------------------------------------------


def test_spec_from_config_carries_every_es_setting():
    """Every ReplicaSpec field is read from the config key it names: changing each key changes that field alone.
    The ES settings the replica does not use are listed here, so a new one has to be placed on one side."""
    driver_only = {
        "population",
        "sigma",
        "iterations",
        "prompts_per_iteration",
        "shaping",
        "estimator",
        "checksum_every",
        "on_mismatch",
        "samples_per_prompt",
        "fitness_baseline",
    }  # how the workers sample and score, not the update
    fields = dataclasses.fields(ReplicaSpec)
    keys = {f.name: f.metadata["config"] for f in fields}
    es_keys = {k.removeprefix("es.") for k in keys.values() if k.startswith("es.")}
    assert es_keys == {f.name for f in dataclasses.fields(ESConfig)} - driver_only
    base = spec_from_config(ESTrainConfig())
    for f in fields:
        cfg = ESTrainConfig()
        section, _, attr = keys[f.name].partition(".")
        old = getattr(getattr(cfg, section), attr)
        new = old + "x" if isinstance(old, str) else old + 3
        setattr(getattr(cfg, section), attr, new)
        spec = spec_from_config(cfg)
        assert getattr(spec, f.name) == new, f.name
        assert dataclasses.replace(spec, **{f.name: old}) == base, f"{keys[f.name]} changed another field"


def test_spec_has_no_defaults_and_holds_plain_scalars():
    import pickle

    with pytest.raises(TypeError):
        ReplicaSpec(run_seed=1)  # every field comes from the config, none from a default of its own
    spec = spec_from_config(ESTrainConfig())
    assert all(isinstance(getattr(spec, f.name), (int, float, str)) for f in dataclasses.fields(spec))
    assert pickle.loads(pickle.dumps(spec)) == spec


# -- tensor-parallel shards ---------------------------------------------------------------------------------


def two_rank_shards(rank: int) -> dict[str, Shard]:
    """A fake 2-rank split of ``initial_params`` as vLLM splits a Llama: q_proj by rows (column-parallel), up_proj
    by columns (as a row-parallel weight), v_proj whole on both ranks (one KV head, replicated) and the norm too."""
    return {
        "model.layers.0.self_attn.q_proj.weight": Shard.part((16, 8), 0, 8 * rank, 8 * rank + 8),
        "model.layers.0.self_attn.v_proj.weight": Shard((16, 8), owner=rank == 0),
        "model.layers.0.mlp.up_proj.weight": Shard.part((24, 8), 1, 4 * rank, 4 * rank + 4),
        "model.norm.weight": Shard((8,), owner=rank == 0),
    }


class RankEngine(Engine):
    """One rank of a fake tensor-parallel engine: its loader receives whole HF tensors and keeps its part, as
    vLLM's weight loaders do; it records whether anything outside its part was NaN (the setup's proof)."""

    def __init__(self, params: dict[str, torch.Tensor], dtype: torch.dtype, shards: dict[str, Shard]):
        self.shards = shards
        super().__init__({k: shards[k].take(v) for k, v in params.items()}, dtype)
        self.nan_outside = False

    def write(self, named) -> None:
        for name, whole in named:
            shard = self.shards[name]
            assert tuple(whole.shape) == shard.shape and whole.dtype == torch.float32
            part = shard.take(whole)
            self.nan_outside |= bool(whole.isnan().sum() > part.isnan().sum())
            self.writes.append(name)
            self.weights[name].copy_(part)


def make_ranks(dtype=torch.float32, params=None, **spec_kw):
    params = initial_params() if params is None else params
    out = []
    for rank in range(2):
        shards = two_rank_shards(rank)
        engine = RankEngine(params, dtype, shards)
        out.append(
            (
                Replica(
                    ((k, shards[k].take(v)) for k, v in params.items()),
                    replica_spec(**spec_kw),
                    engine.write,
                    engine.read,
                    shards=shards,
                ),
                engine,
            )
        )
    return out


def test_shard_part_of_a_whole_dim_is_the_whole_tensor():
    assert Shard.part((16, 8), 0, 0, 16) == Shard((16, 8))
    half = Shard.part((16, 8), 1, 4, 8, owner=False)
    assert half.local_shape == (16, 4) and half.index == (slice(None), slice(4, 8)) and str(half) == "[:, 4:8]"
    t = torch.arange(128.0).view(16, 8)
    assert torch.equal(half.take(t), t[:, 4:8])
    with pytest.raises(ValueError, match="does not fit"):
        Shard.part((16, 8), 0, 8, 17)


@pytest.mark.parametrize("noise", ["per_tensor", "table", "counter"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_each_rank_holds_its_part_of_the_unsplit_perturbation(noise, dtype):
    """Layout independence across TP degrees: a rank's part of the perturbed weights is the unsplit replica's,
    sliced, bit for bit (the noise is the whole tensor's, drawn per HF tensor), and restore is exact on each."""
    kw = dict(noise=noise, noise_table_size=1 << 12)
    whole, ew = make_replica(dtype, **kw)
    ranks = make_ranks(dtype, **kw)
    before = [clone(e.weights) for _, e in ranks]
    for replica in [whole] + [r for r, _ in ranks]:
        replica.perturb(2, 3, -1, SIGMA)
    for rank, (_, engine) in enumerate(ranks):
        for name, shard in two_rank_shards(rank).items():
            assert torch.equal(engine.weights[name], shard.take(ew.weights[name])), (rank, name)
    for (replica, engine), held in zip(ranks, before):
        replica.restore()
        for name in held:
            assert torch.equal(engine.weights[name], held[name]), name
        assert replica.engine_mismatches() == {}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_split_replicas_update_to_the_unsplit_checksum_and_state(optimizer):
    """Two ranks fed the same updates as one unsplit replica: their combined checksum is the unsplit one's, their
    gathered state (each part from its owner) is its state, and the update health agrees."""
    kw = dict(optimizer=optimizer, lr=1e-3 if optimizer == "adam" else 5e-4, weight_decay=0.01, anchor_decay=0.1)
    whole, _ = make_replica(torch.float32, **kw)
    ranks = make_ranks(torch.float32, **kw)
    assert combine_checksums(r.checksum_parts() for r, _ in ranks) == whole.checksum()
    stats = run_sequence(whole)
    rank_stats = [run_sequence(r) for r, _ in ranks]
    assert combine_checksums(r.checksum_parts() for r, _ in ranks) == whole.checksum()
    combined = update_health(s[-1]["sums"] for s in rank_stats)
    assert combined["update_norm"] == pytest.approx(stats[-1]["update_norm"], rel=1e-6)
    assert combined["realised_cos"] == pytest.approx(1.0, abs=1e-6)
    gathered, ref = gather_states(r.state_dict() for r, _ in ranks), whole.state_dict()
    assert gathered["optimizer"]["t"] == ref["optimizer"]["t"] == 4
    for part in ("master", "theta0"):
        assert gathered[part].keys() == ref[part].keys()
        assert all(torch.equal(gathered[part][k], ref[part][k]) for k in ref[part]), part
    for name, moments in ref["optimizer"]["state"].items():
        assert all(torch.equal(gathered["optimizer"]["state"][name][k], v) for k, v in moments.items())


def test_a_split_replica_loads_its_part_of_a_whole_state():
    whole, _ = make_replica(torch.float32, optimizer="adam", lr=1e-3)
    run_sequence(whole, n_iter=2)
    ranks = make_ranks(torch.float32, optimizer="adam", lr=1e-3)
    for replica, engine in ranks:
        replica.load_state_dict(whole.state_dict())
        assert replica.opt.t == 2 and replica.engine_mismatches() == {}
    assert combine_checksums(r.checksum_parts() for r, _ in ranks) == whole.checksum()
    with pytest.raises(ValueError, match="neither the whole tensor"):
        ranks[0][0].load_state_dict({**whole.state_dict(), "master": {k: v[:1] for k, v in whole.master.items()}})


def test_ranks_that_diverge_or_leave_a_gap_are_refused():
    ranks = make_ranks()
    parts = [r.checksum_parts() for r, _ in ranks]
    norm = "model.norm.weight"
    ranks[1][0].master[norm][0] += 1.0  # a replicated tensor now differs between the ranks
    with pytest.raises(RuntimeError, match=r"ranks 0 and 1 hold different weights for model.norm.weight"):
        combine_checksums([parts[0], ranks[1][0].checksum_parts()])
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match="do not cover it exactly once"):
        combine_checksums([parts[0], {k: v for k, v in parts[1].items() if k != q}])
    with pytest.raises(ValueError, match="only its owner sends it"):
        gather_shards([({q: Shard((16, 8))}, {q: torch.zeros(16, 8)})] * 2)


def test_a_split_replica_reads_only_its_part_and_proves_the_split_with_nan(tmp_path):
    """from_checkpoint reads a rank's part from disk, and its first write fills the rest of each whole tensor with
    NaN, so an engine whose loader read outside the part would hold NaN."""
    from safetensors.torch import save_file

    params = initial_params()
    save_file(params, str(tmp_path / "model.safetensors"))
    shards = two_rank_shards(1)
    engine = RankEngine(params, torch.float32, shards)
    replica = Replica.from_checkpoint(
        str(tmp_path), list(params), replica_spec(), engine.write, engine.read, shards=shards
    )
    assert engine.nan_outside and replica.engine_mismatches() == {}
    for name, shard in shards.items():
        assert torch.equal(replica.master[name], shard.take(params[name]))
        assert torch.equal(engine.weights[name], shard.take(params[name]))
