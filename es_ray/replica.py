"""One ES replica: the fp32 master weights, the noise source and the optimizer, beside an engine.

The replica lives wherever the engine's weights live (in the Ray actor for the transformers engine, inside
vLLM's worker for the vLLM engine) and talks to the engine through two callables: ``write(named)`` copies an
iterable of (HF name, fp32 tensor) pairs into the engine, casting to the engine's dtype, and must consume each
tensor before asking for the next (the replica reuses one buffer); ``read(name)`` returns the tensor the engine
holds for one HF name, in the engine's own dtype and HF shape (a view where the layout allows), or None where
the engine cannot give it back (vLLM with tensor parallelism).

Exactness (docs/design.md "ES, precisely"):
* a member is written as cast(master + sign * sigma * eps); restoring writes cast(master); nothing is ever
  subtracted in the engine's dtype;
* the update is applied to the fp32 master in a fixed order (sorted tensor names, noise ids ascending), so
  replicas on the same hardware stay equal bit for bit, which ``checksum`` lets the driver verify;
* the update regenerates the noises one tensor at a time into one flat fp32 buffer (plus one noise buffer), and
  measures what the engine realised in chunks of ``CHUNK`` elements (no whole-tensor temporaries).

Tensor parallelism: a replica may hold only part of each HF tensor (a ``Shard``: rows or columns [start, stop) of
it, what one vLLM rank's weight loader reads). Its master, optimizer state and theta_0 are then that part only;
the noise is still the whole HF tensor's, sliced (``NoiseSource.noise_slice`` draws only those rows where the kind
can), so it does not depend on the TP degree; a write hands the engine the whole HF-shaped tensor from a buffer
with the rank's part in place (the loader reads only that part); ``read`` gives back that part as the engine holds
it. The ranks' checksums combine into the unsplit model's (``combine_checksums``), and their states into whole
tensors (``gather_shards``), each part sent once, by its owner.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator, Mapping

import torch

from es_ray import lowrank
from es_ray.core.memory import Line
from es_ray.models import iter_hf_weights
from es_ray.noise import NOISE_MEMORY, NoiseSource, resolve_kind
from es_ray.replica_memory import CHUNK, TensorPart, buffer_elements, replica_lines
from es_ray.replica_spec import ReplicaSpec  # noqa: F401 - the replica's settings, re-exported
from es_ray.strategy import Member, Optimizer, gradient, gradient_weights

Writer = Callable[[Iterable[tuple[str, torch.Tensor]]], None]
Reader = Callable[[str], "torch.Tensor | None"]


@dataclass(frozen=True)
class Shard:
    """The part of one HF tensor (of ``shape``) that one tensor-parallel rank holds: indices [start, stop) along
    ``dim``, or the whole tensor when ``dim`` is None. ``owner``: this rank is the lowest one holding this part (a
    part several ranks hold, a norm weight or a replicated KV head, is sent once, by its owner)."""

    shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    stop: int = 0
    owner: bool = True

    @classmethod
    def part(cls, shape: Iterable[int], dim: int, start: int, stop: int, owner: bool = True) -> Shard:
        """[start, stop) along ``dim``; the whole tensor when that is all of it."""
        shape = tuple(int(s) for s in shape)
        if not 0 <= start < stop <= shape[dim]:
            raise ValueError(f"part [{start}, {stop}) of dim {dim} does not fit a tensor of shape {shape}")
        if start == 0 and stop == shape[dim]:
            return cls(shape, owner=owner)
        return cls(shape, dim, int(start), int(stop), owner)

    @property
    def index(self) -> tuple[slice, ...]:
        """``tensor[index]`` is this part of the whole tensor (a view)."""
        return () if self.dim is None else (slice(None),) * self.dim + (slice(self.start, self.stop),)

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        return self.shape[: self.dim] + (self.stop - self.start,) + self.shape[self.dim + 1 :]

    def take(self, whole: torch.Tensor) -> torch.Tensor:
        return whole[self.index]

    def __str__(self) -> str:
        return "" if self.dim is None else "[" + ":, " * self.dim + f"{self.start}:{self.stop}]"


def tensor_checksum(t: torch.Tensor) -> int:
    """Sum of the tensor's bit patterns as wrapping int64: any single changed bit changes it, order-free, and
    additive over disjoint parts (``combine_checksums``)."""
    flat = t.detach().contiguous().view(-1)
    ints = flat.view(torch.int32) if flat.element_size() == 4 else flat.view(torch.int16)
    return int(ints.sum(dtype=torch.int64).item())


def _digest(sums: Mapping[str, int]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(sums):
        h.update(name.encode())
        h.update(str(sums[name]).encode())
    return h.hexdigest()


def checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    return _digest({name: tensor_checksum(t) for name, t in named})


def _tiling(name: str, shards: Iterable[Shard]) -> list[Shard]:
    """The distinct parts of one tensor in order, checked to cover it exactly once (else ValueError)."""
    parts = sorted(set(shards), key=lambda s: s.start)
    if len(parts) == 1 and parts[0].dim is None:
        return parts
    dims = {s.dim for s in parts}
    stops = [0] + [s.stop for s in parts]
    if (
        len(dims) != 1
        or None in dims
        or any(s.start != stop for s, stop in zip(parts, stops))
        or stops[-1] != parts[0].shape[parts[0].dim]
    ):
        raise ValueError(
            f"the tensor-parallel parts of {name} ({', '.join(map(str, parts))} of shape "
            f"{parts[0].shape}) do not cover it exactly once"
        )
    return parts


def combine_checksums(parts_by_rank: Iterable[Mapping[str, tuple[Shard, int]]]) -> str:
    """The master digest of a replica split over tensor-parallel ranks, from each rank's (shard, tensor_checksum)
    per tensor: the bit sums of the distinct parts added (wrapping int64), so it equals the digest of the whole
    master (``checksum``) at any TP degree. A part that several ranks hold must have the same sum on each, else the
    ranks have diverged and this raises."""
    sums: dict[str, dict[Shard, tuple[int, int]]] = {}
    for rank, parts in enumerate(parts_by_rank):
        for name, (shard, bits) in parts.items():
            key = replace(shard, owner=True)
            seen_rank, seen = sums.setdefault(name, {}).setdefault(key, (rank, bits))
            if seen != bits:
                raise RuntimeError(
                    f"tensor-parallel ranks {seen_rank} and {rank} hold different weights for "
                    f"{name}{shard} (bit sums {seen} and {bits}): the ranks' masters diverged"
                )
    totals = {}
    for name, by_part in sums.items():
        total = sum(by_part[s][1] for s in _tiling(name, by_part))
        totals[name] = (total + (1 << 63)) % (1 << 64) - (1 << 63)
    return _digest(totals)


def gather_shards(
    per_rank: Iterable[tuple[Mapping[str, Shard], Mapping[str, torch.Tensor]]],
) -> dict[str, torch.Tensor]:
    """Whole tensors from the parts the ranks sent ((shards, tensors) per rank; each part once): concatenated in
    order along their dim; a tensor one rank sent whole is returned as it is (no copy)."""
    parts: dict[str, dict[Shard, torch.Tensor]] = {}
    for shards, tensors in per_rank:
        for name, t in tensors.items():
            if shards[name] in parts.setdefault(name, {}):
                raise ValueError(f"two ranks sent the part {name}{shards[name]}: only its owner sends it")
            parts[name][shards[name]] = t
    out = {}
    for name, by_part in parts.items():
        order = _tiling(name, by_part)
        out[name] = by_part[order[0]] if len(order) == 1 else torch.cat([by_part[s] for s in order], order[0].dim)
    return out


def _row_chunks(*tensors: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """Equal-shaped tensors cut together along dim 0 into slices of at most ``CHUNK`` elements (or one row if a
    row is larger): views, no copies."""
    rows = [t if t.dim() else t.view(1) for t in tensors]
    step = max(1, CHUNK // max(1, rows[0][0].numel()))
    for a in range(0, rows[0].shape[0], step):
        yield tuple(t[a : a + step] for t in rows)


def update_sums(delta: torch.Tensor, new_master: torch.Tensor, held: torch.Tensor | None) -> tuple[float, ...]:
    """(delta . delta, r . delta, r . r) for r = cast(new_master) - held, the cast being to ``held``'s dtype.

    Chunked; each chunk's dot products in fp32 (r is exact there: a difference of two bf16 values, or of two
    nearby fp32 ones), summed across chunks in fp64 on the device (one synchronisation per tensor). Without
    ``held`` only (delta . delta,)."""
    if held is not None and held.shape != new_master.shape:
        raise ValueError(f"the engine's tensor has shape {tuple(held.shape)}, the HF tensor {tuple(new_master.shape)}")
    sums = torch.zeros(3 if held is not None else 1, dtype=torch.float64, device=delta.device)
    for d, m, h in _row_chunks(delta, new_master, new_master if held is None else held):
        d = d.reshape(-1)
        if held is None:
            sums += torch.dot(d, d)
            continue
        r = (m.to(h.dtype).float() - h).view(-1)  # a new tensor: m.to(fp32) is the master itself
        sums += torch.stack([torch.dot(d, d), torch.dot(r, d), torch.dot(r, r)])
    return tuple(sums.tolist())


def mismatches(master: torch.Tensor, held: torch.Tensor) -> int:
    """Elements where the engine's tensor is not cast(master) (NaN equal to NaN), chunked."""
    bad = 0
    for m, h in _row_chunks(master, held):
        c = m.to(h.dtype)
        if not torch.equal(c, h):
            bad += int(((c != h) & ~(c.isnan() & h.isnan())).sum())
    return bad


