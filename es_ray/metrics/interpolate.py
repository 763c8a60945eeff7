"""The path between two solutions, pure (torch and numpy; no Ray, no vLLM): the interpolated weights, the loss
barrier along the path with its bootstrap interval over problems, and the cosine between the two updates.

    theta(t) = (1 - t) theta_a + t theta_b                              t on a stated grid holding 0 and 1
    line(t)  = (1 - t) m(0) + t m(1)                                      the straight line between the end scores
    barrier  = max_t [line(t) - m(t)]                                     the largest drop below it (>= 0: the end
                                                                          points are on the line)
    cos      = <theta_a - theta_0, theta_b - theta_0> / (|.| |.|)         overall and per module type
                                                                          (``es_ray.metrics.drift.module_type``)

m(t) is a mean over problems (mean reward, or pass@k); the interval resamples the problems, the same draw at every
t, so it is the interval of the barrier itself, not of its parts (docs/evaluation.md, "The path between solutions").
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np
import torch

from es_ray.metrics.drift import MODULE_TYPES, module_type


def mix(a: torch.Tensor, b: torch.Tensor, t: float) -> torch.Tensor:
    """(1 - t) a + t b in fp32, written into a's fp32 copy (one more tensor, never a second model); t = 0 and t = 1
    give a and b exactly."""
    if t == 0.0:
        return a.float()
    if t == 1.0:
        return b.float()
    return a.float().mul(1.0 - t).add_(b.float(), alpha=t)


def barrier(scores_t: Sequence[float], grid: Sequence[float]) -> tuple[float, float | None]:
    """(barrier, the interior t where the drop is largest) of the mean scores m(t) along ``grid`` (which holds 0 and
    1). The end points lie on the line by construction, so only interior points can drop below it: a path that never
    drops (every interior point on or above the line) has barrier 0 and no such t (None), never "at t=0"."""
    m, g = np.asarray(scores_t, dtype=np.float64), np.asarray(grid, dtype=np.float64)
    m0, m1 = m[g == 0.0][0], m[g == 1.0][0]
    gap = (1.0 - g) * m0 + g * m1 - m
    inner = np.flatnonzero((g > 0.0) & (g < 1.0))
    if not inner.size or gap[inner].max() <= 0.0:
        return 0.0, None
    j = int(inner[np.argmax(gap[inner])])
    return float(gap[j]), float(g[j])


def barrier_interval(
    values_tp: np.ndarray, grid: Sequence[float], draws: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the barrier: [T, P] per-problem scores along the grid, the P problems
    resampled with replacement (one draw shared by every t)."""
    v = np.asarray(values_tp, dtype=np.float64)
    g = np.asarray(grid, dtype=np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, v.shape[1], size=(draws, v.shape[1]))
    m = v[:, idx].mean(axis=2)  # [T, draws]
    line = (1.0 - g)[:, None] * m[g == 0.0] + g[:, None] * m[g == 1.0]
    b = (line - m).max(axis=0)
    alpha = (1.0 - level) / 2.0
    return float(np.quantile(b, alpha)), float(np.quantile(b, 1.0 - alpha))


class UpdateCosine:
    """Cosine between theta_a - theta_0 and theta_b - theta_0, fed one tensor at a time (fp64 sums)."""

    def __init__(self):
        self.dot = dict.fromkeys(MODULE_TYPES, 0.0)
        self.sq_a = dict.fromkeys(MODULE_TYPES, 0.0)
        self.sq_b = dict.fromkeys(MODULE_TYPES, 0.0)

    def add(self, name: str, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        da, db = a.double() - base.double(), b.double() - base.double()
        kind = module_type(name)
        self.dot[kind] += float((da * db).sum())
        self.sq_a[kind] += float((da * da).sum())
        self.sq_b[kind] += float((db * db).sum())

    @staticmethod
    def _cos(dot: float, sq_a: float, sq_b: float) -> float | None:
        """None where an update is zero (an end point is the base itself): no angle to report."""
        return dot / math.sqrt(sq_a * sq_b) if sq_a > 0 and sq_b > 0 else None

    def result(self) -> dict:
        total = self._cos(sum(self.dot.values()), sum(self.sq_a.values()), sum(self.sq_b.values()))
        by_type = {
            k: self._cos(self.dot[k], self.sq_a[k], self.sq_b[k]) for k in MODULE_TYPES if self.sq_a[k] or self.sq_b[k]
        }
        return {
            "cosine": total,
            "by_module_type": by_type,
            "norm_a": math.sqrt(sum(self.sq_a.values())),
            "norm_b": math.sqrt(sum(self.sq_b.values())),
        }


def update_cosine(triples: Iterable[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict:
    """(name, theta_0, theta_a, theta_b) per tensor -> ``UpdateCosine.result``."""
    acc = UpdateCosine()
    for name, base, a, b in triples:
        acc.add(name, base, a, b)
    return acc.result()
