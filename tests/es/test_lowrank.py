"""Low-rank ES (es.perturbation=lowrank): the factors come from the tensor's own seed, the merged perturbation has
unit variance, the one-matmul update equals the sum of the members' merged perturbations, replicas stay equal bit
for bit, and bad ranks are refused naming the key."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from helpers import Engine, initial_params, replica_spec

from es_ray import lowrank
from es_ray.es.config import ESTrainConfig, validate
from es_ray.core.config import ConfigError
from es_ray.noise import NoiseSource
from es_ray.replica import Replica
from es_ray.strategy import ask, noise_coefficients, zscore

SIGMA = 0.05
RANK = 4
Q = "model.layers.0.self_attn.q_proj.weight"


def lowrank_spec(**kw):
    return dataclasses.replace(replica_spec(7), perturbation="lowrank", rank=RANK, **kw)


def make(dtype=torch.float32, **kw):
    params = initial_params()
    engine = Engine(params, dtype)
    return Replica(params.items(), lowrank_spec(**kw), engine.write, engine.read), engine, params


def test_targets_are_linear_weights_only():
    assert lowrank.is_target(Q, (16, 8))
    assert lowrank.is_target("model.layers.3.mlp.down_proj.weight", (8, 24))
    assert not lowrank.is_target("model.norm.weight", (8,))
    assert not lowrank.is_target("model.layers.0.self_attn.q_proj.bias", (16,))
    assert not lowrank.is_target("model.embed_tokens.weight", (49152, 576))
    assert not lowrank.is_target("lm_head.weight", (49152, 576))
    replica, _, params = make()
    assert replica.names == sorted(n for n, t in params.items() if t.dim() == 2)


def test_factors_come_from_the_tensor_seed_and_merge_to_unit_variance():
    replica, _, _ = make()
    b, a = replica.factors(3, 1, Q)
    drawn = NoiseSource(7, "per_tensor").noise(3, 1, Q, (16 + 8, RANK))
    assert torch.equal(b, drawn[:16]) and torch.equal(a, drawn[16:])
    # a different member or tensor gives other factors
    assert not torch.equal(replica.factors(3, 2, Q)[0], b)
    # elements of one E share factors, so average the variance over independent members (std of the mean ~0.006)
    source = NoiseSource(1, "per_tensor")
    merged = [lowrank.merged(*lowrank.split_factors(source.noise(0, i, "w", (256, 8)), (128, 128))) for i in range(50)]
    assert merged[0].shape == (128, 128)
    assert abs(float(torch.stack([e.var() for e in merged]).mean()) - 1.0) < 0.03
    assert abs(float(torch.stack(merged).mean())) < 0.01


def test_perturb_writes_master_plus_merged_lowrank_noise_and_restore_is_exact():
    replica, engine, params = make()
    replica.perturb(2, 1, -1, SIGMA)
    b, a = replica.factors(2, 1, Q)
    expected = params[Q] - SIGMA * lowrank.merged(b, a)
    assert torch.allclose(engine.weights[Q], expected, atol=1e-6)
    assert torch.equal(engine.weights["model.norm.weight"], params["model.norm.weight"])  # not a target
    replica.restore()
    assert all(torch.equal(engine.weights[n], params[n]) for n in params)


def test_member_factors_give_the_perturbed_layer_output():
    replica, engine, params = make()
    members = ask(4, "antithetic")
    factors = replica.member_factors(1, members, SIGMA)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    for k, m in enumerate(members):
        replica.perturb(1, m.noise_id, m.sign, SIGMA)
        a, b_s = factors[Q]
        got = x @ params[Q].T + lowrank.lowrank_output(x, a[k], b_s[k])
        assert torch.allclose(got, x @ engine.weights[Q].T, atol=1e-5)
    replica.restore()


def test_update_is_the_sum_of_merged_member_perturbations():
    replica, engine, params = make()
    members = ask(6)
    fitness = zscore(np.array([0.1, 0.9, 0.4, 0.0, 0.7, 0.3]))
    replica.update(0, members, fitness, SIGMA)
    scale = 1.0 / (len(members) * SIGMA)
    expected = params[Q].double().clone()
    for noise_id, c in noise_coefficients(members, fitness):
        b, a = replica.factors(0, noise_id, Q)
        expected += replica_spec(7).lr * c * scale * lowrank.merged(b, a).double()
    assert torch.allclose(replica.master[Q].double(), expected, atol=1e-6)
    assert torch.equal(engine.weights["model.norm.weight"], params["model.norm.weight"])


def test_the_update_is_bit_identical_across_thread_counts():
    threads = torch.get_num_threads()
    sums = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            replica, _, _ = make()
            replica.update(0, ask(8), zscore(np.arange(8.0)), SIGMA)
            sums.append(replica.checksum())
    finally:
        torch.set_num_threads(threads)
    assert sums[0] == sums[1]


@pytest.mark.parametrize("kind", ["table", "counter"])
def test_every_noise_kind_gives_lowrank_factors(kind):
    replica, engine, params = make(noise=kind, noise_table_size=1 << 12)
    replica.update(0, ask(4), zscore(np.array([1.0, 0.0, 0.5, 2.0])), SIGMA)
    assert not torch.equal(replica.master[Q], params[Q])


def test_ranks_out_of_range_are_refused_naming_the_key():
    shapes = {Q: (16, 8), "model.norm.weight": (8,)}
    lowrank.check_rank(8, shapes)
    with pytest.raises(ConfigError, match=r"es.rank=9 exceeds min\(out, in\)=8"):
        lowrank.check_rank(9, shapes)
    with pytest.raises(ConfigError, match="es.rank=0"):
        lowrank.check_rank(0, shapes)
    with pytest.raises(ConfigError, match="selects none"):
        lowrank.check_rank(1, {"model.norm.weight": (8,)})
    with pytest.raises(ConfigError, match="es.rank=9"):
        Replica(initial_params().items(), dataclasses.replace(lowrank_spec(), rank=9), lambda named: None)


def test_config_refuses_bad_perturbation_and_rank():
    cfg = ESTrainConfig()
    cfg.es.perturbation = "sparse"
    with pytest.raises(ConfigError, match="es.perturbation='sparse' is not one of full, lowrank"):
        validate(cfg)
    cfg.es.perturbation, cfg.es.rank = "lowrank", 0
    with pytest.raises(ConfigError, match="es.rank=0"):
        validate(cfg)
    cfg.es.rank = 4
    cfg.engine.tensor_parallel_size = 2
    cfg.engine.name = "vllm"
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        validate(cfg)


def test_preflight_checks_the_rank_against_the_model(tiny_model_dir):
    from es_ray.es.driver import preflight_perturbation
    from es_ray.models import safetensors_index

    smallest = min(min(s) for n, (_, s) in safetensors_index(tiny_model_dir).items() if lowrank.is_target(n, s))
    cfg = ESTrainConfig()
    cfg.es.perturbation, cfg.es.rank = "lowrank", smallest
    preflight_perturbation(cfg, tiny_model_dir)
    cfg.es.rank = smallest + 1
    with pytest.raises(ConfigError, match=f"es.rank={smallest + 1} exceeds"):
        preflight_perturbation(cfg, tiny_model_dir)


def test_share_of_parameters_lowrank_trains(tiny_model_dir):
    """The docs' claim, on the tiny model: lowrank trains the projections, not the embedding or norms."""
    from es_ray.models import safetensors_index

    shapes = {n: s for n, (_, s) in safetensors_index(tiny_model_dir).items()}
    trained = sum(math.prod(s) for n, s in shapes.items() if lowrank.is_target(n, s))
    assert 0 < trained < sum(math.prod(s) for s in shapes.values())
