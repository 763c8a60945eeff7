"""Seed derivation and noise tensors (pure torch; no Ray, no engine).

Noise identity: the noise of perturbation ``noise_id`` of iteration ``t`` on the HF tensor ``name`` is a
function of ``(run_seed, t, noise_id, name)`` only, fp32, in HF layout. Every tensor has its own stream, so two
tensors of equal shape never share noise, and the seeds are unique by construction (a cryptographic hash of the
tuple), never drawn at random.

Two sources give that identity:

* ``per_tensor``: a ``torch.Generator`` seeded with the tensor's seed draws ``randn(shape)``. Cheap on a GPU.
* ``table``: one large standard-normal table is drawn once per run from the run seed; a tensor's noise is the
  contiguous slice starting at ``seed % (table_size - numel + 1)`` (the OpenAI ES starter's shared table). On a
  CPU this is 5-15x cheaper than drawing, at the cost of ``table_size * 4`` bytes per actor.

The same device type gives the same numbers bit for bit; CPU and CUDA generators differ from each other, so all
replicas of one run must share a device type (which Ray placement gives them).
"""

from __future__ import annotations

import hashlib
import struct

import torch

from es_ray.core.registry import Registry

NOISE_KINDS = Registry("es.noise", {"per_tensor": "a generator per tensor", "table": "slices of one seeded table"})
"""The noise sources (es.noise also accepts auto: table on CPU, per_tensor on GPU)."""
_MASK63 = (1 << 63) - 1


def derive_seed(run_seed: int, iteration: int, noise_id: int, name: str) -> int:
    """63-bit seed for one tensor of one perturbation; distinct tuples give distinct streams."""
    h = hashlib.blake2b(digest_size=8, person=b"es_ray.noise")
    h.update(struct.pack("<qqq", int(run_seed), int(iteration), int(noise_id)))
    h.update(name.encode())
    return int.from_bytes(h.digest(), "little") & _MASK63


def table_seed(run_seed: int) -> int:
    return derive_seed(run_seed, -1, -1, "__noise_table__")


class NoiseSource:
    """Produces fp32 noise for (iteration, noise_id, name, shape), from a per-tensor generator or a table."""

    def __init__(self, run_seed: int, kind: str = "per_tensor", table_size: int = 1 << 25, device: str = "cpu"):
        NOISE_KINDS.check(kind)
        self.run_seed = int(run_seed)
        self.kind = kind
        self.device = torch.device(device)
        self._gen = torch.Generator(device=self.device)
        self.table: torch.Tensor | None = None
        if kind == "table":
            g = torch.Generator(device=self.device).manual_seed(table_seed(run_seed))
            self.table = torch.randn(int(table_size), generator=g, dtype=torch.float32, device=self.device)

    def noise(self, iteration: int, noise_id: int, name: str, shape: torch.Size, out: torch.Tensor | None = None):
        """Standard-normal fp32 noise of ``shape``; written into ``out`` when given (per_tensor) or a table view."""
        seed = derive_seed(self.run_seed, iteration, noise_id, name)
        if self.table is not None:
            numel = 1
            for s in shape:
                numel *= int(s)
            span = self.table.numel() - numel + 1
            if span <= 0:
                raise ValueError(
                    f"noise table of {self.table.numel()} values is smaller than tensor {name} ({numel} values); "
                    "raise es.noise_table_size or use es.noise=per_tensor"
                )
            start = seed % span
            return self.table[start : start + numel].view(shape)
        self._gen.manual_seed(seed)
        if out is None:
            return torch.randn(shape, generator=self._gen, dtype=torch.float32, device=self.device)
        return torch.randn(shape, generator=self._gen, dtype=torch.float32, device=self.device, out=out)
