"""Whether two checkpoints can be compared token by token (off-task KL) or weight by weight (interpolation), read
from their config.json, tokenizer.json and safetensors headers only: a mismatch is refused in one line before any
model is loaded."""

from __future__ import annotations

import json
from pathlib import Path

from es_ray.core.config import ConfigError
from es_ray.models import safetensors_index

ARCHITECTURE_KEYS = (
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def vocabulary(model_dir: Path) -> tuple[int | None, dict | None]:
    """(config.json's vocab_size, tokenizer.json's token -> id map or None where there is no tokenizer.json)."""
    tok = _json(Path(model_dir) / "tokenizer.json")
    vocab = (tok.get("model") or {}).get("vocab")
    added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    return _json(Path(model_dir) / "config.json").get("vocab_size"), (
        {**vocab, **added} if isinstance(vocab, dict) else None
    )


def check_same_vocabulary(a: Path, b: Path, a_key: str, b_key: str) -> None:
    """Refuse two models whose next-token distributions are over different vocabularies."""
    (size_a, vocab_a), (size_b, vocab_b) = vocabulary(a), vocabulary(b)
    if size_a != size_b:
        raise ConfigError(
            f"{a_key} ({a}) has vocab_size {size_a} but {b_key} ({b}) has {size_b}: their token "
            f"distributions cannot be compared; give {b_key}= a checkpoint of the same model family"
        )
    if vocab_a is not None and vocab_b is not None and vocab_a != vocab_b:
        differ = sum(vocab_a.get(t) != i for t, i in vocab_b.items())
        raise ConfigError(
            f"{a_key} ({a}) and {b_key} ({b}) have different tokenizers ({differ} tokens map to other "
            f"ids): give {b_key}= a checkpoint with the same tokenizer"
        )


def check_same_architecture(a: Path, b: Path, a_key: str, b_key: str) -> dict[str, tuple[int, ...]]:
    """Refuse two checkpoints that differ in architecture, tokenizer or tensor names and shapes; returns the shared
    name -> shape."""
    ca, cb = _json(Path(a) / "config.json"), _json(Path(b) / "config.json")
    differ = [k for k in ARCHITECTURE_KEYS if ca.get(k) != cb.get(k)]
    if differ:
        shown = ", ".join(f"{k} {ca.get(k)!r} vs {cb.get(k)!r}" for k in differ[:3])
        raise ConfigError(
            f"{a_key} ({a}) and {b_key} ({b}) are different architectures ({shown}): give checkpoints "
            "trained from the same base model"
        )
    check_same_vocabulary(a, b, a_key, b_key)
    ia, ib = safetensors_index(a), safetensors_index(b)
    shapes_a, shapes_b = {n: s for n, (_, s) in ia.items()}, {n: s for n, (_, s) in ib.items()}
    if shapes_a != shapes_b:
        odd = sorted(set(shapes_a) ^ set(shapes_b)) or sorted(n for n in shapes_a if shapes_a[n] != shapes_b[n])
        raise ConfigError(
            f"{a_key} ({a}) and {b_key} ({b}) hold different tensors (first: {odd[0]}): give "
            "checkpoints trained from the same base model"
        )
    return shapes_a
