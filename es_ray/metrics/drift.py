"""Weight drift between two checkpoints, per module type (torch and numpy; no Ray, no vLLM).

For delta = tuned - base (fp32, element-wise):

* l2 = ||delta||_2, relative_l2 = ||delta||_2 / ||base||_2;
* nonzero = how many elements changed at all (delta != 0);
* share_below[t] = (elements with 0 < |delta| < t) / nonzero, for each threshold t (default 1.0e-3, 1.5e-3,
  2.0e-3): the paper's "functional sparsity", the share of the updates that are tiny;
* the largest |delta| per module type (tensor name, flat index, value);
* an optional histogram of log10 |delta| over the non-zero updates (fixed edges, so it can be plotted).

Everything is reported for the whole model and for each module type (embedding, attention, mlp, norm, lm_head,
other), on the fp32 weights and, optionally, on the weights cast to an engine dtype (bf16: what a GPU engine
holds). Tensors are consumed one pair at a time, so a 7B model never needs two copies in memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

MODULE_TYPES = ("embedding", "attention", "mlp", "norm", "lm_head", "other")
DEFAULT_THRESHOLDS = (1.0e-3, 1.5e-3, 2.0e-3)
LOG10_EDGES = np.linspace(-10.0, 0.0, 101)
"""Histogram bins for log10 |delta| (0.1 decade wide); smaller updates go into the first bin, larger into the last."""

_ATTENTION = ("self_attn", "attention", "attn", "q_proj", "k_proj", "v_proj", "o_proj", "qkv")
_MLP = ("mlp", "gate_proj", "up_proj", "down_proj", "fc1", "fc2", "ffn", "feed_forward", "w1", "w2", "w3")


def module_type(name: str) -> str:
    """HF parameter name -> module type. Norms first: "post_attention_layernorm" is a norm, not attention."""
    n = name.lower()
    if "lm_head" in n:
        return "lm_head"
    if "norm" in n or ".ln_" in n or n.startswith("ln_"):
        return "norm"
    if "embed" in n or ".wte." in n or ".wpe." in n:
        return "embedding"
    if any(s in n for s in _ATTENTION):
        return "attention"
    if any(s in n for s in _MLP):
        return "mlp"
    return "other"


@dataclass
class _Acc:
    thresholds: tuple[float, ...]
    edges: np.ndarray | None
    top: int
    numel: int = 0
    nonzero: int = 0
    sq_delta: float = 0.0
    sq_base: float = 0.0
    below: list[int] = field(default_factory=list)
    hist: np.ndarray | None = None
    largest: list[tuple[float, str, int, float]] = field(default_factory=list)
    tensors: int = 0

    def __post_init__(self):
        self.below = [0] * len(self.thresholds)
        if self.edges is not None:
            self.hist = np.zeros(len(self.edges) - 1, dtype=np.int64)

    def add(self, name: str, base: torch.Tensor, delta: torch.Tensor) -> None:
        a = delta.abs()
        nz = a > 0
        self.tensors += 1
        self.numel += delta.numel()
        self.nonzero += int(nz.sum())
        self.sq_delta += float((delta.double() ** 2).sum())
        self.sq_base += float((base.double() ** 2).sum())
        for j, t in enumerate(self.thresholds):
            self.below[j] += int((nz & (a < t)).sum())
        if self.hist is not None:
            logs = torch.log10(a[nz]).numpy()
            self.hist += np.histogram(np.clip(logs, self.edges[0], self.edges[-1]), bins=self.edges)[0]
        if self.top and delta.numel():
            k = min(self.top, delta.numel())
            vals, idx = torch.topk(a.reshape(-1), k)
            flat = delta.reshape(-1)
            self.largest += [(float(v), name, int(i), float(flat[i])) for v, i in zip(vals, idx)]
            self.largest = sorted(self.largest, key=lambda x: -x[0])[: self.top]

    def merge(self, other: "_Acc") -> None:
        self.tensors += other.tensors
        self.numel += other.numel
        self.nonzero += other.nonzero
        self.sq_delta += other.sq_delta
        self.sq_base += other.sq_base
        self.below = [a + b for a, b in zip(self.below, other.below)]
        if self.hist is not None:
            self.hist += other.hist
        self.largest = sorted(self.largest + other.largest, key=lambda x: -x[0])[: self.top]

    def report(self) -> dict:
        l2 = math.sqrt(self.sq_delta)
        base = math.sqrt(self.sq_base)
        out = {
            "tensors": self.tensors,
            "numel": self.numel,
            "nonzero": self.nonzero,
            "l2": l2,
            "relative_l2": l2 / base if base > 0 else None,
            "base_l2": base,
            "share_nonzero": self.nonzero / self.numel if self.numel else None,
            "share_below": {
                f"{t:g}": (b / self.nonzero if self.nonzero else None) for t, b in zip(self.thresholds, self.below)
            },
            "max_abs": self.largest[0][0] if self.largest else 0.0,
            "largest": [{"name": n, "index": i, "delta": d} for _, n, i, d in self.largest],
        }
        if self.hist is not None:
            out["histogram_log10"] = [int(c) for c in self.hist]
        return out


def drift(
    pairs: Iterable[tuple[str, torch.Tensor, torch.Tensor]],
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    top: int = 5,
    edges: np.ndarray | None = LOG10_EDGES,
    cast: torch.dtype | None = None,
) -> dict:
    """Drift from (name, base tensor, tuned tensor) triples; see the module docstring for every field.

    Returns {"total": {...}, "by_module_type": {type: {...}}, "thresholds": [...], "histogram_edges": [...],
    "shape_mismatch": [names]}; a type with no tensors is left out of by_module_type. With ``cast`` (e.g.
    torch.bfloat16, what a GPU engine holds) the same figures for cast(tuned) - cast(base) come under "cast" in the
    same pass: an update smaller than half a ulp of the weight (|w| / 256 in bf16) vanishes there, which is what the
    engine that generates actually sees.
    """
    thresholds = tuple(float(t) for t in thresholds)
    views = {"fp32": None} if cast is None else {"fp32": None, "cast": cast}
    per_type: dict[str, dict[str, _Acc]] = {v: {} for v in views}
    mismatch = []
    for name, base, tuned in pairs:
        if base.shape != tuned.shape:
            mismatch.append(name)
            continue
        kind = module_type(name)
        for view, dtype in views.items():
            b = base.detach().to("cpu", dtype or torch.float32).float()
            d = tuned.detach().to("cpu", dtype or torch.float32).float() - b
            per_type[view].setdefault(kind, _Acc(thresholds, edges, top)).add(name, b, d)
    out = {}
    for view in views:
        total = _Acc(thresholds, edges, top)
        for acc in per_type[view].values():
            total.merge(acc)
        out[view] = {
            "total": total.report(),
            "by_module_type": {k: per_type[view][k].report() for k in MODULE_TYPES if k in per_type[view]},
        }
    report = {
        **out["fp32"],
        "thresholds": list(thresholds),
        "histogram_edges": None if edges is None else [float(x) for x in edges],
        "shape_mismatch": mismatch,
    }
    if cast is not None:
        report["cast"] = {"dtype": str(cast).removeprefix("torch."), **out["cast"]}
    return report


def drift_state_dicts(base: Mapping[str, torch.Tensor], tuned: Mapping[str, torch.Tensor], **kwargs) -> dict:
    """drift() over the names both state dicts share; names in only one are listed under "missing"."""
    common = [n for n in base if n in tuned]
    out = drift(((n, base[n], tuned[n]) for n in common), **kwargs)
    out["missing"] = {"base_only": sorted(set(base) - set(tuned)), "tuned_only": sorted(set(tuned) - set(base))}
    return out
