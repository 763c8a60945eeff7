"""HF-format checkpoint directories, written atomically, for every method.

A checkpoint directory loads with ``AutoModelForCausalLM.from_pretrained``: config.json, model.safetensors
(fp32 weights by HF name), tokenizer files, plus ``<method>_state.pt`` (optimizer and other run state) and
``<method>_meta.json`` (step or iteration, and what the method adds). Writes go to a temporary sibling and are
renamed into place, so an interrupted write never leaves a directory that looks finished.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Callable, Mapping

import torch

MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


def state_file(method: str) -> str:
    return f"{method}_state.pt"


def meta_file(method: str) -> str:
    return f"{method}_meta.json"


def save_checkpoint(path: str | Path, weights: Mapping[str, torch.Tensor], model_dir: str | Path, state: dict,
                    meta: dict, method: str) -> Path:
    """``weights`` (HF name -> tensor, saved in fp32 over the model directory's own tensors), ``state`` (torch.save'd
    as <method>_state.pt) and ``meta`` (<method>_meta.json) into the directory ``path``. The weights file is
    written one tensor at a time (``write_fp32_safetensors``): the model directory's other tensors are read one by
    one, never all at once, and no tensor of ``weights`` is copied beyond the one being written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    from es_ray.models import read_tensor, safetensors_index

    entries = {name: (tuple(t.shape), lambda t=t: t) for name, t in weights.items()}
    for name, (file, shape) in safetensors_index(model_dir).items():  # untrained tensors keep their source values
        entries.setdefault(name, (shape, functools.partial(read_tensor, file, name)))
    if cfg.get("tie_word_embeddings") and "lm_head.weight" in entries and "model.embed_tokens.weight" in entries:
        del entries["lm_head.weight"]
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
    try:
        write_fp32_safetensors(tmp / "model.safetensors", entries, {"format": "pt"})
        for name in MODEL_FILES:
            if (Path(model_dir) / name).is_file() and name != "config.json":
                shutil.copy2(Path(model_dir) / name, tmp / name)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        torch.save(state, tmp / state_file(method))
        (tmp / meta_file(method)).write_text(json.dumps({**meta, "method": method}, indent=2, default=str))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def write_fp32_safetensors(file: Path, entries: Mapping[str, tuple[tuple[int, ...], Callable[[], torch.Tensor]]],
                           metadata: dict[str, str]) -> None:
    """A safetensors file of fp32 tensors (name -> (shape, reader)), streamed: the format's header holds only names,
    shapes and byte offsets, all known from the shapes, so it is written first and each tensor is then read, cast
    and appended on its own (safetensors' own ``save_file`` takes every tensor at once, in a dict)."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name in sorted(entries):
        nbytes = 4 * math.prod(entries[name][0])
        header[name] = {"dtype": "F32", "shape": list(entries[name][0]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in sorted(entries):
            shape, read = entries[name]
            t = read().detach().to("cpu", torch.float32).contiguous()
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: tensor of shape {tuple(t.shape)}, declared {shape}")
            f.write(t.view(-1).numpy().data)
            del t
