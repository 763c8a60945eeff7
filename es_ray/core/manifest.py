"""A directory's manifest: every file's bytes and sha256 (``manifest.json``, written by
``es_ray.runtime.checkpoint.publish_dir``), and the checks that a directory still matches it. Here, at the bottom,
so that resolving a model (``es_ray.models``) can verify a checkpoint directory without importing the runtime."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from es_ray.core.config import ConfigError

MANIFEST = "manifest.json"


class CheckpointError(ConfigError):
    """A checkpoint file that does not match its manifest, or a directory that is not a finished checkpoint."""


def umask() -> int:
    """This process's umask, read without changing it: where Linux tells it (/proc/self/status), else from the mode
    ``mkdir`` gives a probe directory. Never by setting and restoring it: os.umask is process-wide, and a thread
    creating a file in between (a checkpoint's hashing threads, Ray's, vLLM's) would get the wrong mode."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    probe = tempfile.mkdtemp(prefix="es_ray_umask_")
    try:
        os.mkdir(os.path.join(probe, "d"), 0o777)
        return 0o777 & ~os.stat(os.path.join(probe, "d")).st_mode
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def open_to_umask(path: str | Path) -> None:
    """Give a directory made by ``tempfile.mkdtemp`` (always 0700), and every directory under it, the mode ``mkdir``
    would have given it (0777 less the umask; setgid and sticky bits kept), and every file in them the mode ``open``
    would have (0666 less the umask, execute bits kept), before it is renamed into place: a checkpoint or converted
    model on shared storage is then readable by the cluster's other users and nodes' processes. Every directory,
    since a staged directory moved inside (a sharded learner's ``shards/``, from ``staging_dir``) is mkdtemp's
    too."""
    mask = umask()
    # Files too: a library that writes through a temporary file (transformers' save_pretrained writes
    # model.safetensors 0600) would otherwise keep the weights of a converted model from the cache's other users.
    entries = [(Path(path), True)]
    for top, dirs, files in os.walk(path):
        entries += [(Path(top) / name, True) for name in dirs] + [(Path(top) / name, False) for name in files]
    for entry, is_dir in entries:
        if entry.is_symlink():  # a link's target is not the checkpoint's to change
            continue
        mode = entry.stat().st_mode
        os.chmod(entry, (mode & 0o7000) | (0o777 & ~mask) if is_dir else (0o666 | (mode & 0o111)) & ~mask)


def sha256_file(file: Path) -> str:
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _manifest(path: Path) -> dict[str, dict]:
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointError(
            f"{file}: missing, so {path} is not a finished checkpoint (or predates checkpoint "
            "digests); move it aside to resume from an earlier checkpoint"
        )
    try:
        return dict(json.loads(file.read_text())["files"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{file}: unreadable ({exc}); move {path} aside to resume from an earlier checkpoint"
        ) from None


def _check(path: Path, rel: str, want: dict) -> None:
    file = path / rel
    if not file.is_file():
        raise CheckpointError(
            f"{file}: listed in {MANIFEST} but missing; move {path} aside to resume from an earlier checkpoint"
        )
    size = file.stat().st_size
    got = sha256_file(file) if size == want.get("bytes") else ""
    if got != want.get("sha256"):
        found = f"sha256 {got[:16]}..." if got else f"{size} bytes"
        expected = f"sha256 {str(want.get('sha256'))[:16]}..." if got else f"{want.get('bytes')}"
        raise CheckpointError(
            f"{file}: {found} where {MANIFEST} says {expected}: the file is corrupted; move "
            f"{path} aside to resume from an earlier checkpoint"
        )


def verify_dir(path: str | Path) -> dict[str, dict]:
    """Check every file of checkpoint ``path`` against its manifest; returns the manifest's files. Raises
    CheckpointError naming the first file that is missing, differs, or is not in the manifest."""
    path = Path(path)
    files = _manifest(path)
    for rel, want in files.items():
        _check(path, rel, want)
    listed = set(files) | {MANIFEST}
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        if f.relative_to(path).as_posix() not in listed:
            raise CheckpointError(f"{f}: not in {path / MANIFEST}; it was not written with this checkpoint: remove it")
    return files


def verify_file(path: str | Path, rel: str) -> Path:
    """Check one file of checkpoint ``path`` against its manifest (e.g. the meta a driver reads); returns it."""
    path = Path(path)
    files = _manifest(path)
    if rel not in files:
        raise CheckpointError(f"{path / rel}: not in {path / MANIFEST}; {path} is not a checkpoint of this kind")
    _check(path, rel, files[rel])
    return path / rel
