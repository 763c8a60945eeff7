"""The sharded learner's parameters and AdamW moments as FSDP2 lays them out: dim 0 of every tensor split in chunks of
ceil(rows / world) rows (torch.chunk's split), rank r holding chunk r (the last ranks' possibly short or empty).

The moments are checkpointed here rather than by torch.distributed.checkpoint: DCP's coordination maps ranks through
the default process group (``dist.get_rank(group)``, ``dist.get_global_rank``), which a colocated vLLM owns and in
which every learner rank is rank 0 (es_ray/runtime/process_group.py). Each rank writes its own rows of each moment
to ``moments-<rank>-of-<world>.safetensors``; a rank of any later grpo.fsdp_size reads the rows it holds from the
files whose rows overlap them, so the checkpoint reshards on load as DCP's did.
"""

from __future__ import annotations

import re
from pathlib import Path

from es_ray.core.manifest import CheckpointError
from es_ray.models import read_tensor

# torch and safetensors' torch loader are imported where moments are loaded: checking a checkpoint's shard names needs
# neither.

MOMENTS = re.compile(r"moments-(\d+)-of-(\d+)\.safetensors")


def local(t):
    """A DTensor's local shard (FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def full(t):
    """A DTensor gathered whole (a collective: every rank calls it), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def rows_start(rows: int, world: int, rank: int) -> int:
    """The first dim-0 row of rank ``rank``'s chunk of a ``rows``-row tensor split over ``world`` ranks."""
    return min(rows, -(-rows // world) * rank)


def shard_start(p) -> int:
    """The first dim-0 row of this rank's FSDP2 shard of ``p``: its place in the mesh is the mesh's coordinate (given
    by the learner's own group, not read from the default group as ``get_local_rank`` would)."""
    mesh = p.device_mesh
    return rows_start(p.shape[0], mesh.size(), mesh.get_coordinate()[0])


def slice_like(whole, p):
    """This rank's rows of the whole tensor ``whole`` for the (possibly DTensor) parameter ``p``, on its device."""
    if not hasattr(p, "to_local"):
        return whole
    mine = local(p)
    start = shard_start(p)
    return whole[start : start + mine.shape[0]].to(mine.device)


def save_moments(directory: str | Path, moments: dict, rank: int, world: int) -> Path:
    """This rank's rows of AdamW's state (``{name: {"step", "exp_avg", "exp_avg_sq"}}``, moments as DTensors or
    local tensors) into ``directory``; the step is the same on every rank and every file carries it."""
    from safetensors.torch import save_file

    out = {}
    for name, state in moments.items():
        for key, value in state.items():
            out[f"{name}/{key}"] = local(value).detach().to("cpu").contiguous()
    path = Path(directory) / f"moments-{rank}-of-{world}.safetensors"
    save_file(out, str(path))
    return path


def moment_sets(directory: Path, names: list[str]) -> dict[int, dict[int, str]]:
    """The moments files among ``names`` (in ``directory``), by world size, then rank: their paths."""
    sets: dict[int, dict[int, str]] = {}
    for m in filter(None, map(MOMENTS.fullmatch, names)):
        sets.setdefault(int(m.group(2)), {})[int(m.group(1))] = str(directory / m.group(0))
    return sets


def unreadable_moments(directory: Path, names: list[str]) -> Exception:
    """Why a checkpoint's ``shards/`` (``directory``, holding ``names``) gives no moments to load, as one line naming
    what to do (a CheckpointError: the CLI shows it without a traceback). Either the learner wrote it before it saved
    the moments itself, in torch.distributed.checkpoint's layout (DCP's ``.metadata`` and ``__<rank>_<n>.distcp``),
    which is not read any more; or its moments files lack a rank or mix world sizes."""
    checkpoint = directory.parent
    dcp = [n for n in names if n == ".metadata" or n.endswith(".distcp")]
    if dcp:
        return CheckpointError(
            f"{directory}: AdamW's moments in the older torch.distributed.checkpoint (DCP) layout "
            f"({', '.join(dcp[:3])}{', ...' if len(dcp) > 3 else ''}), which this version no "
            f"longer reads: resume {checkpoint} with the es-ray version that wrote it, or start "
            "the run again in a new run.dir"
        )
    ranks = moment_sets(directory, names)
    found = (
        "; ".join(f"{len(r)} rank{'s' * (len(r) != 1)} of world size {w}" for w, r in sorted(ranks.items()))
        or "no rank"
    )
    missing = ""
    if len(ranks) == 1:
        ((world, have),) = ranks.items()
        absent = [r for r in range(world) if r not in have]
        extra = [r for r in sorted(have) if r >= world]
        gaps = [f"{len(absent)} missing, first {absent[:3]}"] if absent else []
        gaps += [f"beyond the world size: {extra[:3]}"] if extra else []
        missing = f" ({'; '.join(gaps)})" if gaps else ""
    return CheckpointError(
        f"{directory}: moments-<rank>-of-<world>.safetensors found for {found}, where a sharded "
        f"learner's checkpoint has every rank of one world size{missing}; move {checkpoint} aside "
        "to resume from an earlier checkpoint"
    )


def load_moments(directory: str | Path, fresh: dict) -> dict:
    """``fresh`` (zeros in this rank's layout, as ``save_moments`` takes them) filled with the rows this rank holds,
    read from every saved rank's file that has some of them: any world size wrote them."""
    import torch

    directory = Path(directory)
    names = sorted(path.name for path in directory.iterdir())
    # by world size, then rank: a later complete set beside an earlier partial one is refused too
    sets = moment_sets(directory, names)
    saved, files = next(iter(sets.items())) if len(sets) == 1 else (0, {})
    if not files or sorted(files) != list(range(saved)):
        raise unreadable_moments(directory, names)
    with torch.no_grad():
        for name, state in fresh.items():
            for key, value in state.items():
                mine = local(value)
                if mine.dim() == 0:  # the step: one scalar, the same on every rank
                    mine.copy_(read_tensor(files[0], f"{name}/{key}"))
                    continue
                rows = value.shape[0]
                start = shard_start(value) if hasattr(value, "device_mesh") else 0
                end = start + mine.shape[0]
                for r, file in files.items():
                    lo, hi = max(start, rows_start(rows, saved, r)), min(end, rows_start(rows, saved, r + 1))
                    if lo < hi:
                        part = read_tensor(
                            file,
                            f"{name}/{key}",
                            (slice(lo - rows_start(rows, saved, r), hi - rows_start(rows, saved, r)),),
                        )
                        mine[lo - start : hi - start].copy_(part)
    return fresh
