"""ES run state: the append-only seed/reward log, ES checkpoints (``es_ray.runtime.checkpoint`` directories with
``es_state.pt``: the optimizer's step count; ``es_state.tensors``: the optimizer's moments and theta_0, fp32
whole tensors keyed ``optimizer/<moment>/<HF name>`` and ``theta0/<HF name>``; ``es_meta.json``: iteration and
checksum) and loading them back, verified against their digests and read tensor by tensor.

Saving never holds the state whole: every tensor of the export (model.safetensors) and of es_state.tensors is
assembled on its own from the parts that hold it (``save_es_checkpoint_parts``: the files each tensor-parallel
rank wrote, one tensor at a time, ``VLLMReplicaHost.save_parts``; ``save_es_checkpoint``: a state in this
process) and written before the next is read. Loading returns mappings that read one tensor, or one rank's part
of it, when asked (``FileTensors``), and pickle as their file names, so a tensor-parallel rank
they are sent to reads its own part from the checkpoint. Checkpoints whose es_state.pt holds the tensors (written
before es_state.tensors) load as before."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from es_ray.es.protocol import SeedRecord, UpdateRequest
from es_ray.models import read_tensor, safetensors_index
from es_ray.runtime.checkpoint import (
    MANIFEST,
    checkpoints_by_step,
    load_state,
    meta_file,
    save_checkpoint,
    staging_dir,
    state_file,
    verify_dir,
    write_fp32_safetensors,
)

if TYPE_CHECKING:  # torch is imported where tensors are read: the driver's seed log and checkpoint list need none
    import torch

# torch, safetensors and the replica are imported where a checkpoint is written or read: the driver reads the seed log
# and plans a resume without torch (tests/repo/test_layers.py).

DIGEST_KEY = "sha256"
STATE_TENSORS = "es_state.tensors"
"""The checkpoint file of the optimizer's moments and theta_0: safetensors format (fp32, whole tensors, streamed in
and out), named so that no loader globbing ``*.safetensors`` for the model's weights (vLLM, ``LazyTensors``) takes
it."""


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
                raise ValueError(
                    f"{path}: line {number} is corrupted ({'its digest differs' if row else 'not JSON'}); "
                    f"only a torn last line is cut. Restore the file, or keep lines 1-{number - 1} "
                    f"(head -n {number - 1}) to resume from iteration {len(rows)}"
                )
            digested.add(want is not None)
            if len(digested) > 1:
                raise ValueError(
                    f"{path}: line {number} {'has' if want else 'lacks'} the digest other lines "
                    f"{'lack' if want else 'have'}; the log was edited"
                )
            if row.get("iteration") != len(rows):
                raise ValueError(
                    f"{path}: record {len(rows)} (line {number}) is for iteration "
                    f"{row.get('iteration')}; the seed log must hold iterations 0, 1, 2, ... in order"
                )
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


def replay_request(record: dict) -> UpdateRequest:
    """The update a seed-log row applied, as the driver sent it (``SeedRecord.update_request``)."""
    return SeedRecord.from_json(record).update_request()


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path, dict]]:
    """(iteration, path, meta) of every published ES checkpoint under run_dir/checkpoints, oldest first (what a
    killed save left behind is cleaned up first; each meta's digest is checked)."""
    return checkpoints_by_step(Path(run_dir, "checkpoints"), "es", "iteration")


class FileTensors(Mapping):
    """name -> fp32 CPU tensor read from a safetensors-format file when asked for and not kept: a consumer that
    takes one tensor at a time holds one. ``index``: name -> (file, key in it, shape). ``sliced`` makes the copy a
    tensor-parallel rank uses, which reads only its own part of each tensor (``safe_open`` ``get_slice``). Pickles
    as its index (file names and shapes), so a process it is sent to reads the tensors itself."""

    on_disk = True
    """Read from files when asked, and sent as their names (``VLLMReplicaHost.load_state_dict``)."""

    def __init__(self, index: dict[str, tuple[str, str, tuple[int, ...]]]):
        self.index = index
        self.parts: dict[str, tuple[slice, ...]] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        import torch

        file, key, _ = self.index[name]
        return read_tensor(file, key, self.parts.get(name)).to(torch.float32)

    def __iter__(self):
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)

    def sliced(self, parts: Mapping) -> FileTensors:
        """The same tensors where ``parts`` (name -> ``es_ray.replica.Shard``) names a part: only that part is read."""
        out = FileTensors(self.index)
        out.parts = {n: s.index for n, s in parts.items() if n in self.index and s.dim is not None}
        return out

    def nbytes(self) -> int:
        """fp32 bytes of the distinct tensors (one stored tensor read under two names counted once)."""
        return sum(4 * math.prod(shape) for shape in {(f, k): s for f, k, s in self.index.values()}.values())


