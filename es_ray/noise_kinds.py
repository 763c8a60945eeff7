"""The es.noise and es.noise_scope values, what each holds in memory, and the seeds: no torch, so a driver can check
a config and plan memory without importing it. The noise tensors themselves are ``es_ray.noise``'s, which
re-exports everything here."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from es_ray.core.registry import Registry

NOISE_SCOPES = Registry(
    "es.noise_scope",
    {
        "per_tensor": "every tensor of a member has its own stream (the textbook estimator)",
        "reference": "one seed for every tensor of a member, as the reference ES implementation (equal shapes share "
        "noise): to reproduce the paper's own setting",
    },
)
NOISE_KINDS = Registry(
    "es.noise",
    {
        "per_tensor": "a generator per tensor",
        "table": "slices of one seeded table",
        "counter": "Philox-4x32-10 of (tensor seed, element index)",
    },
)
"""The noise sources."""
ES_NOISE = Registry(
    "es.noise",
    {"auto": "table on a CPU, per_tensor on a GPU (``resolve_kind``)", **{k: NOISE_KINDS.get(k) for k in NOISE_KINDS}},
)
"""es.noise's values: a source, or auto."""
PORTABLE_KINDS = frozenset({"counter"})
"""Kinds whose numbers do not depend on the device: the others need every replica on the same device model."""


@dataclass(frozen=True)
class NoiseMemory:
    """What an es.noise value holds beside the replica on a GPU (es_ray/replica_memory.py's lines)."""

    table: bool
    """one es.noise_table_size table per actor (and no noise buffer)."""
    whole_tensor: bool
    """a tensor's noise is drawn whole and a tensor-parallel rank's rows cut from it (else those rows alone)."""
    counter_chunks: bool
    """counter noise's Philox temporaries."""


NOISE_MEMORY = Registry(
    "es.noise",
    {
        "per_tensor": NoiseMemory(table=False, whole_tensor=True, counter_chunks=False),
        "table": NoiseMemory(table=True, whole_tensor=False, counter_chunks=False),
        "counter": NoiseMemory(table=False, whole_tensor=False, counter_chunks=True),
        # auto on a GPU is one of per_tensor and counter (the memory plan's docstring): planned for both
        "auto": NoiseMemory(table=False, whole_tensor=True, counter_chunks=True),
    },
)
"""es.noise's values -> the memory each takes (``NoiseMemory``)."""
COUNTER_NOISE_BYTES = 1 << 28
"""es.noise=counter on a GPU: es_ray.noise draws 2^22 elements per step (``counter_chunk``) with about 32 B of
int64/fp32 Philox temporaries per element (128 MiB), plus its small Box-Muller tables: a quarter GiB covers it."""
_MASK63 = (1 << 63) - 1


def resolve_kind(kind: str, device_type: str, scope: str = "per_tensor") -> str:
    """es.noise=auto: table on a CPU, per_tensor on a GPU (the cheapest on each; benchmarks/noise.py and the
    the "Noise:" paragraph of docs/es-update.md give the costs and why counter, portable but dearer, is opt-in).
    Under es.noise_scope=reference, per_tensor everywhere: the reference's own draw (``check_reference_noise``)."""
    if kind != "auto":
        return kind
    return "table" if device_type == "cpu" and scope != "reference" else "per_tensor"


def check_reference_noise(kind: str, scope: str) -> str | None:
    """The one line that refuses es.noise_scope=reference with a noise the reference does not draw (None: fine).
    The reference draws ``torch.randn(shape, generator)`` from one generator seeded with the member's seed, which is
    es.noise=per_tensor's draw; a table slice or a counter gives other numbers, so the parity would not hold."""
    if scope == "reference" and kind not in ("per_tensor", "auto"):
        return (
            f"es.noise_scope=reference needs es.noise=per_tensor (the reference's torch.randn per tensor from "
            f"the member's seed); es.noise={kind} draws other numbers: set es.noise=per_tensor (auto picks it "
            "under this scope)"
        )
    return None


def derive_seed(run_seed: int, iteration: int, noise_id: int, name: str) -> int:
    """63-bit seed for one tensor of one perturbation; distinct tuples give distinct streams."""
    h = hashlib.blake2b(digest_size=8, person=b"es_ray.noise")
    h.update(struct.pack("<qqq", int(run_seed), int(iteration), int(noise_id)))
    h.update(name.encode())
    return int.from_bytes(h.digest(), "little") & _MASK63


def table_seed(run_seed: int) -> int:
    return derive_seed(run_seed, -1, -1, "__noise_table__")
