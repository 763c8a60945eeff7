"""One ES replica: the fp32 master weights, the noise source and the optimizer, beside an engine.

The replica lives wherever the engine's weights live (in the Ray actor for the transformers engine, inside
vLLM's worker for the vLLM engine) and talks to the engine through one callable, ``write(named)``, which
copies an iterable of (HF name, fp32 tensor) pairs into the engine, casting to the engine's dtype. ``write``
must consume each tensor before asking for the next: the replica reuses one buffer.

Exactness (DESIGN "ES, precisely"):
* a member is written as cast(master + sign * sigma * eps); restoring writes cast(master); nothing is ever
  subtracted in the engine's dtype;
* the update is applied to the fp32 master in a fixed order (sorted tensor names, noise ids ascending), so
  replicas on the same hardware stay equal bit for bit, which ``checksum`` lets the driver verify;
* the update regenerates the noises one tensor at a time into one flat fp32 buffer (plus one noise buffer).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from es_ray.noise import NoiseSource
from es_ray.strategy import Member, Optimizer, noise_coefficients

Writer = Callable[[Iterable[tuple[str, torch.Tensor]]], None]


@dataclass(frozen=True)
class ReplicaSpec:
    """Plain scalars only, so it crosses into vLLM's worker through collective_rpc unchanged."""

    run_seed: int
    noise: str = "per_tensor"
    noise_table_size: int = 1 << 25
    trainable: str = ""
    optimizer: str = "sgd"
    lr: float = 5e-7
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    anchor_decay: float = 0.0
    engine_dtype: str = "bfloat16"


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


def _dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(name, torch.float32)


class Replica:
    def __init__(self, named: Iterable[tuple[str, torch.Tensor]], spec: ReplicaSpec, write: Writer,
                 device: str | torch.device = "cpu"):
        pattern = re.compile(spec.trainable) if spec.trainable else None
        self.spec = spec
        self.write = write
        self.device = torch.device(device)
        self.master: dict[str, torch.Tensor] = {}
        for name, t in named:
            if pattern is None or pattern.search(name):
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
        self.engine_dtype = _dtype(spec.engine_dtype)

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
    def update(self, iteration: int, members: list[Member], fitness_n, sigma: float) -> dict[str, float]:
        """Apply one ES step to the master in place, then write cast(master) into the engine.

        Returns health scalars: the fp32 update norm and the cosine between the update the engine's weights
        realised (after casting to the engine dtype) and the intended fp32 update.
        """
        coeffs = noise_coefficients(members, fitness_n)
        scale = 1.0 / (len(members) * sigma)
        self.opt.begin()
        sq_update = dot = sq_real = 0.0
        cast = self.engine_dtype
        for name in self.names:
            theta = self.master[name]
            g = self._view(self._buf, theta)
            for k, (noise_id, c) in enumerate(coeffs):
                eps = self._eps(iteration, noise_id, name)
                if k == 0:  # the first term initialises g: one pass less than zero_() then add_()
                    torch.mul(eps, c * scale, out=g)
                else:
                    g.add_(eps, alpha=c * scale)
            before = theta.to(cast) if cast != torch.float32 else None
            self.opt.step(name, theta, g, self.theta0[name] if self.theta0 is not None else None)
            flat = g.view(-1)
            sq_update += float(torch.dot(flat, flat))
            if before is not None:
                realised = (theta.to(cast).float() - before.float()).view(-1)
                dot += float(torch.dot(realised, flat))
                sq_real += float(torch.dot(realised, realised))
        self.restore()
        if cast == torch.float32:  # the engine holds exactly the fp32 master: realised == intended
            sq_real = sq_update
            cos = 1.0 if sq_update > 0 else 0.0
        else:
            cos = dot / (sq_update**0.5 * sq_real**0.5) if sq_update > 0 and sq_real > 0 else 0.0
        return {"update_norm": sq_update**0.5, "realised_cos": cos, "realised_norm": sq_real**0.5}

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
