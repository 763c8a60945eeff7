"""ES math: fitness shaping, ask, noise coefficients, and the full update of Replica.update against plain numpy.

Update convention (es_ray/strategy.py, docs/design.md "ES, precisely" 5):
    g      = 1 / (N sigma) * sum_i z_i eps_i
    theta <- theta + lr * g                  (sgd; Adam with bias correction on g for adam)
             - lr * weight_decay * theta
             - lr * anchor_decay * (theta - theta0)
The numpy references below regenerate eps through NoiseSource and sum over the members one by one (sign
included), never through es_ray's own coefficient merging.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import Engine, replica_spec

from es_ray.noise import NoiseSource
from es_ray.replica import Replica
from es_ray.core.config import ConfigError
from es_ray.strategy import Member, Optimizer, ask, centered_rank, noise_coefficients, shape_fitness, zscore

SEED = 20260
TABLE_SIZE = 4096


# -- fitness shaping --------------------------------------------------------------------------------------


def test_zscore_hand_computed():
    # mean 2.5, population std sqrt(5)/2 -> (r - 2.5) / (sqrt(5)/2) = [-3, -1, 1, 3] / sqrt(5)
    np.testing.assert_allclose(
        zscore(np.array([1.0, 2.0, 3.0, 4.0])), np.array([-3, -1, 1, 3]) / np.sqrt(5), rtol=0, atol=1e-12
    )
    # the order of the rewards is kept
    np.testing.assert_allclose(zscore([4.0, 1.0, 3.0, 2.0]), np.array([3, -3, 1, -1]) / np.sqrt(5), atol=1e-12)


def test_zscore_matches_numpy():
    r = np.random.default_rng(0).normal(3.0, 2.0, size=17)
    z = zscore(r)
    np.testing.assert_allclose(z, (r - r.mean()) / r.std(ddof=0), rtol=1e-12)
    assert abs(z.mean()) < 1e-12 and abs(z.std() - 1) < 1e-12


@pytest.mark.parametrize("shaper", [zscore, centered_rank])
@pytest.mark.parametrize("rewards", [[0.5] * 6, [0.0, 0.0], [1.0] * 3])
def test_all_equal_rewards_give_zeros(shaper, rewards):
    z = shaper(np.array(rewards))
    assert z.shape == (len(rewards),)
    assert np.array_equal(z, np.zeros(len(rewards)))


def test_zscore_tiny_spread_below_eps_gives_zeros():
    assert np.array_equal(zscore(np.array([1.0, 1.0 + 1e-12, 1.0])), np.zeros(3))


def test_centered_rank_hand_computed():
    np.testing.assert_allclose(centered_rank(np.array([10.0, 30.0, 20.0])), [-0.5, 0.5, 0.0], atol=1e-15)
    # ties share their mean rank: ranks 0, 1.5, 1.5, 3 over n - 1 = 3
    np.testing.assert_allclose(centered_rank(np.array([1.0, 2.0, 2.0, 3.0])), [-0.5, 0.0, 0.0, 0.5], atol=1e-15)
    # ties at the bottom: ranks 0.5, 0.5, 2, 3 over 3
    np.testing.assert_allclose(
        centered_rank(np.array([0.0, 0.0, 5.0, 9.0])), [0.5 / 3 - 0.5, 0.5 / 3 - 0.5, 2 / 3 - 0.5, 0.5], atol=1e-15
    )
    assert np.array_equal(centered_rank(np.array([7.0])), np.zeros(1))


def _rank_reference(r: np.ndarray) -> np.ndarray:
    """Average rank by counting: #smaller + (#equal - 1) / 2, mapped to [-0.5, 0.5]."""
    less = (r[None, :] < r[:, None]).sum(1)
    equal = (r[None, :] == r[:, None]).sum(1)
    return (less + (equal - 1) / 2) / (r.size - 1) - 0.5


def test_centered_rank_matches_counting_reference_with_ties():
    r = np.random.default_rng(1).integers(0, 5, size=23).astype(float)  # many ties
    z = centered_rank(r)
    np.testing.assert_allclose(z, _rank_reference(r), atol=1e-12)
    assert z.min() >= -0.5 and z.max() <= 0.5
    assert abs(z.sum()) < 1e-9  # centred


