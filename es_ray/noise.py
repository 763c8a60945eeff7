"""Seed derivation and noise tensors (pure torch; no Ray, no engine).

Noise identity: the noise of perturbation ``noise_id`` of iteration ``t`` on the HF tensor ``name`` is a
function of ``(run_seed, t, noise_id, name)`` only, fp32, in HF layout. Every tensor has its own stream, so two
tensors of equal shape never share noise, and the seeds are unique by construction (a cryptographic hash of the
tuple), never drawn at random.

Three sources give that identity:

* ``per_tensor``: a ``torch.Generator`` seeded with the tensor's seed draws ``randn(shape)``. Cheap on a GPU, but
  CUDA's generator sizes its launch grid from the card's SM count, so its numbers depend on the GPU model (an
  A100, an H100 PCIe, an H100 SXM and a MIG slice all differ), and CPU and CUDA differ from each other.
* ``table``: one large standard-normal table is drawn once per run from the run seed; a tensor's noise is the
  contiguous slice starting at ``seed % (table_size - numel + 1)`` (the OpenAI ES starter's shared table). On a
  CPU this is 5-15x cheaper than drawing, at the cost of ``table_size * 4`` bytes per actor. The table is drawn
  with the device's generator, so it is as device-dependent as per_tensor.
* ``counter``: element ``e`` of a tensor is a pure function of (tensor seed, e), the same on a CPU, every GPU
  model and every tensor-parallel degree (``counter_noise`` below says what is bit-exact and why).

Every kind can give rows [a:b) of a tensor's noise alone (``noise_slice``), as a tensor-parallel rank needs;
counter and table without drawing the rest.
"""

from __future__ import annotations

import functools
import logging
import math
import os

import numpy as np
import torch

from es_ray.core.registry import Registry

# fmt: off
from es_ray.noise_kinds import (ES_NOISE, NOISE_KINDS, NOISE_MEMORY, NOISE_SCOPES, PORTABLE_KINDS,  # noqa: F401
                                NoiseMemory, derive_seed, resolve_kind, table_seed)
# fmt: on

# mpmath is imported where the CPU tables are built, the only place that needs it.


# -- counter noise ------------------------------------------------------------------------------------------
# Philox-4x32-10 (Salmon et al., SC'11; Random123's constants). torch has no uint32 or uint64 arithmetic, so the
# words are held in int64 in [0, 2^32). The 32x32->64 product x*M (M >= 2^31) is taken as p = x*(M - 2^32), which
# fits int64 (|p| < 2^63): lo = p & (2^32-1) and hi = (p >> 32) + x, ``>>`` flooring as an arithmetic shift does.
# The same round code runs on Python ints (constant words stay ints, so a word that is still 0 costs nothing).
_MASK32 = (1 << 32) - 1
_PHILOX_M = (0xD2511F53 - (1 << 32), 0xCD9E8D57 - (1 << 32))
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
RADIUS_BITS, ANGLE_BITS = 19, 13
"""Each 32-bit Philox word gives one Box-Muller pair: its top 19 bits pick the radius, its low 13 the angle."""


def counter_chunk(device: torch.device) -> int:
    """Elements drawn per step of counter noise on ``device``: a speed knob only (the values do not depend on it).
    A GPU takes large steps (fewer launches). A CPU takes 2^18 with one thread (per-op overhead dominates below:
    a SmolLM2-135M pass took about half the time of one at 2^15), and 2^15 with more, so that every op stays under
    torch's parallel grain (32768 elements) and runs without OpenMP barriers: when actors share cores, those cost
    far more than they gain (2 threads: a pass 7-10x slower at 2^16-2^18 than at 2^15). benchmarks/noise.py
    times a pass (``--threads``)."""
    if device.type != "cpu":
        return 1 << 22
    return 1 << 18 if torch.get_num_threads() == 1 else 1 << 15


