"""Training objectives over several samples per prompt, pure numpy: what a prompt is worth to a member (mean reward
or pass@k), a member's fitness over its prompts (with an optional per-prompt baseline), and GRPO's pass@k
advantages. Shapes: N members x P prompts x S samples per prompt (``rewards_nps``); G completions per group.

pass@k of rewards in [0, 1] is the expected best reward of k samples drawn without replacement from the S:

    pass@k = (1 / C(S, k)) * sum over k-subsets T of max_{j in T} r_j
           = sum_j C(j - 1, k - 1) / C(S, k) * r_(j)        (r_(1) <= ... <= r_(S) sorted ascending)

which for 0/1 rewards with c correct is Chen et al.'s unbiased 1 - C(S - c, k) / C(S, k)
(``es_ray.metrics.passk.pass_at_k``), and stays defined for a dense reward (the expected best of k).

A completion's pass@k advantage is its contribution to the group's pass@k (docs/grpo.md, "The pass@k objective"):
the mean over the k-subsets T that hold i of what i adds to T's best,

    A_i = (1 / C(G - 1, k - 1)) * sum over (k-1)-subsets U of the others of max(0, r_i - max_{j in U} r_j),

so only a completion that beats the rest of some subset is pushed up. With k = G there is one subset: A_i =
r_max - r_second for the best completion and 0 for the others, verl's GRPO_PASSK estimator (arXiv 2503.19595).
"""

from __future__ import annotations

import math

import numpy as np

from es_ray.core.config import ConfigError
from es_ray.core.registry import Registry

OBJECTIVES = Registry(
    "task.objective",
    {
        "mean": "the mean reward over a prompt's samples (the paper's objective)",
        "pass_at_k": "the unbiased pass@k over a prompt's samples (task.objective_k; needs that many samples)",
    },
)


def check_objective(objective: str, k: int, samples: int, samples_key: str) -> None:
    """Refuse a pass@k objective that ``samples`` samples per prompt cannot estimate (``samples_key`` names the
    config key that sets them: es.samples_per_prompt or grpo.group_size)."""
    OBJECTIVES.check(objective)
    if k < 1:
        raise ConfigError(f"task.objective_k={k} must be >= 1")
    if objective == "pass_at_k" and samples < k:
        raise ConfigError(
            f"task.objective=pass_at_k with task.objective_k={k} needs at least {k} samples per "
            f"prompt, but {samples_key}={samples}; raise {samples_key} to >= {k} or lower "
            "task.objective_k"
        )


def pass_at_k_weights(s: int, k: int) -> np.ndarray:
    """[S] weights w_j = C(j - 1, k - 1) / C(S, k) of the sorted rewards (j = 1..S): pass@k = sum_j w_j r_(j)."""
    if not 1 <= k <= s:
        raise ValueError(f"pass@{k} needs 1 <= k <= S samples, got S={s}")
    total = math.comb(s, k)
    return np.array([math.comb(j - 1, k - 1) / total for j in range(1, s + 1)], dtype=np.float64)


def prompt_values(rewards_ps: np.ndarray, objective: str, k: int = 1) -> np.ndarray:
    """[P, S] rewards of one member -> [P] values of its prompts under the objective."""
    r = np.asarray(rewards_ps, dtype=np.float64)
    if objective == "mean":
        return r.mean(axis=-1)
    OBJECTIVES.check(objective)
    return np.sort(r, axis=-1) @ pass_at_k_weights(r.shape[-1], k)


def no_baseline(values_np: np.ndarray) -> np.ndarray:
    return values_np


def per_prompt_baseline(values_np: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """Each prompt's values less their mean over the members, over their std (0 where all members agree).

    Subtracting the mean alone would move every member's fitness by the same constant, which zscore and
    centered_rank shaping both ignore; dividing by the prompt's spread is what lets an easy or a hard prompt (where
    the members differ little) weigh as much as one where they differ a lot."""
    v = np.asarray(values_np, dtype=np.float64)
    centred = v - v.mean(axis=0, keepdims=True)
    std = v.std(axis=0, keepdims=True)
    return np.where(std > eps, centred / np.where(std > eps, std, 1.0), 0.0)


FITNESS_BASELINES = Registry("es.fitness_baseline", {"none": no_baseline, "per_prompt": per_prompt_baseline})
"""What is taken out of each prompt's values before a member's fitness is their mean over prompts:
fn(values_np) -> values_np."""


def member_fitness(values_np: np.ndarray, baseline: str = "none") -> np.ndarray:
    """[N, P] prompt values -> [N] raw fitness (before shaping): the mean over prompts after the baseline."""
    return FITNESS_BASELINES.get(baseline)(np.asarray(values_np, dtype=np.float64)).mean(axis=1)


def pass_at_k_advantages(rewards_pg: np.ndarray, k: int) -> np.ndarray:
    """[P, G] rewards -> [P, G] pass@k advantages A_i (the module docstring), exact, O(G^2) per group."""
    r = np.asarray(rewards_pg, dtype=np.float64)
    p, g = r.shape
    if not 1 <= k <= g:
        raise ValueError(f"pass@{k} advantages need 1 <= k <= G={g}")
    # a (k-1)-subset U of the G-1 others whose largest member is the j-th smallest (j = 1..G-1): C(j-1, k-2) of them
    if k == 1:  # U is empty: A_i = r_i (the best of nothing is 0)
        return np.maximum(r, 0.0)
    denom = math.comb(g - 1, k - 1)
    weights = np.array([math.comb(j - 1, k - 2) / denom for j in range(1, g)], dtype=np.float64)
    out = np.empty_like(r)
    for i in range(g):
        others = np.sort(np.delete(r, i, axis=1), axis=1)  # [P, G-1] ascending
        out[:, i] = np.maximum(r[:, i : i + 1] - others, 0.0) @ weights
    return out
