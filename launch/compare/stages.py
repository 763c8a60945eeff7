"""es-compare's stages: the list of runs one comparison is cut into (a training run, an evaluation, a drift
report, an interpolation), each with its configuration built from the comparison's and the job that runs it.

``stage_plan`` gives one method's stages for one seed, in order; ``interpolation_plan`` the es-interpolate stages
after them. Running a stage once, and resuming, is launch/compare/run.py's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from es_ray.core.config import ConfigError, HeldOutConfig
from es_ray.es.config import ESFaultsConfig, ESTrainConfig, validate
from es_ray.evaluation.config import (
    DriftJobConfig,
    EvalJobConfig,
    InterpolateJobConfig,
    validate_drift,
    validate_eval,
    validate_interpolate,
)
from es_ray.grpo.config import GRPOClusterConfig, GRPOTrainConfig, validate_grpo
from es_ray.launch.compare.from_run import adopt_runs
from es_ray.launch.compare.methods import TRAINED, budget_units, grpo_placement

if TYPE_CHECKING:  # the schema imports this module (validate_compare builds every stage's config)
    from es_ray.launch.compare.config import CompareConfig


@dataclass
class Stage:
    name: str
    kind: str  # train_es | train_grpo | eval | seq_eval | drift | interpolate
    config: Callable[[], Any]
    run: Callable[[Any], dict]
    pool: int = 0
    """Training stages: the pool of the task they train on (what an epoch is); task: that task's name."""
    task: str = ""

    def dir(self, root: Path) -> Path:
        return root / "stages" / self.name


def _common(cfg: CompareConfig, model_path: str, run_dir: Path, seed: int, share: float) -> dict:
    """The sections every stage shares; ``share`` of the token or device-second budget (1, or 1/2 per half)."""
    b = cfg.budget
    stop = {
        "stop_at_tokens": int(b.tokens * share) if b.unit == "tokens" else 0,
        "stop_at_device_seconds": b.device_seconds * share if b.unit == "device_seconds" else 0.0,
    }
    return {
        "model": dataclasses.replace(cfg.model, path=model_path),
        "engine": cfg.engine,
        "run": dataclasses.replace(cfg.run, dir=str(run_dir), checkpoint_every=0, seed=seed, **stop),
    }


def _check_reachable(
    cfg: CompareConfig,
    method: str,
    samples: int,
    max_new_tokens: int,
    units: int,
    share: float,
    measured: float | None = None,
) -> None:
    """A token budget the epoch cap cannot reach (within budget.tolerance) is refused before any training: first at
    max_new_tokens per completion (before any work), then at the base model's measured mean completion length."""
    if cfg.budget.unit != "tokens":
        return
    unit = "iteration" if method == "es" else "step"
    length = max_new_tokens if measured is None else min(measured, max_new_tokens)
    reach, need = units * samples * length, cfg.budget.tokens * share * (1 - cfg.budget.tolerance)
    if reach < need:
        how = (
            f"up to {max_new_tokens} tokens per completion"
            if measured is None
            else f"about {length:.0f} tokens per completion (the base model's measured mean completion length on the "
            f"evaluation, at most {max_new_tokens})"
        )
        raise ConfigError(
            f"budget.tokens={cfg.budget.tokens}: {method} generates {samples} completions per {unit} "
            f"at {how}: about {reach:,.0f} tokens within the cap budget.epochs={cfg.budget.epochs:g} "
            f"({units} {unit}s), below {need:,.0f} (its share of the budget less "
            f"budget.tolerance={cfg.budget.tolerance:g}); raise budget.epochs or lower budget.tokens"
        )


def _held_out(cfg: CompareConfig):
    """Every training run's held-out curve samples as the final evaluation does (eval.temperature / top_p /
    max_new_tokens), so the curves end where the evaluation's pass@1 stands."""
    return HeldOutConfig(
        every=cfg.curve_every,
        temperature=cfg.eval.temperature,
        top_p=cfg.eval.top_p,
        max_new_tokens=cfg.eval.max_new_tokens,
    )


def _faults(cfg: CompareConfig, cls: type):
    return cls(**dataclasses.asdict(cfg.faults))