def update_health(sums: Iterable[tuple[float, ...]]) -> dict:
    """update_norm, realised_cos and realised_norm (``Replica.update``) from the sums (delta . delta, r . delta,
    r . r) over disjoint parts, one entry per tensor-parallel rank; a rank that could not read back gives
    (delta . delta,), and then realised_* are None. The sums come back too, under ``sums``."""
    sums = list(sums)
    total = tuple(map(sum, zip(*sums)))
    out = {"update_norm": total[0] ** 0.5, "realised_cos": None, "realised_norm": None, "sums": total}
    if len(total) == 3:
        sq_update, dot, sq_real = total
        out["realised_norm"] = sq_real**0.5
        if sq_update:  # clamped: the fp32 dot products can put an exact alignment a few 1e-10 above 1
            out["realised_cos"] = max(-1.0, min(1.0, dot / (sq_update**0.5 * sq_real**0.5))) if sq_real > 0 else 0.0
    return out


class Replica:
    def __init__(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        spec: ReplicaSpec,
        write: Writer,
        read: Reader | None = None,
        device: str | torch.device = "cpu",
        shards: Mapping[str, Shard] | None = None,
    ):
        """``named``: (HF name, tensor) pairs, the tensor being this replica's part of the HF tensor where ``shards``
        names one (a tensor-parallel rank), else the whole tensor; each is copied to ``device`` in fp32 as it comes,
        so a lazily read source is never held whole."""
        self.spec = spec
        self.direct = False
        """Set by an engine whose ``read`` returns the very tensors it computes with (transformers): fp32 writes then
        go straight into them (``_in_place``), saving a pass over the model per perturbation."""
        self.write = write
        self.read = read
        self.device = torch.device(device)
        self.master: dict[str, torch.Tensor] = {}
        self.shards: dict[str, Shard] = {}
        for name, t in named:
            shard = (shards or {}).get(name) or Shard(tuple(t.shape))
            if spec.selects(name, shard.shape):
                if tuple(t.shape) != shard.local_shape:
                    raise ValueError(
                        f"{name}: got a tensor of shape {tuple(t.shape)} for the part {shard} of {shard.shape}"
                    )
                self.shards[name] = shard
                self.master[name] = t.detach().to(device=self.device, dtype=torch.float32, copy=True)
        if not self.master:
            raise ValueError(
                f"model.trainable={spec.trainable!r} matches no parameter{spec.kind.target_note()}; fix the regex"
            )
        spec.kind.check_model(spec.rank, lambda: {n: s.shape for n, s in self.shards.items()})
        self.names = sorted(self.master)
        self.theta0 = {k: v.clone() for k, v in self.master.items()} if spec.anchor_decay else None
        kind = resolve_kind(spec.noise, self.device.type, spec.noise_scope)
        self.noise = NoiseSource(spec.run_seed, kind, spec.noise_table_size, device=self.device, scope=spec.noise_scope)
        self.opt = Optimizer(
            spec.optimizer,
            spec.lr,
            (spec.adam_beta1, spec.adam_beta2),
            spec.adam_eps,
            spec.weight_decay,
            spec.anchor_decay,
        )
        # _buf holds a whole HF tensor (a sharded write hands the engine one); _nbuf the noise drawn for a part: the
        # part alone where noise_slice draws just its rows (counter, table), else the whole tensor it is cut from.
        # Sized by the statement of what the replica allocates (``memory``), so the plan and the buffers agree.
        self.noise_kind = kind
        write, drawn = buffer_elements(self.parts(), NOISE_MEMORY.get(kind), spec.kind.factored)
        self._buf = torch.empty(write, dtype=torch.float32, device=self.device)
        self._nbuf = torch.empty(drawn, dtype=torch.float32, device=self.device) if drawn else None

    @classmethod
    def from_checkpoint(
        cls,
        model_dir: str,
        names: Iterable[str],
        spec: ReplicaSpec,
        write: Writer,
        read: Reader | None = None,
        device: str | torch.device = "cpu",
        shards: Mapping[str, Shard] | None = None,
    ) -> Replica:
        """The master from the checkpoint's tensors in fp32 (never from the engine's cast weights), read one tensor
        (or one rank's part of it) at a time, then written into the engine, so that it holds cast(master) from the
        start. A sharded replica's first write fills everything outside its parts with NaN: the engine holding a
        NaN afterwards (the caller checks) means the shards do not match what the engine's loader reads."""

        names = [n for n in names if spec.selects(n)]
        shards = dict(shards or {})
        index = {n: shards[n].index for n in names if n in shards and shards[n].dim is not None}
        replica = cls(iter_hf_weights(model_dir, names, index), spec, write, read, device, shards)
        replica.restore(fill=float("nan") if index else None)
        return replica

    # -- memory --------------------------------------------------------------------------------------------
    def parts(self) -> dict[str, TensorPart]:
        """HF name -> the part of it this replica holds (es_ray/replica_memory.py's terms)."""
        return {n: TensorPart(s.shape, math.prod(s.local_shape), s.dim) for n, s in self.shards.items()}

    def memory(self, members: int = 0) -> list[Line]:
        """What this replica allocates on its device (``replica_lines`` of its own parts and settings; ``members``:
        members whose factors ``member_factors`` stacks at once). The memory plan states a GPU rank's replica with
        the same function, and tests/engines/test_memory_plan_parts.py checks it against the tensors a replica holds."""
        spec = self.spec
        return replica_lines(
            self.parts(),
            optimizer=spec.optimizer,
            anchor_decay=spec.anchor_decay,
            noise=self.noise_kind,
            noise_table_size=spec.noise_table_size,
            perturbation=spec.perturbation,
            rank=spec.rank,
            members=members,
        )

    # -- buffers -------------------------------------------------------------------------------------------
    def _view(self, flat: torch.Tensor, shape: Iterable[int]) -> torch.Tensor:
        shape = tuple(shape)
        return flat[: math.prod(shape)].view(shape)

    def _noise_shape(self, shard: Shard) -> tuple[int, ...]:
        return shard.local_shape if shard.dim in (None, 0) and not self.noise.whole_tensor else shard.shape

    def factors(self, iteration: int, noise_id: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """es.perturbation=lowrank: (B, A) of the whole HF tensor ``name`` (``lowrank.split_factors``), drawn from
        the tensor's seed; views of a fresh draw (or of the noise table)."""
        shape = self.shards[name].shape
        drawn = self.noise.noise(iteration, noise_id, name, lowrank.factor_shape(shape, self.spec.rank))
        return lowrank.split_factors(drawn, shape)

    def _local_factors(self, iteration: int, noise_id: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, A) restricted to this replica's part: a row part takes B's rows, a column part A's rows."""
        b, a = self.factors(iteration, noise_id, name)
        shard = self.shards[name]
        if shard.dim == 0:
            b = b[shard.start : shard.stop]
        elif shard.dim == 1:
            a = a[shard.start : shard.stop]
        return b, a

    def member_factors(
        self, iteration: int, members: list[Member], sigma: float
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """es.perturbation=lowrank, for population batching: per perturbed HF tensor (whole, also on a
        tensor-parallel rank: vLLM's LoRA layers take their own slice), (A, B_s) stacked over ``members`` in order:
        A (M, in, r) and B_s (M, out, r) = sign * sigma / sqrt(r) * B, so member m's layer output is
        x W^T + (x A[m]) B_s[m]^T (``lowrank.lowrank_output``)."""
        if not self.spec.kind.factored:
            raise RuntimeError(
                f"member_factors needs factored noise (es.perturbation=lowrank), not "
                f"es.perturbation={self.spec.perturbation}"
            )
        scale = sigma / math.sqrt(self.spec.rank)
        out = {}
        for name in self.names:
            pairs = [self.factors(iteration, m.noise_id, name) for m in members]
            out[name] = (
                torch.stack([a for _, a in pairs]),
                torch.stack([b * (m.sign * scale) for (b, _), m in zip(pairs, members)]),
            )
        return out

    def _eps(self, iteration: int, noise_id: int, name: str) -> torch.Tensor:
        """The noise of this replica's part of tensor ``name``: the whole tensor's noise, sliced (lowrank: the
        merged B A^T / sqrt(r) of the part)."""
        shard = self.shards[name]
        if self.spec.kind.factored:
            b, a = self._local_factors(iteration, noise_id, name)
            e = self._view(self._nbuf, shard.local_shape)
            return torch.matmul(b, a.T, out=e).div_(math.sqrt(self.spec.rank))
        out = self._view(self._nbuf, self._noise_shape(shard)) if self._nbuf is not None else None
        if shard.dim is None:
            return self.noise.noise(iteration, noise_id, name, shard.shape, out=out)
        if shard.dim == 0 and not self.noise.whole_tensor:  # only these rows are drawn
            return self.noise.noise_slice(
                iteration, noise_id, name, shard.shape, slice(shard.start, shard.stop), out=out
            )
        return shard.take(self.noise.noise(iteration, noise_id, name, shard.shape, out=out))

    def _whole(self, name: str, fill: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(what is written for ``name``, where this replica's part of it goes): for a whole tensor both are the
        same buffer view; for a part, the whole HF-shaped buffer and the part's view in it, the rest left as it is
        (the engine's loader does not read it) or set to ``fill``."""
        shard = self.shards[name]
        whole = self._view(self._buf, shard.shape)
        if fill is not None and shard.dim is not None:
            whole.fill_(fill)
        return whole, shard.take(whole)

    # -- member evaluation ---------------------------------------------------------------------------------
    def _in_place(self, name: str) -> torch.Tensor | None:
        """The engine's own tensor for ``name`` when a write may go straight into it: ``direct`` is set, the replica
        holds the whole tensor and the engine holds it in fp32 (so the one fp32 operation is the same as through
        the buffer, and nothing is cast)."""
        if not self.direct or self.shards[name].dim is not None:
            return None
        held = self.read(name)
        if held is None or held.dtype != torch.float32 or held.shape != self.master[name].shape:
            return None
        return held

    @torch.no_grad()
    def perturbed(self, iteration: int, noise_id: int, sign: int, sigma: float) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (name, master + sign * sigma * eps) through one reused buffer (the whole HF tensor, for a part);
        a tensor the engine takes in place (``direct``) is written there instead, one pass, and not yielded."""
        for name in self.names:
            eps = self._eps(iteration, noise_id, name)
            target = self._in_place(name)
            if target is not None:
                torch.add(self.master[name], eps, alpha=sign * sigma, out=target)
                continue
            whole, part = self._whole(name)
            torch.add(self.master[name], eps, alpha=sign * sigma, out=part)
            yield name, whole

    def perturb(self, iteration: int, noise_id: int, sign: int, sigma: float) -> None:
        self.write(self.perturbed(iteration, noise_id, sign, sigma))

    def restored(self, fill: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (name, master): the master itself for a whole tensor, else the whole HF tensor from the buffer."""
        for name in self.names:
            target = self._in_place(name)
            if target is not None:
                with torch.no_grad():
                    target.copy_(self.master[name])
                continue
            if self.shards[name].dim is None:
                yield name, self.master[name]
                continue
            whole, part = self._whole(name, fill)
            part.copy_(self.master[name])
            yield name, whole

    def restore(self, fill: float | None = None) -> None:
        self.write(self.restored(fill))

    # -- update --------------------------------------------------------------------------------------------
    def update(self, iteration: int, members: list[Member], fitness_n, sigma: float) -> dict[str, float | None]:
        """Apply one ES step to the master in place, then write cast(master) into the engine.

        Returns health scalars, all measured:
        * update_norm: |delta|, the fp32 step the optimizer applied to the master (``Optimizer.step`` leaves it in
          the buffer g; decays included);
        * realised_norm, realised_cos: |r| and cos(r, delta) for r, the change of the weights the engine holds.
          Before a tensor is stepped, its engine tensor is read back (the engine holds the old weights until the
          final write) and r = cast(new master) - held is summed chunk by chunk. After the write every tensor is
          read back again and must equal cast(new master) element for element, else the update raises: so r is
          what the engine holds after minus what it held before, read from the engine, not an assumption about
          the cast. r includes the removal of a perturbation left written (no restore before the update) and
          loses any step below the engine dtype's resolution (r = 0 there, cos 0).
        Where the engine cannot be read back (no ``read``, or it returns None), realised_* are None (absent),
        and so is realised_cos when the intended update is zero (a cosine of nothing). ``sums`` holds the sums
        behind them over the parts this replica owns, which ``update_health`` combines across tensor-parallel ranks.
        """
        weights = gradient_weights(members, fitness_n, sigma)
        noise_ids, w = [k for k, _ in weights], [wk for _, wk in weights]
        self.opt.begin()
        sq_update = dot = sq_real = 0.0
        measured = self.read is not None
        for name in self.names:
            theta = self.master[name]
            g = self._view(self._buf, theta.shape)
            if self.spec.kind.factored:
                lowrank.gradient([self._local_factors(iteration, k, name) for k in noise_ids], w, out=g)
            else:
                gradient((self._eps(iteration, k, name) for k in noise_ids), w, out=g)
            held = self.read(name) if measured else None
            measured = held is not None
            self.opt.step(name, theta, g, self.theta0[name] if self.theta0 is not None else None)
            sums = update_sums(g, theta, held)
            if self.shards[name].owner:
                sq_update += sums[0]
                if measured:
                    dot, sq_real = dot + sums[1], sq_real + sums[2]
        self.restore()
        if measured:
            self._check_engine_holds_master()
        return update_health([(sq_update, dot, sq_real) if measured else (sq_update,)])

    def _check_engine_holds_master(self) -> None:
        """The read-back half of the realised measurement: the engine must hold cast(master) after a write."""
        bad = self._mismatches()
        if bad:
            name, (n, held) = next(iter(bad.items()))
            raise RuntimeError(
                f"after the update the engine does not hold cast(master) for {name}: {n} of {held.numel()} "
                f"elements differ (engine dtype {held.dtype}); its write path lost or altered weights, so the "
                "engine no longer generates from this replica's weights"
            )

    def _mismatches(self) -> dict[str, tuple[int, torch.Tensor]]:
        out = {}
        for name in self.names:
            held = self.read(name)
            bad = mismatches(self.master[name], held)
            if bad:
                out[name] = (bad, held)
        return out

    def engine_mismatches(self) -> dict[str, int] | None:
        """Per tensor where the engine does not hold cast(master), read back: the number of elements that differ
        (empty: it holds exactly the master). None where the engine cannot be read back."""
        if self.read is None or self.read(self.names[0]) is None:
            return None
        return {name: bad for name, (bad, _) in self._mismatches().items()}

    def checksum(self) -> str:
        return combine_checksums([self.checksum_parts()])

    def checksum_parts(self) -> dict[str, tuple[Shard, int]]:
        """(shard, tensor_checksum) of this replica's part of every tensor (``combine_checksums`` joins ranks)."""
        return {name: (self.shards[name], tensor_checksum(t)) for name, t in self.master.items()}

    # -- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Master, optimizer state and theta_0 of the parts this replica owns (every tensor, unsharded), with their
        shards: ``gather_states`` joins the ranks' into whole tensors."""
        owned = [n for n in self.names if self.shards[n].owner]
        return {
            "shards": {n: self.shards[n] for n in owned},
            "master": {n: self.master[n] for n in owned},
            "optimizer": {"t": self.opt.t, "state": {n: st for n, st in self.opt.state.items() if n in owned}},
            "theta0": None if self.theta0 is None else {n: self.theta0[n] for n in owned},
        }

    def _local(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This replica's part of ``t``: ``t`` is either the whole HF tensor or already that part."""
        shard = self.shards[name]
        if tuple(t.shape) == shard.shape:
            return shard.take(t)
        if tuple(t.shape) == shard.local_shape:
            return t
        raise ValueError(
            f"{name}: a state tensor of shape {tuple(t.shape)} is neither the whole tensor "
            f"{shard.shape} nor this replica's part {shard.local_shape}"
        )

    def load_state_dict(self, sd: dict) -> None:
        """Whole tensors (a checkpoint, ``gather_states``) or this replica's own parts; each takes its part."""
        for name in self.names:
            self.master[name].copy_(self._local(name, sd["master"][name]))
        opt = sd["optimizer"]  # each tensor's moments taken, copied and dropped before the next (a lazy checkpoint)
        moments = _Pairs((n, {k: self._local(n, v) for k, v in st.items()}) for n, st in opt["state"].items())
        self.opt.load_state_dict({"t": opt["t"], "state": moments}, device=self.device)
        if self.theta0 is not None and sd.get("theta0") is not None:
            for name in self.names:
                self.theta0[name].copy_(self._local(name, sd["theta0"][name]))
        self.restore()


class _Pairs:
    """``items()`` of (key, value) pairs made as they are taken (``Optimizer.load_state_dict`` iterates them once)."""

    def __init__(self, pairs: Iterable[tuple]):
        self.pairs = pairs

    def items(self) -> Iterable[tuple]:
        return self.pairs


def state_tensors(state: dict) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(key, HF name, tensor) of every tensor of a ``Replica.state_dict`` (or of whole tensors): the keys of an ES
    checkpoint's parts and files (``es_ray.es.state``): ``master/<name>``, ``optimizer/<moment>/<name>``,
    ``theta0/<name>``. Here, not beside vLLM's writer of the parts (``engines.vllm_extension.write_state_part``),
    so that a transformers actor saving a checkpoint does not import vLLM."""
    for name, t in state["master"].items():
        yield f"master/{name}", name, t
    for name, moments in ((state.get("optimizer") or {}).get("state") or {}).items():
        for k, t in moments.items():
            yield f"optimizer/{k}/{name}", name, t
    for name, t in (state.get("theta0") or {}).items():
        yield f"theta0/{name}", name, t


def gather_states(states: Iterable[dict]) -> dict:
    """One replica state of whole tensors from the tensor-parallel ranks' ``Replica.state_dict``s (each part sent
    once, by its owner): what a checkpoint holds, the same at every TP degree."""
    states = list(states)

    def gather(pick: Callable[[dict], Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return gather_shards((st["shards"], pick(st)) for st in states)

    opt_state: dict[str, dict[str, torch.Tensor]] = {}
    for k in sorted({k for st in states for moments in st["optimizer"]["state"].values() for k in moments}):
        for name, t in gather(lambda st: {n: m[k] for n, m in st["optimizer"]["state"].items()}).items():
            opt_state.setdefault(name, {})[k] = t
    return {
        "master": gather(lambda st: st["master"]),
        "optimizer": {"t": states[0]["optimizer"]["t"], "state": opt_state},
        "theta0": None if states[0]["theta0"] is None else gather(lambda st: st["theta0"]),
    }
