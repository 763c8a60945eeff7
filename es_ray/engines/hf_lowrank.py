"""Population batching for the transformers engine (es.perturbation=lowrank): one generate call serves several
members, each sequence row seeing its own member's weights through a low-rank term added to each perturbed linear
layer's output, never written into the weights (``es_ray.lowrank``).

Rows are member-major: a call for members [m0, m1) over p prompts holds member m0's p rows, then m0 + 1's, and so
on, so for a layer input x (rows, seq, in) the term of all members is two batched matmuls over the members,
x viewed as (members, p * seq, in): (x A[m0:m1]) B_s[m0:m1]^T, written as the layer's output, into which the base
GEMM x W^T then accumulates (no per-row loop, no pass over the output of its own for the term, one
(members, p * seq, r) temporary per layer and step).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

Factors = Mapping[str, tuple[torch.Tensor, torch.Tensor]]
"""HF weight name -> (A (M, in, r), B_s (M, out, r)), ``Replica.member_factors``."""

SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("query", "key", "value"))
"""Sibling layers that read the same input tensor: their first products x A run as one (``LowRankTerms``)."""


def population_calls(num_prompts: int, num_members: int, batch_size: int) -> list[tuple[slice, range]]:
    """The generate calls of a population, in order: (prompt slice, members), each call holding the slice's prompts
    for each of its members, at most ``batch_size`` rows (at least one member). The prompts are cut exactly as
    ``Engine.generate`` cuts them (chunks of ``batch_size``), so a member's rows are padded as they are when it is
    generated alone; as many whole members as fit share a call."""
    calls = []
    for start in range(0, num_prompts, batch_size):
        chunk = slice(start, min(num_prompts, start + batch_size))
        per_call = max(1, batch_size // (chunk.stop - chunk.start))
        calls += [(chunk, range(m, min(num_members, m + per_call))) for m in range(0, num_members, per_call)]
    return calls


def base_gemm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """out += x W^T in one GEMM accumulating into out (x and out contiguous, any leading dims); returns out."""
    out.view(-1, out.shape[-1]).addmm_(x.reshape(-1, x.shape[-1]), weight.t())
    return out


class LowRankTerms:
    """Context manager: each ``nn.Linear`` whose weight ``factors`` names gets, for the duration, a forward of its
    own (an instance attribute in place of the class's; no forward hook) computing member m's (x A[m]) B_s[m]^T (+ b)
    for its rows into a new output and then x W^T into that output (``base_gemm``, one GEMM with beta = 1, so the
    term costs no read and write of the output of its own); the class forward is back on exit, error or not.
    ``select(members)`` sets the members of the next forward passes (rows member-major, the same number per member).

    The factors are cast to the layer's dtype and device and laid out once, here, as the two batched products read
    them: A as (M, r, in), read transposed, and B_s^T as (M, r, out), both contiguous. The first product then runs as
    a "transposed B" GEMM, which on CPU is 2.4x faster than reading a contiguous (in, r) A for the decode shape (16
    rows per member) and for prefill alike (``benchmarks/population.py --profile``).

    Sibling layers fed the same input (``SHARED_INPUT``: q, k, v; gate, up) share the first product: the first of
    them to run computes x A for the group, its A's side by side (M, g * r, in), and the others take their columns
    of it when they are handed the very same tensor x (``is``; anything else computes its own). One product for
    the group costs about 60% of three (one read of x)."""

    def __init__(self, model: nn.Module, factors: Factors):
        self.modules: dict[str, nn.Linear] = {}
        self.at: dict[str, torch.Tensor] = {}
        self.bt: dict[str, torch.Tensor] = {}
        for name, (a, b_s) in factors.items():
            module = model.get_submodule(name.removesuffix(".weight"))
            if not isinstance(module, nn.Linear) or not name.endswith(".weight"):
                raise TypeError(
                    f"{name} is not the weight of an nn.Linear (got {type(module).__name__}); the "
                    "low-rank term is added to linear layers only (es_ray.lowrank.is_target)"
                )
            w = module.weight
            self.modules[name] = module
            self.at[name] = a.to(w.device, w.dtype).transpose(1, 2).contiguous()  # (M, r, in)
            self.bt[name] = b_s.to(w.device, w.dtype).transpose(1, 2).contiguous()  # (M, r, out)
        # name -> (group index, first column, end column) in the group's A (M, g * r, in)
        self.group_of: dict[str, tuple[int, int, int]] = {}
        self.group_size: list[int] = []
        self.group_at: list[torch.Tensor] = []
        groups: dict[tuple[str, int], list[str]] = {}
        for name in self.modules:
            parent, _, leaf = name.removesuffix(".weight").rpartition(".")
            for i, siblings in enumerate(SHARED_INPUT):
                if leaf in siblings:
                    groups.setdefault((parent, i), []).append(name)
        for names in groups.values():
            ats = [self.at[n] for n in names]
            if len(names) < 2 or len({(t.shape[0], t.shape[2], t.dtype, t.device) for t in ats}) > 1:
                continue
            col = 0
            for n in names:
                self.group_of[n] = (len(self.group_at), col, col + self.at[n].shape[1])
                col += self.at[n].shape[1]
            self.group_at.append(torch.cat(ats, dim=1))
            self.group_size.append(len(names))
        # (group, members, x, x A of the group, siblings still to take it): the last group's first product, dropped
        # when every sibling has taken its columns, so no layer input outlives its layer
        self._shared: list | None = None
        self.members = range(0)
        self._saved: dict[str, object] = {}

    def select(self, members: range) -> None:
        self.members = members
        self._shared = None

    def term(self, name: str, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The low-rank term of layer ``name`` for input x (plus ``bias``, when given), rows member-major over
        ``self.members``, in a new tensor (k members, rows / k * seq, out): two batched matmuls over the members on a
        view of x (no copy of the activations); the layer's forward then accumulates x W^T into it."""
        m0, m1 = self.members.start, self.members.stop
        k = m1 - m0
        if k < 1 or x.shape[0] % k:
            raise RuntimeError(f"{name}: {x.shape[0]} rows are not whole members {m0}..{m1 - 1}")
        xv = x.reshape(k, -1, x.shape[-1])  # a view: the layers' inputs are contiguous
        group = self.group_of.get(name)
        if group is None:
            xa = torch.bmm(xv, self.at[name][m0:m1].transpose(1, 2))  # (k, rows/k * seq, r)
        else:
            g, lo, hi = group
            shared = self._shared
            if shared is None or shared[0] != g or shared[1] != self.members or shared[2] is not x:
                xa_group = torch.bmm(xv, self.group_at[g][m0:m1].transpose(1, 2))
                shared = self._shared = [g, self.members, x, xa_group, self.group_size[g]]
            xa = shared[3][..., lo:hi]
            shared[4] -= 1
            if shared[4] == 0:
                self._shared = None
        bt = self.bt[name][m0:m1]
        if bias is None:
            return torch.matmul(xa, bt)
        return torch.baddbmm(bias.expand(k, xa.shape[1], bias.shape[0]), xa, bt)

    def _forward(self, name: str, module: nn.Linear):
        weight, bias, term = module.weight, module.bias, self.term

        def forward(x: torch.Tensor) -> torch.Tensor:
            # the term first, then the base GEMM accumulating into it (beta = 1): no separate pass adding the term
            # into the layer's output
            out = term(name, x, bias).view(*x.shape[:-1], weight.shape[0])
            return base_gemm(out, x, weight)

        return forward

    def __enter__(self) -> LowRankTerms:
        try:
            for name, module in self.modules.items():
                self._saved[name] = module.__dict__.get("forward")
                module.forward = self._forward(name, module)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._shared = None
        for name, saved in self._saved.items():
            module = self.modules[name]
            if saved is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = saved
        self._saved.clear()
