"""What one ES replica (es_ray/replica.py) allocates, stated from its parts and settings alone (no torch): the
replica sizes its two buffers with ``buffer_elements`` and states everything it holds with ``replica_lines``
(``Replica.memory``), and the memory plan (es_ray/memory_plan/) asks the same function for the parts a GPU rank
would hold, so a change in what the replica allocates changes the plan with it.

What a replica holds, per trainable tensor part of ``elements`` fp32 values (a tensor-parallel rank's shard, or the
whole tensor): the master (4 B), Adam's moments m and v (8 B, es.optimizer=adam, made at the first step), theta_0
(4 B, es.anchor_decay); and once, whatever the number of tensors: the write buffer (the largest whole HF tensor: a
sharded write hands the engine the whole tensor), the noise buffer (the largest noise drawn: none where the noise
comes as views of a table, unless the noise is factored), the noise source's own memory (``NoiseMemory``: a table,
counter noise's chunk temporaries), one largest-part temporary of the optimizer's step (Adam's denominator, the
anchor's theta - theta_0), the realised-update measurement's chunks, and under es.perturbation=lowrank the members'
stacked factors (``Replica.member_factors``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

from es_ray.core.memory import ALLOCATOR_SLACK_BYTES, Line
from es_ray.noise_kinds import COUNTER_NOISE_BYTES, NOISE_MEMORY, NoiseMemory
from es_ray.perturbation import PERTURBATIONS

CHUNK = 1 << 20
"""Elements per chunk when the update is measured against the engine (es_ray.replica's ``update_sums`` and
``mismatches``): the temporaries are a few fp32/fp64 tensors of this size, never a copy of a whole tensor (a 7B
model's embedding alone is 545M elements)."""
CHUNK_TEMPORARIES = 4
"""fp32-sized temporaries per chunk element there: the cast to the engine dtype and back, the difference r, and the
mismatch masks (16 MiB at 2**20 elements)."""
FP32 = 4


@dataclass(frozen=True)
class TensorPart:
    """The part of one HF tensor a replica holds (es_ray.replica.Shard, without torch)."""

    shape: tuple[int, ...]
    """The whole HF tensor's shape."""
    elements: int
    """Elements of this replica's part (all of them for a whole tensor)."""
    dim: int | None = None
    """The dim the part is cut along (None: the whole tensor)."""


def buffer_elements(parts: Mapping[str, TensorPart], noise: NoiseMemory, factored: bool) -> tuple[int, int]:
    """(write buffer, noise buffer) elements, fp32: the largest whole HF tensor, and the largest noise drawn for a
    part (the part alone where the kind draws just its rows, else the whole tensor it is cut from; 0: no noise
    buffer, the noise coming as views of a table and not factored)."""
    write = max(math.prod(p.shape) for p in parts.values())
    if noise.table and not factored:
        return write, 0
    drawn = max(math.prod(p.shape) if noise.whole_tensor or p.dim == 1 else p.elements for p in parts.values())
    return write, drawn


def factor_elements(shapes: Iterable[tuple[int, ...]], rank: int) -> int:
    """Elements of one member's low-rank factors A and B: rank x (rows + columns) of every 2-D tensor given (the
    tensors es.perturbation=lowrank perturbs)."""
    return sum(rank * (s[0] + s[1]) for s in shapes if len(s) == 2)


def replica_lines(
    parts: Mapping[str, TensorPart],
    *,
    optimizer: str,
    anchor_decay: float,
    noise: str,
    noise_table_size: int,
    perturbation: str = "full",
    rank: int = 0,
    members: int = 0,
) -> list[Line]:
    """Everything a replica holding ``parts`` (HF name -> its part) allocates, as part "es" lines. ``noise``: an
    es.noise value (auto: planned as the larger of the GPU kinds, ``NOISE_MEMORY``); ``members``: members whose
    factors ``Replica.member_factors`` stacks at once (es.perturbation=lowrank)."""
    if not parts:
        raise ValueError("a replica holds at least one tensor")
    kind, memory = PERTURBATIONS.get(perturbation), NOISE_MEMORY.get(noise)
    n = sum(p.elements for p in parts.values())
    big = max(p.elements for p in parts.values())
    sharded = any(p.dim is not None for p in parts.values())
    write, drawn = buffer_elements(parts, memory, kind.factored)
    lines = [
        Line(
            "es",
            "fp32 master",
            FP32 * n,
            f"{n:,} trainable parameters x 4 B" + (" (this rank's shards)" if sharded else ""),
        )
    ]
    if optimizer == "adam":
        lines.append(Line("es", "Adam moments", 2 * FP32 * n, "m and v, fp32: 8 B per trainable parameter"))
    if anchor_decay:
        lines.append(Line("es", "theta_0 anchor", FP32 * n, "es.anchor_decay: the initial weights, fp32"))
    lines.append(Line("es", "write buffer", FP32 * write, f"fp32, the largest whole HF tensor ({write:,} elements)"))
    if memory.table:
        lines.append(
            Line("es", "noise table", FP32 * noise_table_size, f"es.noise_table_size={noise_table_size} x 4 B")
        )
    if drawn:
        lines.append(
            Line(
                "es",
                "noise buffer",
                FP32 * drawn,
                f"fp32, the largest noise drawn ({drawn:,} elements, es.noise={noise})",
            )
        )
    if memory.counter_chunks:
        lines.append(Line("es", "counter noise chunks", COUNTER_NOISE_BYTES, "es.noise=counter's Philox temporaries"))
    if optimizer == "adam" or anchor_decay:
        lines.append(Line("es", "step temporary", FP32 * big, "Adam's sqrt(v) or the anchor's theta - theta_0"))
    lines.append(
        Line(
            "es",
            "update chunks",
            FP32 * CHUNK_TEMPORARIES * min(CHUNK, big),
            f"{CHUNK_TEMPORARIES} fp32 temporaries of replica_memory.CHUNK={CHUNK} elements",
        )
    )
    if kind.factored:
        per = factor_elements((p.shape for p in parts.values()), rank)
        lines.append(
            Line(
                "es",
                "low-rank factors",
                FP32 * members * per,
                f"fp32 A and B of {members} members x {per:,} elements (rank {rank})",
            )
        )
    lines.append(
        Line(
            "es",
            "allocator slack",
            ALLOCATOR_SLACK_BYTES,
            "caching-allocator rounding and fragmentation",
            gpu_only=True,
        )
    )
    return lines
