"""Objectives over several samples per prompt (es_ray/metrics/coverage.py) and GRPO's pass@k advantages, against
brute-force enumeration over subsets and plain numpy references."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from es_ray.core.config import ConfigError
from es_ray.metrics.coverage import check_objective, member_fitness, pass_at_k_advantages, prompt_values
from es_ray.metrics.passk import pass_at_k
from es_ray.grpo.loss import group_advantages, objective_advantages


def brute_pass_at_k(r, k: int) -> float:
    """Mean over every k-subset of the best reward in it."""
    subsets = list(itertools.combinations(r, k))
    return sum(max(s) for s in subsets) / len(subsets)


def brute_contribution(r, i: int, k: int) -> float:
    """Mean over the k-subsets holding i of best(T) - best(T without i), the best of nothing being 0."""
    others = [j for j in range(len(r)) if j != i]
    subsets = list(itertools.combinations(others, k - 1))
    return sum(max([r[i]] + [r[j] for j in u]) - max([r[j] for j in u], default=0.0) for u in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_of_binary_rewards_is_chens_unbiased_estimator(n):
    rng = np.random.default_rng(n)
    for k in range(1, n + 1):
        for c in range(n + 1):
            r = rng.permutation([1.0] * c + [0.0] * (n - c))
            assert prompt_values(r[None], "pass_at_k", k)[0] == pytest.approx(pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_of_dense_rewards_is_the_expected_best_of_k():
    rng = np.random.default_rng(0)
    r_ps = rng.uniform(size=(3, 6))
    r_ps[0, :2] = r_ps[0, 2]  # ties
    for k in range(1, 7):
        want = [brute_pass_at_k(list(row), k) for row in r_ps]
        np.testing.assert_allclose(prompt_values(r_ps, "pass_at_k", k), want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(prompt_values(r_ps, "mean"), r_ps.mean(axis=1), rtol=0, atol=0)
    np.testing.assert_allclose(prompt_values(r_ps, "pass_at_k", 1), r_ps.mean(axis=1), atol=1e-12)


@pytest.mark.parametrize("g", [2, 3, 5, 6])
def test_pass_at_k_advantages_equal_enumeration_over_subsets(g):
    rng = np.random.default_rng(g)
    rewards = np.concatenate(
        [rng.integers(0, 2, size=(6, g)).astype(float), rng.uniform(size=(3, g)), np.round(rng.uniform(size=(2, g)), 1)]
    )  # binary, dense, and dense with ties
    for k in range(1, g + 1):
        got = pass_at_k_advantages(rewards, k)
        want = [[brute_contribution(list(row), i, k) for i in range(g)] for row in rewards]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_k_equal_to_the_group_is_verls_grpo_passk():
    """k = G: r_max - r_second for the best completion, 0 for the rest (ties at the top: 0 for all)."""
    r = np.array([[0.2, 0.9, 0.5, 0.1], [1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    np.testing.assert_allclose(pass_at_k_advantages(r, 4), [[0, 0.4, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1.0]], atol=1e-12)
    # scaled as group_advantages scales: divided by the group's std + eps
    got = objective_advantages(torch.tensor(r), "pass_at_k", 4, "group", 1e-6)
    want = pass_at_k_advantages(r, 4) / (r.std(axis=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12)
    assert torch.equal(objective_advantages(torch.tensor(r), "mean", 4, "group"), group_advantages(torch.tensor(r)))


def test_per_prompt_baseline_against_numpy():
    rng = np.random.default_rng(1)
    values_np = rng.uniform(size=(5, 4))
    values_np[:, 2] = 0.7  # a prompt every member scores alike carries no signal
    np.testing.assert_allclose(member_fitness(values_np, "none"), values_np.mean(axis=1), rtol=0, atol=0)
    want = np.zeros_like(values_np)
    for p in range(4):
        col = values_np[:, p]
        if col.std() > 1e-8:
            want[:, p] = (col - col.mean()) / col.std()
    np.testing.assert_allclose(member_fitness(values_np, "per_prompt"), want.mean(axis=1), rtol=0, atol=1e-12)


def test_per_prompt_baseline_changes_the_shaped_fitness():
    """A prompt where members differ widely no longer drowns one where they differ little (centring alone would not
    change any shift-invariant shaping)."""
    from es_ray.strategy import zscore

    values_np = np.array([[0.0, 0.52], [1.0, 0.50], [0.5, 0.54], [0.5, 0.48]])
    plain, based = zscore(member_fitness(values_np, "none")), zscore(member_fitness(values_np, "per_prompt"))
    assert np.argsort(plain).tolist() != np.argsort(based).tolist()
    centred = values_np - values_np.mean(axis=0)
    np.testing.assert_allclose(zscore(centred.mean(axis=1)), plain, atol=1e-12)


def test_pass_at_k_with_fewer_samples_than_k_is_refused():
    with pytest.raises(ConfigError, match=r"es.samples_per_prompt=2; raise es.samples_per_prompt to >= 4"):
        check_objective("pass_at_k", 4, 2, "es.samples_per_prompt")
    with pytest.raises(ConfigError, match="task.objective='best'"):
        check_objective("best", 1, 1, "grpo.group_size")
    check_objective("pass_at_k", 4, 4, "grpo.group_size")
    check_objective("mean", 4, 1, "es.samples_per_prompt")  # k is read only by pass_at_k


def test_es_and_grpo_configs_refuse_too_few_samples_for_k():
    from es_ray.es.config import to_train_config
    from es_ray.grpo.config import to_grpo_config

    with pytest.raises(ConfigError, match="es.samples_per_prompt=1"):
        to_train_config({"task": {"objective": "pass_at_k", "objective_k": 2}})
    with pytest.raises(ConfigError, match="grpo.group_size=8"):
        to_grpo_config({"task": {"objective": "pass_at_k", "objective_k": 16}})
    assert (
        to_train_config(
            {"task": {"objective": "pass_at_k", "objective_k": 2}, "es": {"samples_per_prompt": 2}}
        ).es.samples_per_prompt
        == 2
    )


def test_pass_at_k_weights_sum_to_one():
    from es_ray.metrics.coverage import pass_at_k_weights

    for s in range(1, 9):
        for k in range(1, s + 1):
            w = pass_at_k_weights(s, k)
            assert w.sum() == pytest.approx(1.0, abs=1e-12) and w[-1] == pytest.approx(k / s)
            assert math.isclose(w[: k - 1].sum(), 0.0)