def test_shape_fitness_dispatches():
    r = [0.1, 0.9, 0.4]
    np.testing.assert_array_equal(shape_fitness(r, "zscore"), zscore(np.array(r)))
    np.testing.assert_array_equal(shape_fitness(r, "centered_rank"), [-0.5, 0.5, 0.0])
    with pytest.raises(ConfigError, match="es.shaping='softmax' is not one of zscore, centered_rank"):
        shape_fitness(r, "softmax")


# -- ask / noise_coefficients -----------------------------------------------------------------------------


def test_ask_one_point():
    members = ask(5, "one_point")
    assert members == [Member(i, i, 1) for i in range(5)]


def test_ask_antithetic_pairs():
    members = ask(6, "antithetic")
    assert [m.index for m in members] == list(range(6))
    assert [m.noise_id for m in members] == [0, 0, 1, 1, 2, 2]
    assert [m.sign for m in members] == [1, -1, 1, -1, 1, -1]


def test_ask_refuses_odd_antithetic_and_unknown_estimator():
    with pytest.raises(ValueError, match="even"):
        ask(5, "antithetic")
    with pytest.raises(ValueError, match="estimator"):
        ask(4, "two_point")


def test_noise_coefficients_one_point_sorted_by_noise_id():
    members = [Member(2, 2, 1), Member(0, 0, 1), Member(1, 1, 1)]
    assert noise_coefficients(members, [0.5, -1.0, 2.0]) == [(0, 0.5), (1, -1.0), (2, 2.0)]


def test_noise_coefficients_merge_antithetic_pairs():
    members = ask(4, "antithetic")
    # pair k: z_2k - z_2k+1
    assert noise_coefficients(members, np.array([1.0, 2.0, 3.0, 5.0])) == [(0, -1.0), (1, -2.0)]
    assert noise_coefficients(members, np.array([0.25, 0.25, -1.0, 1.0])) == [(0, 0.0), (1, -2.0)]


def test_optimizer_refuses_unknown_kind():
    with pytest.raises(ValueError, match="optimizer"):
        Optimizer("rmsprop", lr=0.1)


# -- the full update, against numpy -----------------------------------------------------------------------


def initial_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(12, 8, generator=g),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(12, 8, generator=g),  # same shape as q_proj
        "model.norm.weight": 1.0 + 0.1 * torch.randn(8, generator=g),
    }


def make_replica(dtype: torch.dtype = torch.bfloat16, params=None, **spec_kw):
    """A replica beside a stand-in engine (weights in its own dtype, written by copy, read back)."""
    params = initial_params() if params is None else params
    engine = Engine(params, dtype)
    return Replica(params.items(), replica_spec(SEED, **spec_kw), engine.write, engine.read), engine


def eps_np(iteration: int, noise_id: int, name: str, shape, noise: str = "per_tensor") -> np.ndarray:
    src = NoiseSource(SEED, noise, TABLE_SIZE)
    return src.noise(iteration, noise_id, name, torch.Size(shape)).numpy().astype(np.float64)


def reference_g(
    theta: dict[str, np.ndarray], iteration: int, members, fitness, sigma: float, noise: str = "per_tensor"
) -> dict[str, np.ndarray]:
    """g = 1/(N sigma) sum_i z_i s_i eps_{noise_id(i)}, summed member by member."""
    n = len(members)
    out = {}
    for name, th in theta.items():
        acc = np.zeros_like(th)
        for m in members:
            acc += fitness[m.index] * m.sign * eps_np(iteration, m.noise_id, name, th.shape, noise)
        out[name] = acc / (n * sigma)
    return out


def reference_run(
    steps,
    *,
    optimizer="sgd",
    lr,
    weight_decay=0.0,
    anchor_decay=0.0,
    betas=(0.9, 0.999),
    adam_eps=1e-8,
    noise="per_tensor",
):
    """Plain numpy float64 ES: steps = [(iteration, members, fitness, sigma)]; returns theta and deltas per step."""
    theta = {k: v.numpy().astype(np.float64) for k, v in initial_params().items()}
    theta0 = {k: v.copy() for k, v in theta.items()}
    m = {k: np.zeros_like(v) for k, v in theta.items()}
    v2 = {k: np.zeros_like(v) for k, v in theta.items()}
    history = []
    for t, (iteration, members, fitness, sigma) in enumerate(steps, start=1):
        g = reference_g(theta, iteration, members, fitness, sigma, noise)
        deltas = {}
        for name in theta:
            if optimizer == "adam":
                m[name] = betas[0] * m[name] + (1 - betas[0]) * g[name]
                v2[name] = betas[1] * v2[name] + (1 - betas[1]) * g[name] ** 2
                m_hat = m[name] / (1 - betas[0] ** t)
                v_hat = v2[name] / (1 - betas[1] ** t)
                step = lr * m_hat / (np.sqrt(v_hat) + adam_eps)
            else:
                step = lr * g[name]
            step = step - lr * weight_decay * theta[name] - lr * anchor_decay * (theta[name] - theta0[name])
            deltas[name] = step
            theta[name] = theta[name] + step
        history.append(({k: x.copy() for k, x in theta.items()}, deltas))
    return history