class LazyTensors(FileTensors):
    """HF name -> fp32 CPU tensor of a directory's safetensors files (``FileTensors``). A tied LM head (stored once)
    reads the embedding."""

    def __init__(self, model_dir: str | Path):
        index = {name: (file, name, shape) for name, (file, shape) in safetensors_index(model_dir).items()}
        if "lm_head.weight" not in index and "model.embed_tokens.weight" in index:
            index["lm_head.weight"] = index["model.embed_tokens.weight"]
        super().__init__(index)


def state_tensors_file(file: str | Path, prefix: str) -> FileTensors:
    """The tensors of ``STATE_TENSORS`` whose keys start with ``prefix``, by the rest of the key (``FileTensors``)."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as sf:
        return FileTensors(
            {
                key[len(prefix) :]: (str(file), key, tuple(sf.get_slice(key).get_shape()))
                for key in sf.keys()
                if key.startswith(prefix)
            }
        )


class MomentTensors(Mapping):
    """HF name -> {moment: fp32 tensor} of the optimizer state in ``STATE_TENSORS`` (keys
    ``optimizer/<moment>/<name>``), each read when asked for (``FileTensors``, ``sliced`` included)."""

    on_disk = True

    def __init__(self, tensors: FileTensors):
        self.tensors = tensors
        self.moments: dict[str, list[str]] = {}
        for key in tensors:
            moment, _, name = key.partition("/")
            self.moments.setdefault(name, []).append(moment)

    def __getitem__(self, name: str) -> dict[str, torch.Tensor]:
        return {k: self.tensors[f"{k}/{name}"] for k in self.moments[name]}

    def __iter__(self):
        return iter(self.moments)

    def __len__(self) -> int:
        return len(self.moments)

    def sliced(self, parts: Mapping) -> MomentTensors:
        return MomentTensors(
            self.tensors.sliced({f"{k}/{n}": s for n, s in parts.items() for k in self.moments.get(n, ())})
        )


def load_es_state(path: str | Path) -> dict:
    """A replica state dict from a checkpoint directory (its files checked against their digests first) or from
    the initial model directory (no optimizer state).

    The master is a ``LazyTensors`` (every tensor of the directory, read in fp32 one at a time as the replica takes
    it), the optimizer's moments and theta_0 are read the same way from es_state.tensors (``MomentTensors``,
    ``FileTensors``; in a checkpoint written before es_state.tensors, es_state.pt is memory-mapped, ``load_state``):
    nothing is read whole up front.
    """
    path = Path(path)
    extra = {"optimizer": {"t": 0, "state": {}}, "theta0": None}
    if any((path / f).is_file() for f in (MANIFEST, meta_file("es"), state_file("es"))):  # a checkpoint
        verify_dir(path)
        extra = load_state(path, "es")
        if extra.get("tensors"):
            file = path / extra["tensors"]
            theta0 = state_tensors_file(file, "theta0/")
            extra = {
                "optimizer": {
                    "t": extra["optimizer"]["t"],
                    "state": MomentTensors(state_tensors_file(file, "optimizer/")),
                },
                "theta0": theta0 if len(theta0) else None,
            }
    return {"master": LazyTensors(path), "optimizer": extra["optimizer"], "theta0": extra.get("theta0")}


class _Assembled:
    """One whole tensor of a checkpoint being written, read only when the writer takes it (``detach``)."""

    def __init__(self, shape: tuple[int, ...], read: Callable[[], torch.Tensor]):
        self.shape, self.read = shape, read

    def detach(self) -> torch.Tensor:
        return self.read()


def state_parts(state: dict) -> dict:
    """A replica state in this process (``Replica.state_dict``: its parts with their shards; or whole tensors, e.g.
    ``gather_states``) as one part of ``save_es_checkpoint_parts``: {"t", "tensors": key -> (shard, reader)}, keys
    as ``state_tensors``. Nothing is copied."""
    from es_ray.replica import Shard, state_tensors

    shards = state.get("shards") or {}
    tensors = {key: (shards.get(name) or Shard(tuple(t.shape)), lambda t=t: t) for key, name, t in state_tensors(state)}
    return {"t": int((state.get("optimizer") or {}).get("t", 0)), "tensors": tensors}


def file_parts(part: dict) -> dict:
    """A part written to files (``write_state_part``: {"t", "tensors": key -> (file, shard)}) with readers."""
    return {
        "t": int(part["t"]),
        "tensors": {
            key: (shard, functools.partial(read_tensor, file, key)) for key, (file, shard) in part["tensors"].items()
        },
    }


def save_es_checkpoint_parts(
    path: str | Path, write_parts: Callable[[str], list[dict]], model_dir: str | Path, meta: dict
) -> Path:
    """An ES checkpoint from the parts each tensor-parallel rank writes: ``write_parts(directory)`` has every rank
    write its part there (``es_ray.engines.vllm_extension.write_state_part``) and returns them; each whole tensor
    is then assembled from its parts and written (model.safetensors by HF name, the optimizer's moments and theta_0
    into es_state.tensors) before the next is read, so the writer holds one tensor and its parts, never the state.
    The parts are deleted."""
    tmp = staging_dir(path)
    try:
        parts = [file_parts(p) for p in write_parts(str(tmp))]
        return _save_parts(path, parts, model_dir, meta)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_es_checkpoint(path: str | Path, state: dict, model_dir: str | Path, meta: dict) -> Path:
    """A replica state in this process (master, optimizer, theta0; whole tensors or one replica's parts with their
    shards) as an HF checkpoint directory with es_state.pt / es_state.tensors / es_meta.json, tensor by tensor
    (``save_es_checkpoint_parts``)."""
    return _save_parts(path, [state_parts(state)], model_dir, meta)


def _save_parts(path: str | Path, parts: list[dict], model_dir: str | Path, meta: dict) -> Path:
    from es_ray.replica import gather_shards

    steps = {p["t"] for p in parts}
    if len(steps) != 1:
        raise RuntimeError(f"the tensor-parallel ranks' optimizers are at different steps {sorted(steps)}")
    tiles: dict[str, list] = {}
    for p in parts:
        for key, (shard, read) in p["tensors"].items():
            tiles.setdefault(key, []).append((shard, read))

    def whole(key: str) -> torch.Tensor:  # the ranks' parts of one tensor, joined (each read now, dropped after)
        return gather_shards(({key: shard}, {key: read()}) for shard, read in tiles[key])[key]

    entries = {key: (tiles[key][0][0].shape, functools.partial(whole, key)) for key in tiles}
    weights = {key[len("master/") :]: _Assembled(*entries[key]) for key in entries if key.startswith("master/")}
    rest = {key: entry for key, entry in entries.items() if not key.startswith("master/")}

    def write_state(tmp: Path) -> None:
        write_fp32_safetensors(tmp / STATE_TENSORS, rest, {"format": "pt"})

    state = {"optimizer": {"t": steps.pop(), "state": {}}, "theta0": None, "tensors": STATE_TENSORS if rest else ""}
    return save_checkpoint(path, weights, model_dir, state, meta, "es", write_state if rest else None)
