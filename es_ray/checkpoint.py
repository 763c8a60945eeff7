"""HF-format checkpoints plus run state, and the append-only seed/reward log.

A checkpoint directory loads with ``AutoModelForCausalLM.from_pretrained``: config.json, model.safetensors
(fp32 master weights by HF name), tokenizer files, plus ``es_state.pt`` (optimizer state) and ``es_meta.json``
(iteration and config). Writes go to a temporary sibling and are renamed into place, so an interrupted write
never leaves a directory that looks finished.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

_MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


def save_checkpoint(path: str | Path, state: dict, model_dir: str | Path, meta: dict) -> Path:
    from safetensors.torch import save_file

    from es_ray.models import load_hf_weights

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    weights = load_hf_weights(model_dir)  # untrained tensors keep their source values
    for name, t in state["master"].items():
        weights[name] = t.detach().to("cpu", torch.float32)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if cfg.get("tie_word_embeddings") and "lm_head.weight" in weights and "model.embed_tokens.weight" in weights:
        del weights["lm_head.weight"]
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
    try:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        for name in _MODEL_FILES:
            if (Path(model_dir) / name).is_file() and name != "config.json":
                shutil.copy2(Path(model_dir) / name, tmp / name)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        torch.save({"optimizer": state.get("optimizer"), "theta0": state.get("theta0")}, tmp / "es_state.pt")
        (tmp / "es_meta.json").write_text(json.dumps(meta, indent=2, default=str))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


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
