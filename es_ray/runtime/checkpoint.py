"""HF-format checkpoint directories, written atomically, for every method.

A checkpoint directory loads with ``AutoModelForCausalLM.from_pretrained``: config.json, model.safetensors
(fp32 weights by HF name), tokenizer files, plus ``<method>_state.pt`` (optimizer and other run state) and
``<method>_meta.json`` (step or iteration, and what the method adds). Writes go to a temporary sibling and are
renamed into place, so an interrupted write never leaves a directory that looks finished.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


def state_file(method: str) -> str:
    return f"{method}_state.pt"


def meta_file(method: str) -> str:
    return f"{method}_meta.json"


def save_checkpoint(path: str | Path, weights: dict, model_dir: str | Path, state: dict, meta: dict,
                    method: str) -> Path:
    """``weights`` (HF name -> tensor, saved in fp32 over the model directory's own tensors), ``state`` (torch.save'd
    as <method>_state.pt) and ``meta`` (<method>_meta.json) into the directory ``path``."""
    from safetensors.torch import save_file

    from es_ray.models import load_hf_weights

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = load_hf_weights(model_dir)  # untrained tensors keep their source values
    for name, t in weights.items():
        out[name] = t.detach().to("cpu", torch.float32)
    weights = out
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if cfg.get("tie_word_embeddings") and "lm_head.weight" in weights and "model.embed_tokens.weight" in weights:
        del weights["lm_head.weight"]
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
    try:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
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
