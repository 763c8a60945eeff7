"""ES run state: the append-only seed/reward log, ES checkpoints (``es_ray.runtime.checkpoint`` directories with
``es_state.pt``: optimizer state and theta_0; ``es_meta.json``: iteration and checksum) and loading them back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

class SeedLog:
    """seed_log.jsonl: per iteration the members, the raw rewards and the shaped fitness; fsynced each line.

    With the initial weights and the config it determines the run: replaying its updates in order rebuilds the
    weights of any iteration.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._f = open(self.path, "a", buffering=1)

    def append(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    @staticmethod
    def read(path: str | Path) -> list[dict]:
        rows = []
        for line in Path(path).read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
        return rows

    @staticmethod
    def recover(path: str | Path) -> list[dict]:
        """The complete records of a log a crash may have cut mid-line; the torn tail is cut off the file.

        Records must number the iterations 0, 1, 2, ... in order; a gap means the log is not this run's.
        """
        path = Path(path)
        if not path.is_file():
            return []
        rows, good = [], 0
        data = path.read_bytes()
        for line in data.splitlines(keepends=True):
            try:
                row = json.loads(line) if line.endswith(b"\n") else None
            except ValueError:
                row = None
            if row is None:
                break
            if row.get("iteration") != len(rows):
                raise ValueError(f"{path}: record {len(rows)} is for iteration {row.get('iteration')}; the seed log "
                                 "must hold iterations 0, 1, 2, ... in order")
            rows.append(row)
            good += len(line)
        if good < len(data):
            with open(path, "r+b") as f:
                f.truncate(good)
        return rows


def replay_record(record: dict) -> dict:
    """What replaying one seed-log record needs (the shaped fitness as logged: JSON floats round-trip exactly)."""
    return {k: record[k] for k in ("iteration", "sigma", "members", "fitness")}


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path, dict]]:
    """(iteration, path, meta) of every finished checkpoint under run_dir/checkpoints, oldest first."""
    out = []
    for meta_file in Path(run_dir, "checkpoints").glob("*/es_meta.json"):
        meta = json.loads(meta_file.read_text())
        out.append((int(meta["iteration"]), meta_file.parent, meta))
    return sorted(out, key=lambda x: (x[0], x[1].name))


def load_es_state(path: str | Path) -> dict:
    """A replica state dict from a checkpoint directory, or from the initial model directory (no optimizer state).

    The master holds every tensor of the directory in fp32; the replica takes the names it trains. A tied LM
    head, which checkpoints store once, is aliased to the input embedding.
    """
    from es_ray.models import load_hf_weights

    path = Path(path)
    master = load_hf_weights(path)
    if "lm_head.weight" not in master and "model.embed_tokens.weight" in master:
        master["lm_head.weight"] = master["model.embed_tokens.weight"]
    extra = {"optimizer": {"t": 0, "state": {}}, "theta0": None}
    if (path / "es_state.pt").is_file():
        extra = torch.load(path / "es_state.pt", map_location="cpu", weights_only=True)
    return {"master": master, "optimizer": extra["optimizer"], "theta0": extra.get("theta0")}


def save_es_checkpoint(path: str | Path, state: dict, model_dir: str | Path, meta: dict) -> Path:
    """A replica state (master, optimizer, theta0) as an HF checkpoint directory with es_state.pt / es_meta.json."""
    from es_ray.runtime.checkpoint import save_checkpoint

    return save_checkpoint(path, state["master"], model_dir,
                           {"optimizer": state.get("optimizer"), "theta0": state.get("theta0")}, meta, "es")
