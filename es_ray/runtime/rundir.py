"""The run directory: created once, absolute, with config.json; on resume the stopped run's config.json is
compared first, and settings that would change the result are refused with the keys named. A new run never writes
into a directory that holds another run: it is refused, or with run.overwrite=true the old run is moved aside."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import functools
import json
import math
import shlex
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable

from es_ray.core.config import ConfigError, flatten

# Hydra and OmegaConf are imported where a saved config is composed again: opening a run dir needs neither.

# Settings that never change what a run computes (display, logging, where the cluster is, the cadence of extra
# checkpoints): es-compare ignores them when it checks a finished stage against the command.
RESULT_NEUTRAL = frozenset(
    {
        "run.progress",
        "run.verbose",
        "run.trackers",
        "run.resume",
        "run.overwrite",
        "run.checkpoint_every",
        "run.keep_checkpoints",
        "cluster.address",
        "cluster.placement",
        "cluster.wait_for_resources_s",
        "cluster.worker_niceness",
    }
)
# Settings a resume may change: the neutral ones, and where the run lives, its budget and the held-out cadence
# (continuing a run under a new budget is what a resume is for; the steps it computes stay the same).
RESUME_FREE = RESULT_NEUTRAL | {
    "run.dir",
    "run.root",
    "cluster.num_cpus",
    "eval.every",
    "run.stop_at_tokens",
    "run.stop_at_device_seconds",
}

# What a run writes into run.dir first (config.json) or appends to: a directory holding any of them holds a run.
RUN_FILES = (
    "config.json",
    "metrics.jsonl",
    "seed_log.jsonl",
    "summary.json",
    "ledger.json",
    "checkpoints",
    "results.json",
    "drift.json",
)

# The console script of each method, for the messages that name a command.
PROGRAMS = {"es": "es-train", "grpo": "grpo-train", "eval": "es-eval", "drift": "es-drift", "compare": "es-compare"}
RESUMABLE = ("es", "grpo")


def run_dir_of(cfg: Any, method: str) -> Path:
    """run.dir, else a new <run.root>/<method>-<timestamp>[-k] (never an existing one: two runs started in the
    same second get two directories)."""
    if cfg.run.dir:
        return Path(cfg.run.dir).resolve()
    return _unused(Path(cfg.run.root or Path.cwd() / "runs").resolve() / f"{method}-{time.strftime('%Y%m%d-%H%M%S')}")


def _unused(base: Path) -> Path:
    """base, or base-2, base-3, ...: the first that does not exist."""
    path, k = base, 1
    while path.exists():
        k += 1
        path = base.with_name(f"{base.name}-{k}")
    return path


def holds_run(run_dir: Path) -> list[str]:
    """The run files in ``run_dir`` (empty: no run there)."""
    return [name for name in RUN_FILES if (run_dir / name).exists()]


def move_aside(run_dir: Path) -> Path:
    """Rename run_dir to a sibling <name>.replaced-<timestamp>[-k]; returns the new path."""
    path = _unused(run_dir.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"))
    run_dir.rename(path)
    return path


def resume_command(method: str, run_dir: Path | str) -> str:
    """The command that continues the run in run_dir, as a shell takes it (the saved config.json does the rest)."""
    return f"{PROGRAMS.get(method, method)} run.resume=true run.dir={shlex.quote(str(run_dir))}"


def claim_run_dir(run_dir: Path, overwrite: bool, method: str, record: dict | None = None) -> Path | None:
    """Before a new run writes anything: a run_dir holding another run is refused (one line: resume it, choose
    another run.dir, or run.overwrite=true), or with ``overwrite`` moved aside; returns where it went, if moved.
    A run of the same settings (``record``, the config.json to be written) that never committed a step
    (``not_started``: a start that failed before its first iteration) is no other run: the same command reuses
    its directory."""
    found = holds_run(run_dir)
    if not found or not_started(run_dir, found, record):
        return None
    if not overwrite:
        try:  # the command that continues the run there is its own method's
            method = json.loads((run_dir / "config.json").read_text()).get("method", method)
        except (OSError, ValueError, AttributeError):
            pass
        resume = f"continue that run with `{resume_command(method, run_dir)}`, " if method in RESUMABLE else ""
        raise ConfigError(
            f"run.dir={run_dir} holds another run ({', '.join(found)}); a new run never writes into "
            f"it: {resume}choose another run.dir, or set run.overwrite=true to move the old run aside"
        )
    return move_aside(run_dir)


STEP_LOGS = ("metrics.jsonl", "seed_log.jsonl")
"""Files that hold a line per committed step: empty or absent, the run committed none."""


def not_started(run_dir: Path, found: list[str], record: dict | None) -> bool:
    """Whether run_dir holds a run with ``record``'s settings (the resume-free ones aside) that committed no step:
    its config.json, and at most a ledger of its start and empty step logs; no checkpoint, no summary."""
    if record is None or not set(found) <= {"config.json", "ledger.json", *STEP_LOGS}:
        return False
    if any((run_dir / name).is_file() and (run_dir / name).read_text().strip() for name in STEP_LOGS):
        return False
    try:
        old = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(old, dict) or old.get("method") != record.get("method"):
        return False
    return not changed_settings(flatten(old), flatten(record), RESUME_FREE, missing=True)


def check_same_run(old: dict, new: Any, free: Iterable[str] = ()) -> None:
    """Refuse a resume whose settings would change the result (the keys both configs know, less ``free`` ones and
    the faults group)."""
    a, b = flatten(old), flatten(new if isinstance(new, dict) else dataclasses.asdict(new))
    diff = changed_settings(a, b, RESUME_FREE | set(free))
    if diff:
        shown = "; ".join(f"{k}={b[k]!r} (the run used {a[k]!r})" for k in diff[:6])
        raise ConfigError(
            f"run.resume=true: these settings differ from the stopped run's config.json and would "
            f"change its result: {shown}. Set them back, or start a new run.dir"
        )


def changed_settings(old: dict, new: dict, free: Iterable[str] = (), missing: bool = False) -> list[str]:
    """The dotted keys (sorted) whose values differ between two flattened configs, less the ``free`` ones and the
    faults group (a rehearsal, never a result). Only keys both know are compared (a config saved by an older
    version lacks the newer keys), unless ``missing``: then a key only one side has counts as changed."""
    free = set(free)
    keys = old.keys() | new.keys() if missing else old.keys() & new.keys()
    return sorted(
        k
        for k in keys
        if k not in free and not k.startswith("faults.") and (k not in old or k not in new or old[k] != new[k])
    )


_held_locks: dict[Path, Any] = {}  # run dir -> its config.json, open, that this process holds an flock on


def lock_run_dir(run_dir: Path, method: str) -> None:
    """Hold the run in run_dir for this process until it ends (or ``unlock_run_dir``): an flock on its config.json
    (opened for writing, so NFS, which emulates flock with byte-range locks, holds it across hosts too). A second
    driver there (two resumes of one run, run.overwrite=true over a live one) is refused in one line; two drivers
    would append the same iterations to one seed log and race on its checkpoints. The kernel drops the lock when
    its process dies (SIGKILL included), so a stopped run never leaves it held. A file system without flock (some
    FUSE mounts) runs unlocked, as before."""
    path = run_dir / "config.json"
    if run_dir in _held_locks or not path.is_file():  # held already (a test, es-compare's stages); no run yet
        return
    f = open(path, "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ConfigError(
            f"run.dir={run_dir} is in use: another driver is running there (its process holds "
            f"{path.name}'s lock) and one run dir takes one driver at a time; wait for it to end (or "
            f"stop it), then `{resume_command(method, run_dir)}`"
        ) from None
    except OSError:  # no flock on this file system
        f.close()
        return
    _held_locks[run_dir] = f


def unlock_run_dir(run_dir: Path) -> None:
    """Release ``lock_run_dir``'s hold (the run ended)."""
    f = _held_locks.pop(Path(run_dir), None)
    if f is not None:
        f.close()