def _es_config(
    cfg: CompareConfig,
    model_path: str,
    run_dir: Path,
    epochs: float,
    pool: int,
    seed: int,
    measured: float | None = None,
    task: str = "",
):
    iterations = budget_units(epochs, pool, cfg.es.prompts_per_iteration)
    share = epochs / cfg.budget.epochs
    # every member generates es.samples_per_prompt completions of each prompt (the ledger counts them all)
    samples = cfg.es.population * min(cfg.es.prompts_per_iteration, pool) * cfg.es.samples_per_prompt
    _check_reachable(cfg, "es", samples, cfg.es_sampling.max_new_tokens, iterations, share, measured)
    return validate(
        ESTrainConfig(
            task=_task(cfg, task),
            es=dataclasses.replace(cfg.es, iterations=iterations),
            sampling=cfg.es_sampling,
            cluster=cfg.cluster,
            eval=_held_out(cfg),
            faults=_faults(cfg, ESFaultsConfig),
            **_common(cfg, model_path, run_dir, seed, share),
        )
    )


def _grpo_config(
    cfg: CompareConfig,
    model_path: str,
    run_dir: Path,
    epochs: float,
    pool: int,
    seed: int,
    measured: float | None = None,
    task: str = "",
):
    steps = budget_units(epochs, pool, cfg.grpo.prompts_per_step)
    share = epochs / cfg.budget.epochs
    samples = cfg.grpo.prompts_per_step * cfg.grpo.group_size
    _check_reachable(cfg, "grpo", samples, cfg.grpo_sampling.max_new_tokens, steps, share, measured)
    colocate, rollouts = grpo_placement(cfg)
    cluster = GRPOClusterConfig(**{**dataclasses.asdict(cfg.cluster), "num_actors": rollouts})
    return validate_grpo(
        GRPOTrainConfig(
            task=_task(cfg, task),
            grpo=dataclasses.replace(cfg.grpo, steps=steps, colocate=colocate),
            sampling=cfg.grpo_sampling,
            cluster=cluster,
            eval=_held_out(cfg),
            faults=cfg.faults,
            **_common(cfg, model_path, run_dir, seed, share),
        )
    )


def _task(cfg: CompareConfig, name: str):
    """The training task section of one stage: task.name, or the sequence's task ``name``."""
    return dataclasses.replace(cfg.task, name=name) if name else cfg.task


# The jobs' own modules (a driver and the runtime under it) are imported when a stage runs: es-compare's --help and
# a config error need only the configs, and start 0.3-0.5 s sooner without them.
def _run_es(train_cfg) -> dict:
    from es_ray.es.driver import run

    return run(train_cfg)


def _run_grpo(train_cfg) -> dict:
    from es_ray.grpo.driver import run

    return run(train_cfg)


def _eval_config(cfg: CompareConfig, model_path: str, run_dir: Path, seed: int, tasks: list[str] | None = None):
    ev = (
        cfg.eval
        if tasks is None
        else dataclasses.replace(
            cfg.eval, tasks=list(tasks), paths={t: p for t, p in cfg.eval.paths.items() if t in tasks}
        )
    )
    return validate_eval(
        EvalJobConfig(
            model=dataclasses.replace(cfg.model, path=model_path),
            eval=ev,
            engine=cfg.engine,
            cluster=cfg.cluster,
            faults=cfg.faults,
            run=dataclasses.replace(cfg.run, dir=str(run_dir), seed=seed),
        )
    )


def _run_eval(eval_cfg) -> dict:
    from es_ray.evaluation.es_eval import run

    return run(eval_cfg)


def _drift_config(cfg: CompareConfig, tuned: str, run_dir: Path):
    return validate_drift(
        DriftJobConfig(
            base=cfg.model.path,
            tuned=tuned,
            thresholds=list(cfg.drift_thresholds),
            run=dataclasses.replace(cfg.run, dir=str(run_dir)),
        )
    )


def _run_drift(drift_cfg) -> dict:
    from es_ray.evaluation.es_drift import run_drift

    return run_drift(drift_cfg)


PART_STAGES = {"es": (_es_config, _run_es), "grpo": (_grpo_config, _run_grpo)}
"""How each training part (``methods.PARTS``) is built: (its config from the comparison's, its run)."""


