"""``+from_run.<method>=/abs/run``: a run already trained with es-train or grpo-train stands in for a method's
training stage, checked as a stage of es-compare's own is before it is used.

The run must be a finished run of that method (summary.json, its final checkpoint and ledger.json saying finished)
whose settings are those es-compare would have trained with: the model, the task, the method's section and its
sampling equal, except what only says where and how long it ran (``FREE``: its dir and seed, its budget
(es.iterations / grpo.steps, run.stop_at_*), the held-out cadence and the actors' resources). A mismatch is one
line naming the first differing keys, exit 2. The stage's directory then holds links to the run's files (never a
write into the run itself) and its own done.json, so the evaluation, the drift and the report read it as they read
a stage es-compare trained; its budget is reported as reached, from its own ledger.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from es_ray.core.config import ConfigError
from es_ray.launch.compare.methods import TRAINED
from es_ray.runtime.rundir import RESUME_FREE, changed_settings

FREE = RESUME_FREE | {
    "run.seed",
    "es.iterations",
    "grpo.steps",
    "cluster.num_actors",
    "cluster.gpus_per_actor",
    "cluster.cpus_per_actor",
    "engine.batch_size",
    "engine.threads",
    "eval.every",
}
"""Settings a run brought in may differ in from the stage es-compare would have built."""
LINKED = ("config.json", "metrics.jsonl", "seed_log.jsonl", "ledger.json", "summary.json", "checkpoints", "tensorboard")


def _flat(x, prefix: str = "") -> dict:
    if isinstance(x, dict):
        return {k: v for key, sub in x.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: x}


def check_from_run(method: str, path: str, parts: tuple[str, ...], seeds: list[int], stage_cfg) -> Path:
    """The run at ``path`` as ``method``'s training stage (``stage_cfg``: the stage's config es-compare would run),
    or ConfigError in one line naming the key."""
    key = f"from_run.{method}"
    if len(seeds) != 1:
        raise ConfigError(
            f"{key} is one run, and seeds={list(seeds)} asks for {len(seeds)}: set seeds=[{seeds[0]}] "
            f"(or train the method in the comparison)"
        )
    run = Path(path).expanduser()
    if not run.is_absolute() or not (run / "config.json").is_file():
        raise ConfigError(
            f"{key}={path!r} is not the absolute directory of an es-train or grpo-train run (no config.json there)"
        )
    config = _json(run / "config.json")
    if not isinstance(config, dict):
        raise ConfigError(
            f"{key}={path}: its config.json is not a JSON object (cut short, or not written by es-train "
            "or grpo-train); point it at a finished run's directory"
        )
    if config.get("method") != parts[0]:
        raise ConfigError(
            f"{key}={path}: that run is a {config.get('method')!r} run, and {method} trains "
            f"{parts[0]!r}: point {key}= at a {parts[0]} run"
        )
    summary = _json(run / "summary.json")
    ledger = _json(run / "ledger.json")
    final = Path((summary or {}).get("final_checkpoint") or run / "checkpoints" / "final")
    if summary is None or not (ledger or {}).get("finished") or not final.is_dir():
        raise ConfigError(
            f"{key}={path}: the run has not finished (no summary.json, final checkpoint or finished "
            f"ledger): resume it to its end first, or drop {key}"
        )
    mine = {k: v for k, v in _flat(json.loads(json.dumps(dataclasses.asdict(stage_cfg), default=str))).items()}
    theirs = {k: v for k, v in _flat(config).items() if k != "method"}
    changed = changed_settings(theirs, mine, FREE, missing=True)
    if changed:
        shown = ", ".join(f"{k} ({theirs.get(k)!r} there, {mine.get(k)!r} here)" for k in changed[:4])
        raise ConfigError(
            f"{key}={path} was trained with other settings than this comparison's {method} stage: "
            f"{shown}{' ...' if len(changed) > 4 else ''}; set those keys to the run's values, or drop "
            f"{key}"
        )
    return run


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def link_run(run: Path, stage_dir: Path) -> dict:
    """The stage's directory as links to the run's files (the run itself is only read); its result record."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        if (run / name).exists() and not (stage_dir / name).exists():
            (stage_dir / name).symlink_to(run / name)
    summary = json.loads((run / "summary.json").read_text())
    return {
        "run_dir": str(stage_dir),
        "final_checkpoint": str(stage_dir / "checkpoints" / "final"),
        "from_run": str(run),
        **{k: v for k, v in summary.items() if k not in ("run_dir", "final_checkpoint")},
    }


def adopt(stage, run: Path, root: Path):
    """``stage`` (a training Stage) run by linking ``run`` instead of training."""
    return dataclasses.replace(stage, run=lambda cfg, d=stage.dir(root): link_run(run, d))


def adopt_runs(cfg, method: str, stages: list, root: Path) -> list:
    """``method``'s stages with its training stage taken from ``cfg.from_run[method]`` when one is given (checked
    first: ``check_from_run``); every from_run key must name a method the comparison runs."""
    stray = [m for m in cfg.from_run if m not in cfg.methods]
    if stray:
        raise ConfigError(
            f"from_run.{stray[0]}: {stray[0]} is not among methods={list(cfg.methods)}; add it there "
            f"or drop from_run.{stray[0]}"
        )
    if method not in cfg.from_run:
        return stages
    train = [i for i, s in enumerate(stages) if s.kind.startswith("train")]
    if len(TRAINED.get(method, ())) != 1 or len(train) != 1:
        parts = TRAINED.get(method, ())
        what = f"trains {' then '.join(parts)}" if parts else "trains nothing"
        raise ConfigError(
            f"from_run.{method}: only a method with one training stage (es or grpo, no sequence=) can "
            f"be taken from a run; {method} {what}"
            + (f" on {len(train)} tasks" if cfg.sequence else "")
            + f": drop from_run.{method}"
        )
    i = train[0]
    run = check_from_run(method, cfg.from_run[method], TRAINED[method], list(cfg.seeds), stages[i].config())
    return stages[:i] + [adopt(stages[i], run, root)] + stages[i + 1 :]
