"""One ES replica: the fp32 master weights, the noise source and the optimizer, beside an engine.

The replica lives wherever the engine's weights live (in the Ray actor for the transformers engine, inside
vLLM's worker for the vLLM engine) and talks to the engine through two callables: ``write(named)`` copies an
iterable of (HF name, fp32 tensor) pairs into the engine, casting to the engine's dtype, and must consume each
tensor before asking for the next (the replica reuses one buffer); ``read(name)`` returns the tensor the engine
holds for one HF name, in the engine's own dtype and HF shape (a view where the layout allows), or None where
the engine cannot give it back (vLLM with tensor parallelism).

Exactness (DESIGN "ES, precisely"):
* a member is written as cast(master + sign * sigma * eps); restoring writes cast(master); nothing is ever
  subtracted in the engine's dtype;
* the update is applied to the fp32 master in a fixed order (sorted tensor names, noise ids ascending), so
  replicas on the same hardware stay equal bit for bit, which ``checksum`` lets the driver verify;
* the update regenerates the noises one tensor at a time into one flat fp32 buffer (plus one noise buffer), and
  measures what the engine realised in chunks of ``CHUNK`` elements (no whole-tensor temporaries).
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch

from es_ray.noise import NoiseSource
from es_ray.strategy import Member, Optimizer, noise_coefficients

if TYPE_CHECKING:
    from es_ray.config import ESTrainConfig

Writer = Callable[[Iterable[tuple[str, torch.Tensor]]], None]
Reader = Callable[[str], "torch.Tensor | None"]

CHUNK = 1 << 20
"""Elements per chunk when the update is measured against the engine: the temporaries are a few fp32/fp64 tensors
of this size, never a copy of a whole tensor (a 7B model's embedding alone is 545M elements)."""


def _from(key: str):
    """A ReplicaSpec field set from the config key ``key`` (a dotted path into ESTrainConfig)."""
    return field(metadata={"config": key})


@dataclass(frozen=True)
class ReplicaSpec:
    """Every setting the replica needs, as plain scalars: this object itself crosses into vLLM's worker through
    collective_rpc. Each field names its config key, and ``from_config`` is the one place a spec is built, so a
    new field cannot be forgotten on the way (there are no defaults to fall back on)."""

    run_seed: int = _from("run.seed")
    noise: str = _from("es.noise")
    noise_table_size: int = _from("es.noise_table_size")
    trainable: str = _from("model.trainable")
    optimizer: str = _from("es.optimizer")
    lr: float = _from("es.lr")
    adam_beta1: float = _from("es.adam_beta1")
    adam_beta2: float = _from("es.adam_beta2")
    adam_eps: float = _from("es.adam_eps")
    weight_decay: float = _from("es.weight_decay")
    anchor_decay: float = _from("es.anchor_decay")

    @classmethod
    def from_config(cls, cfg: ESTrainConfig) -> ReplicaSpec:
        return cls(**{f.name: functools.reduce(getattr, f.metadata["config"].split("."), cfg) for f in fields(cls)})

    def selects(self, name: str) -> bool:
        """Whether the tensor ``name`` is trainable (model.trainable is a regex; empty selects all)."""
        return not self.trainable or re.search(self.trainable, name) is not None


def tensor_checksum(t: torch.Tensor) -> int:
    """Sum of the tensor's bit patterns as wrapping int64: any single changed bit changes it, order-free."""
    flat = t.detach().contiguous().view(-1)
    ints = flat.view(torch.int32) if flat.element_size() == 4 else flat.view(torch.int16)
    return int(ints.sum(dtype=torch.int64).item())


def checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for name, t in sorted(named, key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(str(tensor_checksum(t)).encode())
    return h.hexdigest()


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


class Replica:
    def __init__(self, named: Iterable[tuple[str, torch.Tensor]], spec: ReplicaSpec, write: Writer,
                 read: Reader | None = None, device: str | torch.device = "cpu"):
        self.spec = spec
        self.write = write
        self.read = read
        self.device = torch.device(device)
        self.master: dict[str, torch.Tensor] = {}
        for name, t in named:
            if spec.selects(name):
                self.master[name] = t.detach().to(device=self.device, dtype=torch.float32, copy=True)
        if not self.master:
            raise ValueError(f"model.trainable={spec.trainable!r} matches no parameter; fix the regex")
        self.names = sorted(self.master)
        self.theta0 = {k: v.clone() for k, v in self.master.items()} if spec.anchor_decay else None
        kind = spec.noise if spec.noise != "auto" else ("per_tensor" if self.device.type == "cuda" else "table")
        self.noise = NoiseSource(spec.run_seed, kind, spec.noise_table_size, device=self.device)
        self.opt = Optimizer(spec.optimizer, spec.lr, (spec.adam_beta1, spec.adam_beta2), spec.adam_eps,
                             spec.weight_decay, spec.anchor_decay)
        largest = max(t.numel() for t in self.master.values())
        self._buf = torch.empty(largest, dtype=torch.float32, device=self.device)
        self._nbuf = torch.empty(largest, dtype=torch.float32, device=self.device) if kind != "table" else None

    @classmethod
    def from_checkpoint(cls, model_dir: str, names: Iterable[str], spec: ReplicaSpec, write: Writer,
                        read: Reader | None = None, device: str | torch.device = "cpu") -> Replica:
        """The master from the checkpoint's fp32 tensors (never from the engine's cast weights), then written into
        the engine, so that it holds cast(master) from the start."""
        from es_ray.models import load_hf_weights

        names = [n for n in names if spec.selects(n)]
        source = load_hf_weights(model_dir, names)
        missing = [n for n in names if n not in source]
        if missing:
            raise ValueError(f"{model_dir}: no tensor for HF parameters {missing[:5]} (of {len(missing)})")
        replica = cls(((n, source.pop(n)) for n in names), spec, write, read, device)
        replica.restore()
        return replica

    # -- buffers -------------------------------------------------------------------------------------------
    def _view(self, flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return flat[: like.numel()].view(like.shape)

    def _eps(self, iteration: int, noise_id: int, name: str) -> torch.Tensor:
        theta = self.master[name]
        out = self._view(self._nbuf, theta) if self._nbuf is not None else None
        return self.noise.noise(iteration, noise_id, name, theta.shape, out=out)

    # -- member evaluation ---------------------------------------------------------------------------------
    def perturbed(self, iteration: int, noise_id: int, sign: int, sigma: float) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (name, master + sign * sigma * eps) through one reused buffer."""
        for name in self.names:
            eps = self._eps(iteration, noise_id, name)
            yield name, torch.add(self.master[name], eps, alpha=sign * sigma, out=self._view(self._buf, eps))

    def perturb(self, iteration: int, noise_id: int, sign: int, sigma: float) -> None:
        self.write(self.perturbed(iteration, noise_id, sign, sigma))

    def restore(self) -> None:
        self.write((name, self.master[name]) for name in self.names)

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
        and so is realised_cos when the intended update is zero (a cosine of nothing).
        """
        coeffs = noise_coefficients(members, fitness_n)
        scale = 1.0 / (len(members) * sigma)
        self.opt.begin()
        sq_update = dot = sq_real = 0.0
        measured = self.read is not None
        for name in self.names:
            theta = self.master[name]
            g = self._view(self._buf, theta)
            for k, (noise_id, c) in enumerate(coeffs):
                eps = self._eps(iteration, noise_id, name)
                if k == 0:  # the first term initialises g: one pass less than zero_() then add_()
                    torch.mul(eps, c * scale, out=g)
                else:
                    g.add_(eps, alpha=c * scale)
            held = self.read(name) if measured else None
            measured = held is not None
            self.opt.step(name, theta, g, self.theta0[name] if self.theta0 is not None else None)
            sums = update_sums(g, theta, held)
            sq_update += sums[0]
            if measured:
                dot, sq_real = dot + sums[1], sq_real + sums[2]
        self.restore()
        if not measured:
            return {"update_norm": sq_update**0.5, "realised_cos": None, "realised_norm": None}
        self._check_engine_holds_master()
        if sq_update == 0.0:
            cos = None
        else:  # clamped: the fp32 dot products can put an exact alignment a few 1e-10 above 1
            cos = max(-1.0, min(1.0, dot / (sq_update**0.5 * sq_real**0.5))) if sq_real > 0 else 0.0
        return {"update_norm": sq_update**0.5, "realised_cos": cos, "realised_norm": sq_real**0.5}

    def _check_engine_holds_master(self) -> None:
        """The read-back half of the realised measurement: the engine must hold cast(master) after a write."""
        for name in self.names:
            held = self.read(name)
            bad = mismatches(self.master[name], held)
            if bad:
                raise RuntimeError(
                    f"after the update the engine does not hold cast(master) for {name}: {bad} of {held.numel()} "
                    f"elements differ (engine dtype {held.dtype}); its write path lost or altered weights, so the "
                    "engine no longer generates from this replica's weights")

    def checksum(self) -> str:
        return checksum(self.master.items())

    # -- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"master": self.master, "optimizer": self.opt.state_dict(), "theta0": self.theta0}

    def load_state_dict(self, sd: dict) -> None:
        for name in self.names:
            self.master[name].copy_(sd["master"][name])
        self.opt.load_state_dict(sd["optimizer"], device=self.device)
        if self.theta0 is not None and sd.get("theta0") is not None:
            for name in self.names:
                self.theta0[name].copy_(sd["theta0"][name])
        self.restore()
