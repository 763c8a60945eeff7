"""The run directory: created once, absolute, with config.json; on resume the stopped run's config.json is
compared first, and settings that would change the result are refused with the keys named."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Iterable

from es_ray.core.config import ConfigError, flatten

# Settings that never change a run's result: a resume may change them.
RESUME_FREE = frozenset({
    "run.resume", "run.dir", "run.root", "run.checkpoint_every", "run.progress", "run.trackers",
    "cluster.address", "cluster.num_cpus", "cluster.placement", "cluster.wait_for_resources_s", "eval.every",
    "run.stop_at_tokens", "run.stop_at_device_seconds",
})


def run_dir_of(cfg: Any, method: str) -> Path:
    root = Path(cfg.run.root or Path.cwd() / "runs")
    return Path(cfg.run.dir or root / f"{method}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()


def check_same_run(old: dict, new: Any, free: Iterable[str] = ()) -> None:
    """Refuse a resume whose settings would change the result (the keys both configs know, less ``free`` ones and
    the faults group)."""
    free = RESUME_FREE | set(free)
    a, b = flatten(old), flatten(new if isinstance(new, dict) else dataclasses.asdict(new))
    diff = [k for k in sorted(a.keys() & b.keys()) if a[k] != b[k] and k not in free and not k.startswith("faults.")]
    if diff:
        shown = "; ".join(f"{k}={b[k]!r} (the run used {a[k]!r})" for k in diff[:6])
        raise ConfigError(f"run.resume=true: these settings differ from the stopped run's config.json and would "
                          f"change its result: {shown}. Set them back, or start a new run.dir")


def open_run_dir(cfg: Any, method: str, resume_free: Iterable[str] = ()) -> Path:
    """Create run.dir (or <run.root>/<method>-<timestamp>) and write config.json with the method's name in it.

    With run.resume=true and a config.json there, the stopped run's settings are checked first (``check_same_run``,
    the method included), so config.json is never overwritten by a run that is refused."""
    run_dir = run_dir_of(cfg, method)
    path = run_dir / "config.json"
    record = {"method": method, **dataclasses.asdict(cfg)}
    if getattr(cfg.run, "resume", False) and path.is_file():
        check_same_run(json.loads(path.read_text()), record, resume_free)
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    return run_dir


def keep_metrics(path: Path, start: int, step_key: str) -> list[dict]:
    """metrics.jsonl on resume: drop the rows of steps that will run again and any torn line (a crash mid-write);
    return the kept rows."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a torn last line
            continue
        if isinstance(row, dict) and row.get(step_key, math.inf) < start:
            rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows
