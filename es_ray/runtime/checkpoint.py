"""HF-format checkpoint directories that prove themselves, for every method.

A checkpoint directory loads with ``AutoModelForCausalLM.from_pretrained``: config.json, model.safetensors
(fp32 weights by HF name), tokenizer files, plus ``<method>_state.pt`` (optimizer and other run state, tensors and
plain values only: it is read with ``torch.load(weights_only=True)``) and ``<method>_meta.json`` (step or
iteration, and what the method adds).

The one way a checkpoint directory is published (``publish_dir``; any method's writer, sharded ones included): the
files are written into a hidden staging sibling (``staging_dir``), a ``manifest.json`` with every file's size and
sha256 is written beside them, files and directories are fsynced, then the previous directory of that name is
renamed aside, the new one renamed in and the parent fsynced, and only then the old one deleted. So at every moment
a checkpoint of that name exists (or, after a kill between the two renames, the old one waits aside and
``checkpoint_dirs`` puts it back), and an interrupted write never leaves a directory that looks finished. Hidden
directories are never listed, and ``checkpoint_dirs`` removes the stale ones. ``verify_dir`` checks every file
against the manifest (and refuses files it does not list) before a checkpoint is loaded, naming the file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
import struct
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

from es_ray.core.manifest import (
    MANIFEST,
    CheckpointError,
    open_to_umask,
    sha256_file,
    verify_dir,  # noqa: F401
    verify_file,
)
from es_ray.models import read_tensor, safetensors_index

if TYPE_CHECKING:  # imported where tensors are read or written: a driver that lists checkpoints needs none
    import torch

# torch is imported where tensors are saved or loaded: the driver lists and prunes checkpoints without it.

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
_STAGING, _ASIDE = ".tmp-", ".old-"


def state_file(method: str) -> str:
    return f"{method}_state.pt"


def meta_file(method: str) -> str:
    return f"{method}_meta.json"


# -- publish, verify, list -------------------------------------------------------------------------------------


def staging_dir(final: str | Path) -> Path:
    """A new hidden sibling of ``final`` to write a checkpoint into before ``publish_dir``."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}{_STAGING}"))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_entry(f: Path, digest: str | None) -> dict:
    _fsync(f)
    return {"bytes": f.stat().st_size, "sha256": digest or sha256_file(f)}