def stage_plan(
    cfg: CompareConfig, method: str, root: Path, pool: int | dict[str, int] | None = None, seed: int = 0
) -> list[Stage]:
    """The stages of one method and seed, in order: its training part(s) (per task of a sequence, each followed by
    a scoring of the tasks trained so far, but the last), its evaluation, its drift from the base. ``pool``: the
    training pool's size, or per task of the sequence."""
    suffix = f".s{seed}" if len(cfg.seeds) > 1 else ""
    stages: list[Stage] = []
    model_path = cfg.model.path
    parts = TRAINED.get(method, ())
    epochs = cfg.budget.epochs / max(1, len(parts))
    tasks = list(cfg.sequence)
    for i, task in enumerate(tasks or [""]):
        size = (pool.get(task or cfg.task.name, 0) if isinstance(pool, dict) else pool) or max(1, cfg.task.train_size)
        for part in parts:
            # A sequential method's first half is its own run (not a prefix of the one-method run), so its compute
            # is measured, not apportioned.
            name = ".".join(["train", method] + [task] * bool(task) + [part] * (len(parts) > 1)) + suffix
            run_dir, start = root / "stages" / name, model_path
            make, run_part = PART_STAGES[part]
            stages.append(
                Stage(
                    name,
                    f"train_{part}",
                    (lambda s=start, d=run_dir, f=make, n=size, t=task: f(cfg, s, d, epochs, n, seed, task=t)),
                    run_part,
                    pool=size,
                    task=task or cfg.task.name,
                )
            )
            model_path = str(run_dir / "checkpoints" / "final")
        if parts and task and i < len(tasks) - 1:  # the tasks so far, scored before the next one is trained
            d = root / "stages" / f"eval.{method}.after.{task}{suffix}"
            stages.append(
                Stage(
                    d.name,
                    "seq_eval",
                    (lambda p=model_path, d=d, t=tasks[: i + 1]: _eval_config(cfg, p, d, seed, t)),
                    _run_eval,
                    task=task,
                )
            )
    eval_dir = root / "stages" / f"eval.{method}{suffix}"
    stages.append(
        Stage(eval_dir.name, "eval", (lambda p=model_path, d=eval_dir: _eval_config(cfg, p, d, seed)), _run_eval)
    )
    if parts:
        drift_dir = root / "stages" / f"drift.{method}{suffix}"
        stages.append(
            Stage(drift_dir.name, "drift", (lambda p=model_path, d=drift_dir: _drift_config(cfg, p, d)), _run_drift)
        )
    return adopt_runs(cfg, method, stages, root) if cfg.from_run else stages


def final_weights(cfg: CompareConfig, method: str, root: Path, seed: int) -> str:
    """A method's final weights: its last training stage's final checkpoint, or "" for the base model."""
    trained = [s for s in stage_plan(cfg, method, root, seed=seed) if s.kind.startswith("train")]
    return str(trained[-1].dir(root) / "checkpoints" / "final") if trained else ""


def interpolation_plan(cfg: CompareConfig, root: Path, seed: int = 0) -> list[Stage]:
    """One es-interpolate stage per interpolate.pairs entry (after the methods' own stages): reward and pass@k along
    theta(t) between the two methods' final weights, scored as the evaluation scores (eval.*; no entropy, no KL)."""
    suffix = f".s{seed}" if len(cfg.seeds) > 1 else ""
    out = []
    for pair in cfg.interpolate.pairs:
        first, second = str(pair).split("-")
        d = root / "stages" / f"interpolate.{first}-{second}{suffix}"
        out.append(
            Stage(
                d.name,
                "interpolate",
                (lambda a=first, b=second, d=d: _interpolate_config(cfg, a, b, d, seed, root)),
                _run_interpolate,
                task=f"{first}-{second}",
            )
        )
    return out


def _interpolate_config(cfg: CompareConfig, first: str, second: str, run_dir: Path, seed: int, root: Path):
    return validate_interpolate(
        InterpolateJobConfig(
            a=final_weights(cfg, first, root, seed),
            b=final_weights(cfg, second, root, seed),
            base=cfg.model.path,
            grid=list(cfg.interpolate.grid),
            draws=cfg.interpolate.draws,
            eval=dataclasses.replace(cfg.eval, kl_base=False),
            engine=cfg.engine,
            run=dataclasses.replace(cfg.run, dir=str(run_dir), seed=seed, checkpoint_every=0),
        )
    )


def _run_interpolate(interp_cfg) -> dict:
    from es_ray.evaluation.es_interpolate import run

    return run(interp_cfg)
