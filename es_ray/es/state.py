"""ES run state: the append-only seed/reward log, ES checkpoints (``es_ray.runtime.checkpoint`` directories with
``es_state.pt``: optimizer state and theta_0; ``es_meta.json``: iteration and checksum) and loading them back,
verified against their digests and read tensor by tensor."""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch

DIGEST_KEY = "sha256"


def _record_digest(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


class SeedLog:
    """seed_log.jsonl: per iteration the members, the raw rewards and the shaped fitness; fsynced each line.

    With the initial weights and the config it determines the run: replaying its updates in order rebuilds the
    weights of any iteration. Each line carries the sha256 of its record (``"sha256"``, over the record's JSON with
    sorted keys), so a changed digit is caught, not only broken JSON.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._f = open(self.path, "a", buffering=1)

    def append(self, record: dict) -> None:
        self._f.write(json.dumps({**record, DIGEST_KEY: _record_digest(record)}) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    @staticmethod
    def parse(path: str | Path) -> tuple[list[dict], int]:
        """The records of a log and the byte length of its complete lines. A last line without its newline is a
        write a crash cut short (left out); any complete line that is not valid JSON, whose digest differs, or
        that numbers its iteration out of order is refused with its line number (ValueError)."""
        path = Path(path)
        data = path.read_bytes() if path.is_file() else b""
        *lines, tail = data.split(b"\n")
        rows, digested = [], set()
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                want = row.pop(DIGEST_KEY, None) if isinstance(row, dict) else None
            except ValueError:
                row = want = None
            if not isinstance(row, dict) or (want is not None and want != _record_digest(row)):
                raise ValueError(f"{path}: line {number} is corrupted ({'its digest differs' if row else 'not JSON'}); "
                                 f"only a torn last line is cut. Restore the file, or keep lines 1-{number - 1} "
                                 f"(head -n {number - 1}) to resume from iteration {len(rows)}")
            digested.add(want is not None)
            if len(digested) > 1:
                raise ValueError(f"{path}: line {number} {'has' if want else 'lacks'} the digest other lines "
                                 f"{'lack' if want else 'have'}; the log was edited")
            if row.get("iteration") != len(rows):
                raise ValueError(f"{path}: record {len(rows)} (line {number}) is for iteration "
                                 f"{row.get('iteration')}; the seed log must hold iterations 0, 1, 2, ... in order")
            rows.append(row)
        return rows, len(data) - len(tail)

    @staticmethod
    def read(path: str | Path) -> list[dict]:
        """The complete records (``parse``), verified."""
        return SeedLog.parse(path)[0]

    @staticmethod
    def recover(path: str | Path) -> list[dict]:
        """The complete records of a log a crash may have cut mid-line; the torn tail is cut off the file."""
        path = Path(path)
        if not path.is_file():
            return []
        rows, good = SeedLog.parse(path)
        if good < path.stat().st_size:
            with open(path, "r+b") as f:
                f.truncate(good)
        return rows


def replay_record(record: dict) -> dict:
    """What replaying one seed-log record needs (the shaped fitness as logged: JSON floats round-trip exactly)."""
    return {k: record[k] for k in ("iteration", "sigma", "members", "fitness")}


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path, dict]]:
    """(iteration, path, meta) of every published ES checkpoint under run_dir/checkpoints, oldest first (what a
    killed save left behind is cleaned up first; each meta's digest is checked)."""
    from es_ray.runtime.checkpoint import checkpoint_dirs, meta_file, read_meta

    out = []
    for path in checkpoint_dirs(Path(run_dir, "checkpoints")):
        if (path / meta_file("es")).is_file():
            meta = read_meta(path, "es")
            out.append((int(meta["iteration"]), path, meta))
    return sorted(out, key=lambda x: (x[0], x[1].name))


class LazyTensors(Mapping):
    """HF name -> fp32 CPU tensor of a directory's safetensors files, each read from disk when asked for and not
    kept: a consumer that takes one tensor at a time holds one. Pickles as the file index, so a process it is
    sent to (a tensor-parallel worker) reads the tensors itself. A tied LM head (stored once) reads the embedding."""

    def __init__(self, model_dir: str | Path):
        from es_ray.models import safetensors_index

        self.index = safetensors_index(model_dir)
        if "lm_head.weight" not in self.index and "model.embed_tokens.weight" in self.index:
            self.index["lm_head.weight"] = self.index["model.embed_tokens.weight"]
            self.alias = {"lm_head.weight": "model.embed_tokens.weight"}
        else:
            self.alias = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        from es_ray.models import read_tensor

        file, _ = self.index[name]
        return read_tensor(file, self.alias.get(name, name)).to(torch.float32)

    def __iter__(self):
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)

    def nbytes(self) -> int:
        """fp32 bytes of the distinct tensors (a tied head counted once)."""
        return sum(4 * math.prod(shape) for name, (_, shape) in self.index.items() if name not in self.alias)


def load_es_state(path: str | Path) -> dict:
    """A replica state dict from a checkpoint directory (its files checked against their digests first) or from
    the initial model directory (no optimizer state).

    The master is a ``LazyTensors`` (every tensor of the directory, read in fp32 one at a time as the replica takes
    it); the optimizer state and theta_0 are memory-mapped (``load_state``): nothing is read whole up front.
    """
    from es_ray.runtime.checkpoint import MANIFEST, load_state, meta_file, state_file, verify_dir

    path = Path(path)
    extra = {"optimizer": {"t": 0, "state": {}}, "theta0": None}
    if any((path / f).is_file() for f in (MANIFEST, meta_file("es"), state_file("es"))):  # a checkpoint
        verify_dir(path)
        extra = load_state(path, "es")
    return {"master": LazyTensors(path), "optimizer": extra["optimizer"], "theta0": extra.get("theta0")}


def save_es_checkpoint(path: str | Path, state: dict, model_dir: str | Path, meta: dict) -> Path:
    """A replica state (master, optimizer, theta0) as an HF checkpoint directory with es_state.pt / es_meta.json."""
    from es_ray.runtime.checkpoint import save_checkpoint

    return save_checkpoint(path, state["master"], model_dir,
                           {"optimizer": state.get("optimizer"), "theta0": state.get("theta0")}, meta, "es")