def philox4x32(c0, c1, c2, c3, k0: int, k1: int, rounds: int = 10):
    """Philox-4x32 of the counter words (int64 tensors or ints in [0, 2^32)) under the key (k0, k1): 4 words."""
    for _ in range(rounds):
        p0, p1 = c0 * _PHILOX_M[0], c2 * _PHILOX_M[1]
        hi0, hi1 = (p0 >> 32) + c0, (p1 >> 32) + c2
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, p1 & _MASK32, hi0 ^ c3 ^ k1, p0 & _MASK32
        k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
    return c0, c1, c2, c3


def _round_to_fp32(exact: np.ndarray, precise) -> np.ndarray:
    """fp32 rounding of fp64 values that is the correctly rounded fp32 of the exact function: an entry whose fp64
    value lies within 2^-36 (relative) of an fp32 rounding midpoint, where a libm's last-ulp error could flip the
    rounding, is decided by ``precise(i)`` (an mpmath value at 40 digits). So the tables do not depend on the
    host's libm, and every machine builds the same bits."""
    f = exact.astype(np.float32)
    towards = np.nextafter(f, np.where(exact > f, np.float32(np.inf), np.float32(-np.inf)))
    mid = (f.astype(np.float64) + towards.astype(np.float64)) / 2  # exact in fp64
    close = np.abs(exact - mid) <= np.abs(exact) * 2.0**-36
    for i in np.flatnonzero(close):
        f[i] = towards[i] if (precise(int(i)) > mid[i]) == (towards[i] > f[i]) else f[i]
    return f


@functools.lru_cache(maxsize=None)
def _tables_cpu() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(radius, cos, sin) fp32 tables: radius[i] = sqrt(-2 ln u_i), u_i = (i + 1/2) / 2^19 (the Rayleigh quantile
    at the middle of bin i); cos[a], sin[a] of 2 pi (a + 1/2) / 2^13."""
    import mpmath  # torch's own dependency (through sympy)

    n_r, quarter = 1 << RADIUS_BITS, 1 << (ANGLE_BITS - 2)
    u_minus_1 = (np.arange(n_r, dtype=np.float64) + 0.5 - n_r) / n_r  # exact
    k = np.arange(quarter, dtype=np.float64)
    with mpmath.workdps(40):
        radius = _round_to_fp32(
            np.sqrt(-2.0 * np.log1p(u_minus_1)), lambda i: mpmath.sqrt(-2 * mpmath.log((mpmath.mpf(i) + 0.5) / n_r))
        )
        # sin on the first quadrant only (full relative accuracy there; cos near pi/2 would lose it), the rest by
        # symmetry
        q = _round_to_fp32(
            np.sin(np.pi / 2 * (k + 0.5) / quarter),
            lambda i: mpmath.sin(mpmath.pi / 2 * (mpmath.mpf(i) + 0.5) / quarter),
        )
    rev = q[::-1]  # cos of the first quadrant
    cos = np.concatenate([rev, -q, -rev, q])
    sin = np.concatenate([q, rev, -q, -rev])
    return tuple(torch.from_numpy(np.ascontiguousarray(t)) for t in (radius, cos, sin))


@functools.lru_cache(maxsize=None)
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(radius_radius, cos_sin) on ``device``, each entry twice and cos beside sin: (2^19, 2) and (2^13, 2), so two
    gathers give both halves of a pair in the output's layout and one same-shape multiply (no broadcast) ends it."""
    radius, cos, sin = _tables_cpu()
    return torch.stack([radius, radius], dim=1).to(device), torch.stack([cos, sin], dim=1).to(device)


COMPILE_ENV = "ES_RAY_NOISE_COMPILE"
"""Compiled counter noise (``compiled_block``): ``auto`` (the default) on CUDA only, ``1`` on every device, ``0``
never. On a CPU the compiled pass is 3-10x faster (benchmarks/noise.py times eager and compiled side by side), but
the compile (C++, once per process) costs about ten compiled passes, which every Ray actor and test
process would pay: opt in with ES_RAY_NOISE_COMPILE=1 for long CPU runs with es.noise=counter."""
_COMPILED: dict[tuple[str, int], object] = {}
_COMPILE_FAILED: dict[str, str] = {}
_log = logging.getLogger(__name__)