def fitness_for(iteration: int, n: int) -> np.ndarray:
    rewards = np.random.default_rng(100 + iteration).uniform(0, 1, size=n)
    return zscore(rewards)


def assert_master_close(replica: Replica, theta: dict[str, np.ndarray], atol: float):
    assert sorted(replica.master) == sorted(theta)
    for name, ref in theta.items():
        got = replica.master[name].double().numpy()
        np.testing.assert_allclose(got, ref, rtol=0, atol=atol, err_msg=name)


def assert_engine_holds_cast_master(replica: Replica, engine: Engine):
    for name, t in replica.master.items():
        assert torch.equal(engine.weights[name], t.to(engine.dtype)), name


SIGMA, LR = 0.1, 0.02
ATOL = 2e-6  # fp32 master vs float64 reference; the steps themselves are ~1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("noise", ["per_tensor", "table"])
@pytest.mark.parametrize("weight_decay,anchor_decay", [(0.0, 0.0), (0.5, 0.0), (0.0, 0.7), (0.3, 0.4)])
def test_sgd_update_matches_numpy(dtype, noise, weight_decay, anchor_decay):
    n = 6
    members = ask(n, "one_point")
    steps = [(it, members, fitness_for(it, n), SIGMA) for it in range(3)]
    replica, engine = make_replica(
        dtype,
        optimizer="sgd",
        lr=LR,
        weight_decay=weight_decay,
        anchor_decay=anchor_decay,
        noise=noise,
        noise_table_size=TABLE_SIZE,
    )
    history = reference_run(steps, lr=LR, weight_decay=weight_decay, anchor_decay=anchor_decay, noise=noise)
    for (it, mem, fit, sigma), (theta_ref, deltas) in zip(steps, history):
        stats = replica.update(it, mem, fit, sigma)
        assert_master_close(replica, theta_ref, ATOL)
        assert_engine_holds_cast_master(replica, engine)
        ref_norm = np.sqrt(sum(float((d**2).sum()) for d in deltas.values()))
        assert ref_norm > 0.05  # the steps are far above the tolerance
        assert stats["update_norm"] == pytest.approx(ref_norm, rel=1e-5)
    if weight_decay or anchor_decay:  # the decays change the result well beyond the tolerance
        plain = reference_run(steps, lr=LR, noise=noise)[-1][0]
        assert max(np.abs(plain[k] - history[-1][0][k]).max() for k in plain) > 100 * ATOL


@pytest.mark.parametrize("weight_decay,anchor_decay", [(0.0, 0.0), (0.2, 0.5)])
def test_adam_update_matches_numpy_with_bias_correction(weight_decay, anchor_decay):
    n, lr = 6, 0.01
    members = ask(n, "one_point")
    steps = [(it, members, fitness_for(it, n), SIGMA) for it in range(4)]
    replica, engine = make_replica(
        torch.bfloat16,
        optimizer="adam",
        lr=lr,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_eps=1e-8,
        weight_decay=weight_decay,
        anchor_decay=anchor_decay,
    )
    history = reference_run(steps, optimizer="adam", lr=lr, weight_decay=weight_decay, anchor_decay=anchor_decay)
    for (it, mem, fit, sigma), (theta_ref, _) in zip(steps, history):
        replica.update(it, mem, fit, sigma)
        assert_master_close(replica, theta_ref, 1e-6)
        assert_engine_holds_cast_master(replica, engine)
    assert replica.opt.t == 4
    assert set(replica.opt.state) == set(initial_params())  # one moment pair per tensor, none shared