@contextmanager
def releasing_run_dir(run_dir: Path):
    """The run dir's lock released however the block ends: a run that fails between opening its run dir and its
    first step (a resume refused, a checkpoint that fails its digest, a cluster or engine that does not start)
    leaves no hold behind, so a later driver in another process (es-compare's next attempt, a notebook's retry)
    is not refused as if this one still ran."""
    try:
        yield run_dir
    finally:
        unlock_run_dir(run_dir)


def releases_run_dir(fn: Callable) -> Callable:
    """``fn`` (a program's run: es-eval, es-drift, es-interpolate) gives back every run dir lock it took
    (``open_run_dir``) however it ends, as ``releasing_run_dir`` does for the training drivers: es-compare runs them
    in its own process, which lives on, as a notebook does. A hold this process had before the call is kept."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before = set(_held_locks)
        try:
            return fn(*args, **kwargs)
        finally:
            for run_dir in [d for d in _held_locks if d not in before]:
                unlock_run_dir(run_dir)

    return wrapper


class RunDirError(ConfigError):
    """The run dir cannot be written (no space left, a quota, a read-only file system): one line, exit 2."""


WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG})
"""Errors of a write that the user fixes on the file system, not in the code."""


def write_error(exc: BaseException) -> OSError | None:
    """The OSError of a failed write that ``exc`` is or carries (an actor's, inside Ray's RayTaskError, is its
    ``cause``), if its errno is one the user fixes on the file system (``WRITE_ERRNOS``)."""
    for err in (getattr(exc, "cause", None), exc):
        if isinstance(err, OSError) and err.errno in WRITE_ERRNOS:
            return err
    return None


def open_run_dir(
    cfg: Any, method: str, resume_free: Iterable[str] = (), note: Callable[[str], None] | None = None
) -> Path:
    """Create run.dir (or <run.root>/<method>-<timestamp>) and write config.json with the method's name in it.

    With run.resume=true and a config.json there, the stopped run's settings are checked first (``check_same_run``,
    the method included), so config.json is never overwritten by a run that is refused. A new run into a directory
    that holds another run is refused before anything is written (``claim_run_dir``), or with run.overwrite=true
    the old run is moved aside to a sibling (``note`` is told where)."""
    run_dir = run_dir_of(cfg, method)
    path = run_dir / "config.json"
    record = {"method": method, **dataclasses.asdict(cfg)}
    held_before = run_dir in _held_locks
    lock_run_dir(run_dir, method)  # a live driver there is refused before its config or its files are touched
    try:
        if getattr(cfg.run, "resume", False) and path.is_file():
            check_same_run(json.loads(path.read_text()), record, resume_free)
        else:
            moved = claim_run_dir(run_dir, getattr(cfg.run, "overwrite", False), method, record)
            if moved is not None:
                unlock_run_dir(run_dir)  # the lock went with the old run's config.json
                (note or print)(
                    f"{PROGRAMS.get(method, method)}: run.overwrite=true: the run that was in {run_dir} "
                    f"is now in {moved}"
                )
        run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2))
        lock_run_dir(run_dir, method)
    except BaseException:  # refused (changed settings, a full disk): no hold left by a run that never ran
        if not held_before:
            unlock_run_dir(run_dir)
        raise
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
    write_metrics(path, rows)
    return rows


def write_metrics(path: Path, rows: list[dict]) -> None:
    """metrics.jsonl replaced whole by ``rows`` (written beside it first: a kill mid-write leaves the old file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


def command_line_keys(dict_cfg: Any) -> set[str]:
    """The dotted keys this Hydra command sets: its key=value overrides, and the keys its presets (group=option)
    change from the defaults."""
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    hc = HydraConfig.get()
    texts = [t for t in hc.overrides.task if not t.lstrip("+~").startswith("hydra.")]
    keys, groups = set(), []
    for text, override in zip(texts, OverridesParser.create().parse_overrides(texts)):
        if override.key_or_group in hc.runtime.choices:
            groups.append(text)
        else:
            keys.add(override.key_or_group)
    if groups:
        base = flatten(OmegaConf.to_container(compose(config_name=hc.job.config_name), resolve=True))
        chosen = flatten(
            OmegaConf.to_container(compose(config_name=hc.job.config_name, overrides=groups), resolve=True)
        )
        keys |= {k for k in chosen.keys() | base.keys() if chosen.get(k) != base.get(k)}
    return keys


def resumed_config(dict_cfg: Any, method: str, free: Iterable[str] = (), given: set[str] | None = None) -> Any:
    """run.resume=true with a config.json in run.dir: the run's saved configuration, with the settings this command
    gives (``given``; by default read from Hydra) laid over it. A given setting that would change the result (not a
    resume-free key) is refused, naming it; anything else is returned as it came (a new run)."""
    from omegaconf import OmegaConf

    run = dict_cfg.get("run") or {}
    if not run.get("resume") or not run.get("dir") or not (Path(run["dir"]) / "config.json").is_file():
        return dict_cfg
    run_dir = Path(run["dir"]).resolve()
    saved = json.loads((run_dir / "config.json").read_text())
    saved_method = saved.pop("method", method)
    if saved_method != method:
        prog = PROGRAMS.get(saved_method, saved_method)
        raise ConfigError(
            f"run.dir={run_dir} holds a run of {prog}, not of {PROGRAMS.get(method, method)}: continue "
            f"it with `{resume_command(saved_method, run_dir)}`, or choose another "
            "run.dir"
        )
    given = command_line_keys(dict_cfg) if given is None else given
    now = flatten(dict_cfg if isinstance(dict_cfg, dict) else OmegaConf.to_container(dict_cfg, resolve=True))
    old = flatten(saved)
    free = RESUME_FREE | set(free)
    asked = given & now.keys()
    changed = changed_settings({k: old.get(k) for k in asked}, {k: now[k] for k in asked}, free)
    if changed:
        shown = "; ".join(f"{k}={now[k]!r} (the run used {old.get(k)!r})" for k in changed[:6])
        raise ConfigError(
            f"run.resume=true continues the run with its saved config.json; these settings given with "
            f"it would change its result: {shown}. Drop them (a resume may change only "
            f"{', '.join(sorted(free))} and faults.*), or start a new run.dir"
        )
    # the saved settings, those given here over them; the faults group (a rehearsal) is this command's own
    merged = {k: v for k, v in old.items() if not k.startswith("faults.")}
    merged.update({k: v for k, v in now.items() if k in given or k.startswith("faults.")})
    out: dict = {}
    for key, value in merged.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out