def counter_block(
    b0: torch.Tensor, key: torch.Tensor, radius: torch.Tensor, cos_sin: torch.Tensor, blocks: int
) -> torch.Tensor:
    """Elements [8 b0, 8 (b0 + blocks)) of the counter stream under ``key`` (2 int64 words), fp32: the body of
    ``counter_noise`` as one function of tensors (the block index and the key are tensors, so a new seed or offset
    never recompiles), which ``compiled_block`` hands to torch.compile: a fused C++ loop on a CPU, a Triton kernel on
    a GPU, with the same integer ops and the one fp32 multiply, so the same bits."""
    j = torch.arange(blocks, dtype=torch.int64, device=b0.device) + b0
    zero = torch.zeros_like(j)
    words = torch.stack(philox4x32(j & _MASK32, j >> 32, zero, zero, key[0], key[1]), dim=1).view(-1)
    r = torch.index_select(radius, 0, words >> ANGLE_BITS)
    pairs = torch.index_select(cos_sin, 0, words & ((1 << ANGLE_BITS) - 1))
    return (pairs * r).view(-1)


def compiled_block(device: torch.device, blocks: int):
    """``counter_block`` compiled for ``device`` and ``blocks`` (once per process), or None: where ES_RAY_NOISE_COMPILE
    says not to (``COMPILE_ENV``), or where compiling failed before (no compiler, no Triton: logged once, eager from
    then on)."""
    mode = os.environ.get(COMPILE_ENV, "auto")
    if mode == "0" or (mode == "auto" and device.type != "cuda") or device.type in _COMPILE_FAILED:
        return None
    key = (str(device), blocks)
    if key not in _COMPILED:
        # one thread on a CPU: OpenMP barriers inside the fused loop cost more than they gain when cores are shared
        options = {"cpp.threads": 1} if device.type == "cpu" else None
        compiled = torch.compile(counter_block, fullgraph=True, dynamic=False, options=options)
        radius, cos_sin = _tables(device)
        try:  # compile now, on a throwaway draw: a failure falls back to eager for good, with the reason logged
            compiled(
                torch.zeros((), dtype=torch.int64, device=device),
                torch.zeros(2, dtype=torch.int64, device=device),
                radius,
                cos_sin,
                blocks,
            )
        except Exception as err:  # noqa: BLE001 - any compiler failure means: use the eager reference
            _COMPILE_FAILED[device.type] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            _log.warning(
                "counter noise on %s runs eager: torch.compile failed (%s)", device.type, _COMPILE_FAILED[device.type]
            )
            return None
        _COMPILED[key] = compiled
    return _COMPILED[key]


def counter_noise(seed: int, start: int, out: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Fill the contiguous fp32 tensor ``out`` with elements [start, start + numel) of the counter stream ``seed``.

    Element e is Box-Muller from word w = (e % 8) // 2 of Philox-4x32-10 with counter (e // 8 mod 2^32,
    e // 2^35, 0, 0) and key (seed mod 2^32, seed >> 32): radius[w >> 13] * cos[w & 8191] for even e, times sin
    for odd e. Bit-exact on every device and thread count: the integer part is exact; the tables are built on the
    host with correct rounding and copied; the one float operation is a single fp32 multiply, which IEEE 754
    rounds the same way on a CPU and on CUDA (there is no add it could be fused with, and every product is a normal
    number, at least 3.7e-7, so flush-to-zero modes cannot touch it). The distribution: a radius
    at the middle of each of 2^19 equiprobable bins and 2^13 equally spaced angles, so mean 0 and correlation 0
    exactly, variance 1 - 7e-7, tails cut at |z| = 5.27 (a true normal exceeds it with probability 1.4e-7).
    """
    radius, cos_sin = _tables(out.device)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    flat = out.view(-1)
    if chunk is None:  # the default step: compiled where ``compiled_block`` allows (an explicit chunk stays eager)
        chunk = counter_chunk(out.device)
        blocks = (chunk + 7) // 8 + 1  # covers any run of chunk elements, however it meets the 8-element blocks
        compiled = compiled_block(out.device, blocks) if flat.numel() > chunk // 8 else None
        if compiled is not None:
            key = torch.tensor([k0, k1], dtype=torch.int64, device=out.device)
            for a in range(0, flat.numel(), chunk):
                e0, e1 = start + a, start + min(a + chunk, flat.numel())
                b0 = e0 >> 3
                drawn = compiled(torch.tensor(b0, dtype=torch.int64, device=out.device), key, radius, cos_sin, blocks)
                flat[a : a + e1 - e0].copy_(drawn[e0 - 8 * b0 : e1 - 8 * b0])
            return out
    chunk = max(1, chunk)
    for a in range(0, flat.numel(), chunk):
        e0, e1 = start + a, start + min(a + chunk, flat.numel())
        b0, b1 = e0 >> 3, (e1 + 7) >> 3
        j = torch.arange(b0, b1, dtype=torch.int64, device=out.device)
        c0, c1 = (j, 0) if b1 <= 1 << 32 else (j & _MASK32, j >> 32)
        words = torch.stack(philox4x32(c0, c1, 0, 0, k0, k1), dim=1).view(-1)  # (blocks * 4,)
        r = torch.index_select(radius, 0, words >> ANGLE_BITS)
        pairs = torch.index_select(cos_sin, 0, words.bitwise_and_((1 << ANGLE_BITS) - 1))  # (blocks * 4, 2)
        if e0 == 8 * b0 and e1 == 8 * b1:  # whole blocks: straight into out
            torch.mul(pairs, r, out=flat[a : a + e1 - e0].view(-1, 2))
        else:
            flat[a : a + e1 - e0].copy_(torch.mul(pairs, r).view(-1)[e0 - 8 * b0 : e1 - 8 * b0])
    return out


def _numel(shape) -> int:
    return math.prod(int(s) for s in shape)


class _GeneratorDraw:
    """per_tensor: torch's generator seeded per tensor. It cannot skip ahead, so a part is cut from the whole draw."""

    views = False
    whole_tensor = True

    def __init__(self, src: "NoiseSource", table_size: int):
        self.device = src.device
        self.gen = torch.Generator(device=src.device)

    def span(self, seed: int, name: str, whole: torch.Size, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        self.gen.manual_seed(seed)
        if out.shape == whole:  # the whole tensor: straight into out
            return torch.randn(whole, generator=self.gen, dtype=torch.float32, device=self.device, out=out)
        drawn = torch.randn(whole, generator=self.gen, dtype=torch.float32, device=self.device)
        return out.copy_(drawn.view(-1)[lo:hi].view(out.shape))


class _CounterDraw:
    """counter: Philox of (tensor seed, element index), so any span is drawn alone."""

    views = False
    whole_tensor = False

    def __init__(self, src: "NoiseSource", table_size: int):
        self.chunk = src.chunk

    def span(self, seed: int, name: str, whole: torch.Size, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        return counter_noise(seed, lo, out, self.chunk)


class _TableDraw:
    """table: a seeded slice of one table per process, handed out as a view (no buffer of its own)."""

    views = True
    whole_tensor = False

    def __init__(self, src: "NoiseSource", table_size: int):
        g = torch.Generator(device=src.device).manual_seed(table_seed(src.run_seed))
        self.table = torch.randn(int(table_size), generator=g, dtype=torch.float32, device=src.device)

    def span(self, seed: int, name: str, whole: torch.Size, lo: int, hi: int, out: None) -> torch.Tensor:
        """Elements [lo, hi) of the table slice of tensor ``name``."""
        numel = _numel(whole)
        span = self.table.numel() - numel + 1
        if span <= 0:
            raise ValueError(
                f"noise table of {self.table.numel()} values is smaller than tensor {name} ({numel} values); "
                "raise es.noise_table_size or use es.noise=counter"
            )
        start = seed % span
        return self.table[start + lo : start + hi]


NOISE_DRAWS = Registry("es.noise", {"per_tensor": _GeneratorDraw, "table": _TableDraw, "counter": _CounterDraw})
"""es.noise's sources -> how each draws a span of a tensor's noise (``views``: a view of its own storage, no
buffer; ``whole_tensor``: a part is cut from the whole tensor's draw). NOISE_MEMORY's lines follow these."""


class NoiseSource:
    """Produces fp32 noise for (iteration, noise_id, name, shape): a per-tensor generator, a table or a counter."""

    def __init__(
        self,
        run_seed: int,
        kind: str = "per_tensor",
        table_size: int = 1 << 25,
        device: str = "cpu",
        chunk: int | None = None,
        scope: str = "per_tensor",
    ):
        NOISE_KINDS.check(kind)
        NOISE_SCOPES.check(scope)
        self.scope = scope
        self.run_seed = int(run_seed)
        self.kind = kind
        self.device = torch.device(device)
        self.chunk = chunk
        self._draw = NOISE_DRAWS.get(kind)(self, table_size)
        self.table: torch.Tensor | None = getattr(self._draw, "table", None)

    @property
    def views(self) -> bool:
        """Noise comes as views of the source's own storage (table): callers need no buffer for it."""
        return self._draw.views

    @property
    def whole_tensor(self) -> bool:
        """A part of a tensor's noise is cut from the whole tensor's draw (per_tensor); else drawn alone."""
        return self._draw.whole_tensor

    def noise(self, iteration: int, noise_id: int, name: str, shape: torch.Size, out: torch.Tensor | None = None):
        """Standard-normal fp32 noise of ``shape``; written into ``out`` when given (per_tensor, counter) or a table
        view."""
        shape = torch.Size(shape)
        return self._span(self._seed(iteration, noise_id, name), name, shape, 0, _numel(shape), shape, out)

    def _seed(self, iteration: int, noise_id: int, name: str) -> int:
        """per_tensor scope: every tensor its own stream; reference scope: one seed for all tensors of a member (the
        reference implementation's, so equal-shaped tensors get identical noise: a parity mode, not a default)."""
        return derive_seed(self.run_seed, iteration, noise_id, name if self.scope == "per_tensor" else "")

    def noise_slice(
        self, iteration: int, noise_id: int, name: str, shape: torch.Size, rows: slice, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows [a:b) (``rows``, step 1) of the noise of the whole tensor of ``shape``, equal to
        ``noise(...)[a:b]`` bit for bit. counter and table draw only those rows; per_tensor draws the whole
        tensor (its generator cannot skip) and copies the rows out."""
        shape = torch.Size(shape)
        a, b, step = rows.indices(shape[0])
        if step != 1:
            raise ValueError(f"noise_slice takes contiguous rows (step 1), got {rows}")
        b = max(a, b)
        row = _numel(shape[1:])
        sub = torch.Size([b - a, *shape[1:]])
        return self._span(self._seed(iteration, noise_id, name), name, shape, a * row, b * row, sub, out)

    def _span(
        self, seed: int, name: str, whole: torch.Size, lo: int, hi: int, shape: torch.Size, out: torch.Tensor | None
    ) -> torch.Tensor:
        """Elements [lo, hi) of tensor ``name``'s noise (``whole`` its shape), as ``shape``: into ``out`` (a new
        tensor when None), or a view where the source hands out views."""
        if self._draw.views:
            return self._draw.span(seed, name, whole, lo, hi, None).view(shape)
        if out is None:
            out = torch.empty(shape, dtype=torch.float32, device=self.device)
        return self._draw.span(seed, name, whole, lo, hi, out)