def test_antithetic_update_equals_explicit_sum_over_members():
    n = 6
    members = ask(n, "antithetic")
    fitness = np.array([1.2, -0.3, 0.4, 0.9, -1.5, -0.7])
    replica, engine = make_replica(torch.float32, optimizer="sgd", lr=LR)
    theta = {k: v.numpy().astype(np.float64) for k, v in initial_params().items()}
    replica.update(5, members, fitness, SIGMA)
    # explicit: 1/(N sigma) [z0 e0 - z1 e0 + z2 e1 - z3 e1 + z4 e2 - z5 e2]
    for name, th in theta.items():
        e = [eps_np(5, k, name, th.shape) for k in range(3)]
        explicit = (
            fitness[0] * e[0]
            - fitness[1] * e[0]
            + fitness[2] * e[1]
            - fitness[3] * e[1]
            + fitness[4] * e[2]
            - fitness[5] * e[2]
        ) / (n * SIGMA)
        np.testing.assert_allclose(replica.master[name].double().numpy(), th + LR * explicit, rtol=0, atol=ATOL)
    assert_engine_holds_cast_master(replica, engine)


def test_antithetic_pairs_with_equal_fitness_cancel():
    members = ask(4, "antithetic")
    replica, _ = make_replica(torch.float32, optimizer="sgd", lr=LR)
    before = {k: v.clone() for k, v in replica.master.items()}
    stats = replica.update(0, members, np.array([0.8, 0.8, -0.8, -0.8]), SIGMA)
    assert stats["update_norm"] == 0.0
    assert all(torch.equal(before[k], replica.master[k]) for k in before)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("estimator", ["one_point", "antithetic"])
def test_zero_fitness_gives_zero_update(optimizer, estimator):
    members = ask(4, estimator)
    replica, engine = make_replica(torch.bfloat16, optimizer=optimizer, lr=LR)
    before = {k: v.clone() for k, v in replica.master.items()}
    for it, rewards in enumerate([[0.5] * 4, [0.0] * 4]):
        for shaped in (zscore(np.array(rewards)), centered_rank(np.array(rewards))):
            stats = replica.update(it, members, shaped, SIGMA)
            assert stats["update_norm"] == 0.0
            assert stats["realised_norm"] == 0.0
            assert stats["realised_cos"] is None  # the cosine of no update is not a number to report
    for name in before:
        assert torch.equal(replica.master[name], before[name]), name
    assert_engine_holds_cast_master(replica, engine)


def test_update_uses_the_iteration_noise():
    """The same fitness at another iteration gives another update (noise depends on t)."""
    members = ask(4)
    fit = np.array([1.0, -1.0, 0.5, -0.5])
    a, _ = make_replica(torch.float32, lr=LR)
    b, _ = make_replica(torch.float32, lr=LR)
    a.update(0, members, fit, SIGMA)
    b.update(1, members, fit, SIGMA)
    assert not torch.equal(a.master["model.norm.weight"], b.master["model.norm.weight"])


@pytest.mark.parametrize("estimator", ["one_point", "antithetic"])
def test_replica_update_equals_the_written_out_formula_bit_for_bit(estimator):
    """Exact replicas rest on the update's bits, not on a tolerance: Replica.update (through strategy.gradient)
    equals g = sum_k w_k eps_k added in noise_id order in fp32, w_k = c_k * (1 / (N sigma)), then theta += lr * g,
    written out here with NoiseSource, element for element."""
    members = ask(6, estimator)
    fitness = zscore(np.array([0.3, 0.9, 0.1, 0.5, 0.7, 0.2]))
    replica, engine = make_replica(torch.float32, optimizer="sgd", lr=LR)
    src = NoiseSource(SEED, "per_tensor")
    scale = 1.0 / (len(members) * SIGMA)
    expected = {}
    for name, theta in initial_params().items():
        g = None
        for noise_id, c in noise_coefficients(members, fitness):
            term = src.noise(4, noise_id, name, theta.shape).clone() * (c * scale)
            g = term if g is None else g.add_(src.noise(4, noise_id, name, theta.shape), alpha=c * scale)
        expected[name] = theta.clone().add_(g.mul_(LR))
    replica.update(4, members, fitness, SIGMA)
    for name, want in expected.items():
        assert torch.equal(replica.master[name], want), name
    assert_engine_holds_cast_master(replica, engine)
