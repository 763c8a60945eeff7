"""ES strategy, pure: ask/tell, fitness shaping, the gradient estimate and the optimizers (torch/numpy only).

The update convention (also in docs/es-update.md):

    z      = shape(rewards)                               (shape_fitness: zscore or centered_rank)
    g      = 1 / (N * sigma) * sum_i z_i * eps_i          (gradient_weights, gradient; one-point)
    theta <- theta + lr * g                              (Optimizer.step with sgd; or theta + lr * adam(g))
    theta <- theta - lr * weight_decay * theta            (decoupled weight decay, optional)
    theta <- theta - lr * anchor_decay * (theta - theta0) (anchored decay toward the initial weights, optional)

The replica (es_ray/replica.py) draws eps_i one tensor at a time and calls these; the driver reads ask ->
evaluate -> tell (es_ray/es/driver.py ``iteration``).

With antithetic pairs member 2k uses +eps_k and member 2k+1 uses -eps_k; the same formula then reduces to
1/(N sigma) * sum_k (z_2k - z_2k+1) eps_k. The reference ES code folds 1/sigma into its step size,
``theta += alpha / N * sum_i z_i eps_i``; the two agree when ``lr = alpha * sigma`` (alpha = lr / sigma), so
the reference's sigma 1e-3, alpha 5e-4 is ``es.sigma=1e-3 es.lr=5e-7`` here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from es_ray.core.registry import Registry

if TYPE_CHECKING:  # the optimizers' torch is imported where they run (the actors): the driver needs only numpy
    import torch


@dataclass(frozen=True)
class Member:
    """One population member: its index in the iteration, the noise it uses and the sign of that noise."""

    index: int
    noise_id: int
    sign: int


def ask(population: int, estimator: str = "one_point") -> list[Member]:
    """The members of one iteration. The noise seed is (run seed, iteration, noise_id, tensor name)."""
    if estimator == "one_point":
        return [Member(i, i, 1) for i in range(population)]
    if estimator == "antithetic":
        if population % 2:
            raise ValueError("antithetic sampling needs an even population")
        return [Member(i, i // 2, 1 if i % 2 == 0 else -1) for i in range(population)]
    raise ValueError(f"unknown estimator {estimator!r}")


def zscore(rewards_n: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """(r - mean) / std over the population; all-equal rewards give zeros (a zero update)."""
    r = np.asarray(rewards_n, dtype=np.float64)
    std = r.std()
    if std < eps:
        return np.zeros_like(r)
    return (r - r.mean()) / std


def centered_rank(rewards_n: np.ndarray) -> np.ndarray:
    """Ranks mapped linearly to [-0.5, 0.5]; ties share their mean rank, so all-equal rewards give zeros."""
    r = np.asarray(rewards_n, dtype=np.float64)
    n = r.size
    if n < 2:
        return np.zeros_like(r)
    order = np.argsort(r, kind="stable")
    ranks = np.empty(n, dtype=np.float64)
    ranks[order] = np.arange(n, dtype=np.float64)
    for value in np.unique(r):  # average ranks of ties
        tie = r == value
        if tie.sum() > 1:
            ranks[tie] = ranks[tie].mean()
    return ranks / (n - 1) - 0.5


SHAPERS = Registry("es.shaping", {"zscore": zscore, "centered_rank": centered_rank})
"""Fitness shaping functions rewards_n -> fitness_n, by es.shaping name."""


def shape_fitness(rewards_n, shaping: str = "zscore") -> np.ndarray:
    return SHAPERS.get(shaping)(np.asarray(rewards_n, dtype=np.float64))


def noise_coefficients(members: list[Member], fitness_n) -> list[tuple[int, float]]:
    """Merge members sharing a noise (antithetic pairs): [(noise_id, sum of sign * z)], in noise_id order."""
    coeff: dict[int, float] = {}
    for m in members:
        coeff[m.noise_id] = coeff.get(m.noise_id, 0.0) + m.sign * float(fitness_n[m.index])
    return sorted(coeff.items())


def gradient_weights(members: list[Member], fitness_n, sigma: float) -> list[tuple[int, float]]:
    """The gradient as weights on the iteration's noises: [(noise_id k, w_k)] in noise_id order, so that
    g = sum_k w_k * eps_k with w_k = (sum over the members i using noise k of sign_i * z_i) / (N * sigma)."""
    scale = 1.0 / (len(members) * sigma)
    return [(noise_id, c * scale) for noise_id, c in noise_coefficients(members, fitness_n)]


def gradient(noises: Iterable[torch.Tensor], weights: Sequence[float], out: torch.Tensor) -> torch.Tensor:
    """g = sum_k weights[k] * noises[k] into ``out`` (the tensor's shape, fp32), added in k order: that fixed order
    keeps replicas equal bit for bit. ``noises`` is taken one at a time, so each may reuse one buffer; the first
    term initialises ``out`` (one pass less than zero_() then add_()). Factored noise (es.perturbation=lowrank)
    computes the same sum as one matmul of its factors: ``es_ray.lowrank.gradient``."""
    import torch

    for k, (eps, w) in enumerate(zip(noises, weights)):
        if k == 0:
            torch.mul(eps, w, out=out)
        else:
            out.add_(eps, alpha=w)
    return out


class Optimizer:
    """In-place fp32 update of one tensor from its ascent direction g (sgd or adam, plus decays).

    ``step`` turns ``g`` into the applied delta in place (so the caller can measure it) and adds it to theta.
    """

    def __init__(
        self,
        kind: str,
        lr: float,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        anchor_decay: float = 0.0,
    ):
        self._direction = OPTIMIZERS.get(kind)
        self.kind, self.lr, self.betas, self.eps = kind, lr, betas, eps
        self.weight_decay, self.anchor_decay = weight_decay, anchor_decay
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.t = 0

    def begin(self) -> None:
        """Call once per iteration before the per-tensor steps (advances Adam's bias correction)."""
        self.t += 1

    def step(self, name: str, theta: torch.Tensor, g: torch.Tensor, theta0: torch.Tensor | None = None) -> None:
        """theta <- theta + d - lr * weight_decay * theta - lr * anchor_decay * (theta - theta0), d = lr * g (sgd) or
        Adam's step; g (theta's shape, fp32) is left holding the whole applied delta."""
        self._direction(self, name, theta, g)
        if self.weight_decay:
            g.add_(theta, alpha=-self.lr * self.weight_decay)
        if self.anchor_decay and theta0 is not None:
            g.add_(theta - theta0, alpha=-self.lr * self.anchor_decay)
        theta.add_(g)

    def state_dict(self) -> dict:
        return {"t": self.t, "state": self.state}

    def load_state_dict(self, sd: dict, device: str | torch.device | None = None) -> None:
        """State from ``state_dict`` (a checkpoint is read onto the CPU): every tensor lands on ``device`` in fp32."""
        import torch

        self.t = int(sd["t"])
        self.state = {}  # the old moments go before the new ones are made: a replica reloaded in place holds one set
        self.state = {
            name: {k: v.detach().to(device=device, dtype=torch.float32, copy=True) for k, v in st.items()}
            for name, st in sd["state"].items()
        }


def sgd(opt: Optimizer, name: str, theta: torch.Tensor, g: torch.Tensor) -> None:
    """step = lr * g"""
    g.mul_(opt.lr)


def adam(opt: Optimizer, name: str, theta: torch.Tensor, g: torch.Tensor) -> None:
    """step = lr * m_hat / (sqrt(v_hat) + eps), Adam's moments of g kept per tensor in fp32."""
    import torch

    b1, b2 = opt.betas
    st = opt.state.get(name)
    if st is None:
        st = opt.state[name] = {"m": torch.zeros_like(theta), "v": torch.zeros_like(theta)}
    st["m"].mul_(b1).add_(g, alpha=1 - b1)
    st["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
    bc1, bc2 = 1 - b1**opt.t, 1 - b2**opt.t
    denom = st["v"].sqrt().div_(math.sqrt(bc2)).add_(opt.eps)
    torch.div(st["m"], denom, out=g).mul_(opt.lr / bc1)


OPTIMIZERS = Registry("es.optimizer", {"sgd": sgd, "adam": adam})
"""Per-tensor directions: fn(optimizer, name, theta, g) turns the ascent direction g into the step, in place."""