def publish_dir(tmp: str | Path, final: str | Path, digests: Mapping[str, str] | None = None) -> Path:
    """Publish the finished directory ``tmp`` (from ``staging_dir``) as ``final``: a manifest of every file under it
    (relative path -> bytes and sha256), everything fsynced, then swapped in atomically (the previous ``final`` is
    renamed aside and deleted only once the new one is in place). ``digests``: the sha256 of files taken as they
    were written (``write_fp32_safetensors``), so they are not read again; the other files are hashed here, each
    fsynced and hashed in a thread of its own (both release the GIL: a large file's disk flush overlaps the hashing
    of the next)."""
    tmp, final = Path(tmp), Path(final)
    paths = {f.relative_to(tmp).as_posix(): f for f in sorted(p for p in tmp.rglob("*") if p.is_file())}
    paths.pop(MANIFEST, None)
    digests = digests or {}
    with ThreadPoolExecutor(max_workers=max(1, min(4, len(paths)))) as pool:
        entries = {rel: pool.submit(_file_entry, f, digests.get(rel)) for rel, f in paths.items()}
        files: dict[str, dict] = {rel: entry.result() for rel, entry in entries.items()}
    with open(tmp / MANIFEST, "w") as f:
        json.dump({"format": 1, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for d in sorted((p for p in tmp.rglob("*") if p.is_dir()), reverse=True):
        _fsync(d)
    open_to_umask(tmp)  # mkdtemp's 0700 would keep other users and nodes' processes out of shared storage
    _fsync(tmp)
    old = None
    if final.exists():
        old = final.parent / f".{final.name}{_ASIDE}{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_dirs(parent: str | Path) -> list[Path]:
    """The published checkpoint directories under ``parent``, by name; first cleans up after a killed writer: a
    staging directory is deleted, a previous checkpoint left aside (killed between the two renames) is put back."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    for d in sorted(parent.iterdir()):
        if not d.name.startswith(".") or not d.is_dir():
            continue
        if _ASIDE in d.name:
            home = parent / d.name[1:].rsplit(_ASIDE, 1)[0]
            if not home.exists():
                os.rename(d, home)
                continue
            shutil.rmtree(d, ignore_errors=True)
        elif _STAGING in d.name:
            shutil.rmtree(d, ignore_errors=True)
    return sorted(d for d in parent.iterdir() if d.is_dir() and not d.name.startswith("."))


def checkpoints_by_step(parent: str | Path, method: str, key: str) -> list[tuple[int, Path, dict]]:
    """(meta[key], path, meta) of every published checkpoint of ``method`` under ``parent`` (periodic ones and
    ``final`` alike: a finished run extended continues from its ``final``), oldest first; each meta's digest is
    checked (``read_meta``: a changed file is refused, naming it)."""
    out = []
    for path in checkpoint_dirs(parent):
        if (path / meta_file(method)).is_file() or (path / MANIFEST).is_file():
            meta = read_meta(path, method)
            out.append((int(meta[key]), path, meta))
    return sorted(out, key=lambda x: (x[0], x[1].name))


def read_meta(path: str | Path, method: str) -> dict:
    """The checkpoint's ``<method>_meta.json``, its digest checked."""
    return json.loads(verify_file(path, meta_file(method)).read_text())


def load_state(path: str | Path, method: str) -> dict:
    """The checkpoint's ``<method>_state.pt``: tensors and plain values only (``weights_only=True``: a pickle that
    would run code is refused), memory-mapped so its tensors are read when used."""
    import torch

    file = Path(path) / state_file(method)
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - the unpickler's refusals come in several types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{file}: refused by torch.load(weights_only=True) ({first[:200]}); it is not a state this project wrote"
        ) from None


# -- writing -----------------------------------------------------------------------------------------------------


def save_checkpoint(
    path: str | Path,
    weights: Mapping[str, torch.Tensor],
    model_dir: str | Path,
    state: dict,
    meta: dict,
    method: str,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """``weights`` (HF name -> tensor, saved in fp32 over the model directory's own tensors), ``state`` (torch.save'd
    as <method>_state.pt) and ``meta`` (<method>_meta.json) into the directory ``path``. The weights file is
    written one tensor at a time (``write_fp32_safetensors``): the model directory's other tensors are read one by
    one, never all at once, and no tensor of ``weights`` is copied beyond the one being written."""
    import torch

    path = Path(path)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    entries = {name: (tuple(t.shape), lambda t=t: t) for name, t in weights.items()}
    for name, (file, shape) in safetensors_index(model_dir).items():  # untrained tensors keep their source values
        entries.setdefault(name, (shape, functools.partial(read_tensor, file, name)))
    if cfg.get("tie_word_embeddings") and "lm_head.weight" in entries and "model.embed_tokens.weight" in entries:
        del entries["lm_head.weight"]
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    tmp = staging_dir(path)
    try:
        digests = {"model.safetensors": write_fp32_safetensors(tmp / "model.safetensors", entries, {"format": "pt"})}
        for name in MODEL_FILES:
            if (Path(model_dir) / name).is_file() and name != "config.json":
                shutil.copy2(Path(model_dir) / name, tmp / name)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        torch.save(state, tmp / state_file(method))
        (tmp / meta_file(method)).write_text(json.dumps({**meta, "method": method}, indent=2, default=str))
        if extra is not None:  # more files into the staging dir (a sharded learner's shards), published with it
            extra(tmp)
        publish_dir(tmp, path, digests)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def write_fp32_safetensors(
    file: Path, entries: Mapping[str, tuple[tuple[int, ...], Callable[[], torch.Tensor]]], metadata: dict[str, str]
) -> str:
    """A safetensors file of fp32 tensors (name -> (shape, reader)), streamed: the format's header holds only names,
    shapes and byte offsets, all known from the shapes, so it is written first and each tensor is then read, cast
    and appended on its own (safetensors' own ``save_file`` takes every tensor at once, in a dict). Returns the
    file's sha256, taken from the bytes as they are written: one helper thread hashes each tensor while it is
    written (hashing and writing both release the GIL), and the tensor is kept until its hash is done, so
    ``publish_dir`` need not read the file again."""
    import torch

    header: dict = {"__metadata__": metadata}
    offset = 0
    for name in sorted(entries):
        nbytes = 4 * math.prod(entries[name][0])
        header[name] = {"dtype": "F32", "shape": list(entries[name][0]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    digest = hashlib.sha256()
    head = struct.pack("<Q", len(raw)) + raw
    digest.update(head)
    with open(file, "wb") as f, ThreadPoolExecutor(max_workers=1) as hasher:
        f.write(head)
        hashing = None  # (the tensor being hashed, its hash's future): the tensor lives until its hash is done
        for name in sorted(entries):
            shape, read = entries[name]
            t = read().detach().to("cpu", torch.float32).contiguous()
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: tensor of shape {tuple(t.shape)}, declared {shape}")
            data = t.view(-1).numpy().data
            if hashing is not None:
                hashing[1].result()  # in order: the previous tensor's bytes are in the digest
            hashing = (t, hasher.submit(digest.update, data))
            f.write(data)
            del t, data
        if hashing is not None:
            hashing[1].result()
    return digest.hexdigest()


# -- bounds: how many checkpoints a run keeps, and what each costs on disk --------------------------------------


def numbered(parent: str | Path, prefix: str) -> list[tuple[int, Path]]:
    """(n, path) of the published ``<prefix>_<n>`` checkpoints under ``parent`` (periodic and stop-time ones; never
    ``final``), oldest first."""
    out = []
    for d in checkpoint_dirs(parent):
        head, _, n = d.name.rpartition("_")
        if head == prefix and n.isdigit():
            out.append((int(n), d))
    return sorted(out)


def remove_dir(path: Path) -> None:
    """Delete a checkpoint directory: first renamed to a hidden staging name (a kill mid-delete leaves what
    ``checkpoint_dirs`` removes, never a half-deleted checkpoint under its own name)."""
    gone = path.parent / f".{path.name}{_STAGING}removed-{uuid.uuid4().hex[:8]}"
    os.rename(path, gone)
    shutil.rmtree(gone, ignore_errors=True)


KEPT_FINALS = ".kept_finals.json"
"""Under checkpoints/: the names of the numbered checkpoints that hold an extended run's earlier final
(``mark_kept_final``); run.keep_checkpoints never deletes them."""


def kept_finals(parent: str | Path) -> set[str]:
    """The names ``mark_kept_final`` recorded under ``parent`` (none where the file is missing or unreadable)."""
    try:
        names = json.loads((Path(parent) / KEPT_FINALS).read_text())
    except (OSError, ValueError):
        return set()
    return {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()


def mark_kept_final(parent: str | Path, name: str) -> None:
    """Record checkpoint ``name`` as an earlier final (written to a temporary file, then renamed over the list)."""
    path = Path(parent) / KEPT_FINALS
    tmp = path.with_name(f"{path.name}{_STAGING}{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(sorted(kept_finals(parent) | {name})))
    os.replace(tmp, path)


def prune_checkpoints(parent: str | Path, prefix: str, keep: int) -> list[Path]:
    """run.keep_checkpoints: delete all but the newest ``keep`` numbered checkpoints (0: keep all); ``final`` and
    an extended run's earlier finals (``kept_finals``: the issue's milestones, one per extension) are never touched
    and do not count. Returns the deleted ones."""
    if keep <= 0:
        return []
    milestones = kept_finals(parent)
    gone = [d for _, d in [c for c in numbered(parent, prefix) if c[1].name not in milestones][:-keep]]
    for d in gone:
        remove_dir(d)
    return gone


def keep_as(src: Path, dst: Path) -> Path:
    """Publish a copy of the checkpoint ``src`` as ``dst`` (its manifest goes along: the files are the same), made of
    hard links where the file system allows (no second copy on disk; the links outlive ``src`` being replaced)."""
    tmp = staging_dir(dst)
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        out = tmp / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(f, out)
        except OSError:  # no hard links here (another file system, some network mounts): a copy
            shutil.copy2(f, out)
    open_to_umask(tmp)
    os.rename(tmp, dst)
    _fsync(dst.parent)
    return dst


def dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
