"""Low-rank ES perturbations (es.perturbation=lowrank), pure torch: which tensors, the factors, the merged delta and
the update's gradient. No engine, no Ray.

Member i's perturbation of a 2-D weight W (out x in) is sigma * E_i with E_i = B_i A_i^T / sqrt(r): B_i (out x r)
and A_i (in x r) standard normal, so every element of E_i has variance 1, as full-rank noise does, and sigma keeps
its meaning. Both factors come from the tensor's own seed, the same per-(run, iteration, member, tensor) seed as
full-rank noise (``NoiseSource``): one draw of shape (out + in, r), B its first ``out`` rows, A the rest. Any noise
kind and scope works unchanged (table, counter, reference scope).

Which tensors: the 2-D weights of linear layers (attention and MLP projections), ``is_target``. Left out, neither
perturbed nor updated, in both modes of a low-rank run:
* 1-D tensors (norm weights, biases): a per-member vector cannot be added inside a shared batched matmul the way a
  low-rank term can (each would need its own elementwise pass per member), vLLM's LoRA has no slot for them, and
  they are well under 0.1% of the parameters of the paper's models;
* embeddings and the LM head (often one tied tensor): vLLM's LoRA does not cover them in the pinned releases, and
  a perturbed vocabulary projection would cost a (batch x vocab) term per member, the largest of the model.
So lowrank trains the projections (79% of SmolLM2-135M's parameters, 86% of Qwen2.5-7B's) and full trains
everything ``model.trainable`` selects.

The update g = 1/(N sigma) sum_i z_i E_i is one matmul per tensor: the factors of all members side by side,
(B_1 c_1 | ... | B_N c_N) (A_1 | ... | A_N)^T with c_i = z_i sign_i / (N sigma sqrt(r)), applied to the fp32
master by the same optimizers as full rank.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from es_ray.core.config import ConfigError

_NOT_TARGETS = re.compile(r"(^|\.)(embed_tokens|embed_in|wte|wpe|lm_head|embed_out|embeddings?)(\.|$)")


def is_target(name: str, shape: Iterable[int]) -> bool:
    """Whether es.perturbation=lowrank perturbs the HF tensor ``name``: a 2-D weight that is not an embedding or
    the LM head."""
    return len(tuple(shape)) == 2 and name.endswith(".weight") and not _NOT_TARGETS.search(name)


def check_rank(rank: int, shapes: Mapping[str, Iterable[int]], key: str = "es.rank") -> None:
    """ConfigError unless 1 <= rank <= min(out, in) of every target tensor (a larger rank is no longer low-rank,
    and B A^T could not reach full rank anyway)."""
    if rank < 1:
        raise ConfigError(f"{key}={rank}: the rank of a low-rank perturbation must be >= 1 (e.g. {key}=8)")
    targets = {n: tuple(s) for n, s in shapes.items() if is_target(n, s)}
    if not targets:
        raise ConfigError(
            "es.perturbation=lowrank perturbs linear-layer weights, and model.trainable selects none; "
            "widen model.trainable or use es.perturbation=full"
        )
    name, shape = min(targets.items(), key=lambda kv: min(kv[1]))
    if rank > min(shape):
        raise ConfigError(
            f"{key}={rank} exceeds min(out, in)={min(shape)} of {name} {shape}: set {key} <= {min(shape)}"
        )


@dataclass(frozen=True)
class LowRankSlots:
    """What an engine reserves for population batching: up to ``members`` members at once, each of rank ``rank``
    (vLLM: LoRA slots)."""

    members: int
    rank: int


def factor_shape(shape: Iterable[int], rank: int) -> tuple[int, int]:
    """The shape of the one noise draw that holds both factors of a tensor of ``shape``: (out + in, rank)."""
    out, inp = tuple(shape)
    return out + inp, int(rank)


def split_factors(drawn: torch.Tensor, shape: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, A) from one draw of ``factor_shape``: B (out x r) its first ``out`` rows, A (in x r) the rest (views)."""
    out, _ = tuple(shape)
    return drawn[:out], drawn[out:]


def merged(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """E = B A^T / sqrt(r), the explicit (out x in) perturbation direction (unit variance per element)."""
    return (b @ a.T) / math.sqrt(b.shape[1])


def gradient(
    factors: list[tuple[torch.Tensor, torch.Tensor]], coeffs: list[float], out: torch.Tensor | None = None
) -> torch.Tensor:
    """sum_k coeffs[k] * B_k A_k^T / sqrt(r) as one matmul of the factors side by side, in fp32, written into
    ``out`` (out x in) when given. The summation order is fixed by the member order, and replicas on one device
    model with the same thread count get the same bits (tests/es/test_lowrank.py checks thread counts 1 and 2)."""
    rank = factors[0][0].shape[1]
    scale = 1.0 / math.sqrt(rank)
    bs = torch.cat([b * (c * scale) for (b, _), c in zip(factors, coeffs)], dim=1)
    as_ = torch.cat([a for _, a in factors], dim=1)
    if out is None:
        return bs @ as_.T
    return torch.matmul(bs, as_.T, out=out)


def lowrank_output(x: torch.Tensor, a: torch.Tensor, b_scaled: torch.Tensor) -> torch.Tensor:
    """The low-rank term of a linear layer's output for input rows ``x`` (..., in): (x A) B_s^T with B_s already
    holding sign * sigma / sqrt(r). x W_i^T = x W^T + this, for W_i = W + sign * sigma * E_i."""
    return (x @ a) @ b_scaled.T
