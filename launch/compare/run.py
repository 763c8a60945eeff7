"""`es-compare`: the paper's comparison in one command: base, ES, GRPO, ES->GRPO and GRPO->ES, with a report.

    es-compare experiment=cpu_demo
    es-compare experiment=paper_easy model=qwen2.5-1.5b cluster=gpu8 run.dir=/shared/runs/cmp-qwen
    es-compare experiment=cpu_demo methods=[base,es] budget.epochs=4 run.dir=/abs/cmp

Budgets are matched by the number of training prompts seen, in epochs over the training pool (the paper's
unit): ES runs ``epochs * pool / es.prompts_per_iteration`` iterations, GRPO ``epochs * pool /
grpo.prompts_per_step`` steps; in ES->GRPO and GRPO->ES each half gets half the epochs and the second starts from
the first's final checkpoint. With budget.unit=tokens or device_seconds each run stops at the step landing
closest to its budget, and the report says what each reached (matched only within budget.tolerance). Every
method is evaluated with the same es-eval settings (tasks, n, k, sampling, seed) and compared with the base
weights (es-drift).

The work is cut into stages (a training run, an evaluation, a drift report), each in its own directory under
``run.dir/stages``; a finished stage writes ``done.json`` and is never run again, so repeating the command after an
interruption finishes only what is missing (a stage cut off midway is started again from its beginning). Training
and evaluation run as Ray actors on the cluster (``cluster.address``), exactly as es-train, grpo-train and
es-eval do; this process only orchestrates and writes report.md, report.json and the plots.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from es_ray.es.config import ESConfig
from es_ray.evaluation.config import BenchmarkConfig
from es_ray.core.config import (ClusterConfig, ConfigError, EngineConfig, FaultPolicy, ModelConfig, RunConfig,
                                SamplingConfig, TaskConfig, check_positive)
from es_ray.core.registry import Registry
from es_ray.runtime.rundir import RESULT_NEUTRAL, changed_settings
from es_ray.grpo.config import GRPOConfig, GRPOSamplingConfig
from es_ray.launch.compare import sensitivity
from es_ray.launch.compare.from_run import adopt_runs
from es_ray.launch.compare.methods import METHODS, TRAINED, budget_units, grpo_placement
from es_ray.launch.compare.verdict import VerdictConfig, validate_verdict

BUDGET_UNITS = Registry("budget.unit", {
    "epochs": "prompts seen: passes over the training pool", "tokens": "tokens generated in training",
    "device_seconds": "the ledger's device-seconds of training"})


@dataclass
class BudgetConfig:
    unit: str = "epochs"
    """What the methods are matched on: epochs (prompts seen), tokens (tokens generated in training) or
    device_seconds (the ledger's device-seconds); sequential methods get half per part."""
    epochs: float = 4.0
    """unit=epochs: passes over the training pool per method. Otherwise the most any method may run (a cap)."""
    tokens: int = 0
    """unit=tokens: training tokens generated per method."""
    device_seconds: float = 0.0
    """unit=device_seconds: training device-seconds per method (GPU-seconds, or core-seconds on CPU-only actors;
    start-up, checkpoint writes and held-out scoring are counted apart)."""
    tolerance: float = 0.1
    """unit=tokens/device_seconds: the report calls a method's budget matched when what it reached lies within this
    fraction of the budget (each run stops at the step that lands closest to it)."""


@dataclass
class InterpolationConfig:
    """es-interpolate along the straight paths between the methods' final weights (docs/comparison.md)."""

    pairs: list[str] = field(default_factory=list)
    """Paths to score after the evaluations, each first-second of the methods run (base: the base weights), e.g.
    [base-es, base-grpo, es-grpo]; every seed gets its own. Empty: none."""
    grid: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    """The t of theta(t) = (1 - t) theta_first + t theta_second scored, 0 and 1 among them."""
    draws: int = 2000
    """Bootstrap resamples of the problems for each barrier's interval."""


@dataclass
class CompareConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The base model every method starts from."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The training task (its pool of task.train_size prompts defines an epoch)."""
    es: ESConfig = field(default_factory=ESConfig)
    """ES settings; es.iterations is set from the budget."""
    es_sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """ES training generation (greedy by default, as in es-train)."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """GRPO settings (grpo.config.GRPOConfig); grpo.steps is set from the budget."""
    grpo_sampling: GRPOSamplingConfig = field(default_factory=GRPOSamplingConfig)
    """GRPO training generation (sampled: groups need variance)."""
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    """Which of base, es, grpo, es_grpo, grpo_es to run (the report covers those run)."""
    seeds: list[int] = field(default_factory=lambda: [0])
    """Run seeds: every method is trained and evaluated once per seed (stages named <stage>.s<seed> when there are
    several); the paired tests treat each method's seeds as its training variance (run.seed is unused). One seed (the
    default, so the CPU demo stays short) compares two checkpoints and supports no method-level claim; the paper
    presets use [0, 1, 2]."""
    eval: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    """Evaluation of every method (es-eval's eval section)."""
    drift_thresholds: list[float] = field(default_factory=lambda: [1.0e-3, 1.5e-3, 2.0e-3])
    """Functional-sparsity thresholds on |delta| (es-drift's thresholds)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """cluster.num_actors: ES actors and evaluation actors; resources per actor for every stage."""
    curve_every: int = 2
    """Every training stage scores the held-out set every k iterations / steps (greedy reward, sampled pass@1 and
    entropy: es-train's and grpo-train's eval.every); the report plots pass@1 and entropy over training for every
    method (training_curves.png). 0: no curve."""
    grpo_rollout_actors: int = 1
    """GRPO rollout actors (GRPO also starts one learner actor with the same resources)."""
    run: RunConfig = field(default_factory=RunConfig)
    """run.dir: the comparison's directory (absolute; repeat the command with the same run.dir to resume)."""
    faults: FaultPolicy = field(default_factory=FaultPolicy)
    """Actor timeout and replacements, for every stage."""
    sequence: list[str] = field(default_factory=list)
    """A task sequence, e.g. [countdown, gsm8k]: every trained method trains on each task in order (the budget per
    task; the next task starts from the last one's final weights), and after each task but the last its weights are
    scored on the tasks trained so far, so the report shows the held-out score on every earlier task after each
    stage (forgetting, with paired intervals; docs/comparison.md). Every task must be in eval.tasks (the final
    evaluation scores them all after the last). Empty: one training task, task.name."""
    interpolate: InterpolationConfig = field(default_factory=InterpolationConfig)
    """es-interpolate between the methods' final weights (interpolate.pairs; none by default)."""
    verdict: VerdictConfig = field(default_factory=VerdictConfig)
    """The primary family the verdict tests, declared before training (verdict.primary, verdict.margin)."""
    sensitivity: sensitivity.SensitivityConfig = field(default_factory=sensitivity.SensitivityConfig)
    """Short runs at other step sizes after the main stages (sensitivity.grpo.lr=[...], sensitivity.es.sigma=[...],
    sensitivity.es.lr=[...]): whether the verdict survives the published range (launch/compare/sensitivity.py)."""
    from_run: dict[str, str] = field(default_factory=dict)
    """Methods taken from runs already trained, e.g. +from_run.es=/abs/es_run: that finished es-train (grpo-train)
    run, checked against the stage this comparison would train (launch/compare/from_run.py), stands in for it."""


def validate_compare(cfg: CompareConfig) -> CompareConfig:
    unknown = [m for m in cfg.methods if m not in METHODS]
    if unknown or not cfg.methods:  # a list: one message for every unknown name
        raise ConfigError(f"methods={list(cfg.methods)}: choose from {', '.join(METHODS)} (at least one)")
    BUDGET_UNITS.check(cfg.budget.unit)
    check_positive("budget.epochs", cfg.budget.epochs)
    if cfg.budget.unit != "epochs":
        check_positive(f"budget.{cfg.budget.unit}", getattr(cfg.budget, cfg.budget.unit))
    if not 0 < cfg.budget.tolerance < 1:
        raise ConfigError(f"budget.tolerance={cfg.budget.tolerance}: give a fraction in (0, 1), e.g. 0.1")
    check_positive("grpo_rollout_actors", cfg.grpo_rollout_actors)
    check_positive("curve_every", cfg.curve_every, allow_zero=True)
    if cfg.curve_every and cfg.eval.temperature == 0:  # the curves sample as the evaluation does (``_held_out``)
        raise ConfigError(f"eval.temperature=0 (greedy) leaves the training runs' held-out curves nothing to sample "
                          f"(their pass@1 and entropy, every curve_every={cfg.curve_every} steps, are of sampled "
                          "completions at eval.temperature): set eval.temperature > 0, or curve_every=0 for no "
                          "curves")
    if not cfg.seeds or len(set(cfg.seeds)) != len(cfg.seeds):
        raise ConfigError(f"seeds={list(cfg.seeds)}: give one or more distinct run seeds, e.g. seeds=[0,1,2]")
    if cfg.run.seed:
        raise ConfigError(f"run.seed={cfg.run.seed}: es-compare takes its run seeds from seeds=[...]; set "
                          f"seeds=[{cfg.run.seed}] instead")
    validate_sequence(cfg)
    validate_verdict(cfg)
    sensitivity.validate_sensitivity(cfg)
    for method in cfg.methods:  # each stage's own validation: build every stage's config once
        for spec in stage_plan(cfg, method, Path("/tmp"), seed=cfg.seeds[0]):
            spec.config()
    for spec in interpolation_plan(cfg, Path("/tmp"), seed=cfg.seeds[0]):
        spec.config()
    return cfg


def validate_sequence(cfg: CompareConfig) -> None:
    """A task sequence names two or more distinct tasks, each scored by the final evaluation; interpolation pairs
    name two different methods that are run."""
    seq = list(cfg.sequence)
    if seq:
        if len(seq) < 2 or len(set(seq)) != len(seq) or not all(isinstance(t, str) and t.strip() for t in seq):
            raise ConfigError(f"sequence={seq}: give two or more distinct task names in training order, e.g. "
                              "sequence=[countdown,gsm8k] (or sequence=[] for one training task, task.name)")
        missing = [t for t in seq if t not in cfg.eval.tasks]
        if missing:
            raise ConfigError(f"sequence={seq}: {missing} not in eval.tasks={list(cfg.eval.tasks)}; the final "
                              f"evaluation must score every task of the sequence: add them to eval.tasks")
    for pair in cfg.interpolate.pairs:
        ends = str(pair).split("-")
        if len(ends) != 2 or ends[0] == ends[1] or not all(e in cfg.methods or e == "base" for e in ends):
            raise ConfigError(f"interpolate.pairs: {pair!r} is not first-second of two different methods run "
                              f"(methods={list(cfg.methods)}, or base), e.g. interpolate.pairs=[base-es,es-grpo]")


def check_stage_memory(cfg: CompareConfig) -> None:
    """Every stage's memory plan against the devices it will run on, before any work (run dir, model, Ray). Not part
    of validate_compare: a preset composes on any machine; it is the run that must fit the one it starts on."""
    from es_ray.memory_plan import model_shape, startup_check

    shape = model_shape(cfg.model.path)  # later stages start from checkpoints of the same shape
    if shape is None:
        return
    for method in cfg.methods:
        for spec in stage_plan(cfg, method, Path("/tmp"), seed=cfg.seeds[0]):
            kind = {"train_es": "es", "train_grpo": "grpo", "eval": "eval", "seq_eval": "eval"}.get(spec.kind)
            if kind:
                startup_check(kind, spec.config(), shape=shape)


def training_tasks(cfg: CompareConfig) -> list[str]:
    """The tasks trained on, in order: the sequence, or task.name alone."""
    return list(cfg.sequence) or [cfg.task.name]


def pool_size(cfg: CompareConfig, name: str = "") -> int:
    """The training pool's size of task ``name`` (default task.name); a held-out set that is empty while curves are
    asked for is refused here."""
    from es_ray.tasks import load_task

    task_cfg = dataclasses.replace(cfg.task, name=name or cfg.task.name)
    task = load_task(task_cfg)
    if cfg.curve_every and not task.eval:
        raise ConfigError(f"task.name={task_cfg.name} with task.eval_size={cfg.task.eval_size} leaves no held-out "
                          "problems, and curve_every asks for held-out curves: set task.eval_size > 0, or "
                          "curve_every=0 for no curves")
    return len(task.train)


# -- stages -----------------------------------------------------------------------------------------------------


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
    stop = {"stop_at_tokens": int(b.tokens * share) if b.unit == "tokens" else 0,
            "stop_at_device_seconds": b.device_seconds * share if b.unit == "device_seconds" else 0.0}
    return {"model": dataclasses.replace(cfg.model, path=model_path), "engine": cfg.engine,
            "run": dataclasses.replace(cfg.run, dir=str(run_dir), checkpoint_every=0, seed=seed, **stop)}


def _check_reachable(cfg: CompareConfig, method: str, samples: int, max_new_tokens: int, units: int, share: float,
                     measured: float | None = None) -> None:
    """A token budget the epoch cap cannot reach (within budget.tolerance) is refused before any training: first at
    max_new_tokens per completion (before any work), then at the base model's measured mean completion length."""
    if cfg.budget.unit != "tokens":
        return
    unit = "iteration" if method == "es" else "step"
    length = max_new_tokens if measured is None else min(measured, max_new_tokens)
    reach, need = units * samples * length, cfg.budget.tokens * share * (1 - cfg.budget.tolerance)
    if reach < need:
        how = (f"up to {max_new_tokens} tokens per completion" if measured is None else
               f"about {length:.0f} tokens per completion (the base model's measured mean completion length on the "
               f"evaluation, at most {max_new_tokens})")
        raise ConfigError(f"budget.tokens={cfg.budget.tokens}: {method} generates {samples} completions per {unit} "
                          f"at {how}: about {reach:,.0f} tokens within the cap budget.epochs={cfg.budget.epochs:g} "
                          f"({units} {unit}s), below {need:,.0f} (its share of the budget less "
                          f"budget.tolerance={cfg.budget.tolerance:g}); raise budget.epochs or lower budget.tokens")


def _held_out(cfg: CompareConfig):
    """Every training run's held-out curve samples as the final evaluation does (eval.temperature / top_p /
    max_new_tokens), so the curves end where the evaluation's pass@1 stands."""
    from es_ray.core.config import HeldOutConfig

    return HeldOutConfig(every=cfg.curve_every, temperature=cfg.eval.temperature, top_p=cfg.eval.top_p,
                         max_new_tokens=cfg.eval.max_new_tokens)


def _faults(cfg: CompareConfig, cls: type):
    return cls(**dataclasses.asdict(cfg.faults))


def _es_config(cfg: CompareConfig, model_path: str, run_dir: Path, epochs: float, pool: int, seed: int,
               measured: float | None = None, task: str = ""):
    from es_ray.es.config import ESFaultsConfig, ESTrainConfig, validate

    iterations = budget_units(epochs, pool, cfg.es.prompts_per_iteration)
    share = epochs / cfg.budget.epochs
    # every member generates es.samples_per_prompt completions of each prompt (the ledger counts them all)
    samples = cfg.es.population * min(cfg.es.prompts_per_iteration, pool) * cfg.es.samples_per_prompt
    _check_reachable(cfg, "es", samples, cfg.es_sampling.max_new_tokens, iterations, share, measured)
    return validate(ESTrainConfig(task=_task(cfg, task), es=dataclasses.replace(cfg.es, iterations=iterations),
                                  sampling=cfg.es_sampling, cluster=cfg.cluster,
                                  eval=_held_out(cfg),
                                  faults=_faults(cfg, ESFaultsConfig),
                                  **_common(cfg, model_path, run_dir, seed, share)))


def _grpo_config(cfg: CompareConfig, model_path: str, run_dir: Path, epochs: float, pool: int, seed: int,
                 measured: float | None = None, task: str = ""):
    from es_ray.grpo.config import GRPOClusterConfig, GRPOTrainConfig, validate_grpo

    steps = budget_units(epochs, pool, cfg.grpo.prompts_per_step)
    share = epochs / cfg.budget.epochs
    samples = cfg.grpo.prompts_per_step * cfg.grpo.group_size
    _check_reachable(cfg, "grpo", samples, cfg.grpo_sampling.max_new_tokens, steps, share, measured)
    colocate, rollouts = grpo_placement(cfg)
    cluster = GRPOClusterConfig(**{**dataclasses.asdict(cfg.cluster), "num_actors": rollouts})
    return validate_grpo(GRPOTrainConfig(task=_task(cfg, task), grpo=dataclasses.replace(cfg.grpo, steps=steps,
                                                                                  colocate=colocate),
                                         sampling=cfg.grpo_sampling, cluster=cluster,
                                         eval=_held_out(cfg),
                                         faults=cfg.faults, **_common(cfg, model_path, run_dir, seed, share)))


def _task(cfg: CompareConfig, name: str):
    """The training task section of one stage: task.name, or the sequence's task ``name``."""
    return dataclasses.replace(cfg.task, name=name) if name else cfg.task


def _run_es(train_cfg) -> dict:
    from es_ray.es.driver import run

    return run(train_cfg)


def _run_grpo(train_cfg) -> dict:
    from es_ray.grpo.driver import run

    return run(train_cfg)


def _eval_config(cfg: CompareConfig, model_path: str, run_dir: Path, seed: int, tasks: list[str] | None = None):
    from es_ray.evaluation.config import EvalJobConfig, validate_eval

    ev = cfg.eval if tasks is None else dataclasses.replace(
        cfg.eval, tasks=list(tasks), paths={t: p for t, p in cfg.eval.paths.items() if t in tasks})
    return validate_eval(EvalJobConfig(model=dataclasses.replace(cfg.model, path=model_path), eval=ev,
                                       engine=cfg.engine, cluster=cfg.cluster, faults=cfg.faults,
                                       run=dataclasses.replace(cfg.run, dir=str(run_dir), seed=seed)))


def _run_eval(eval_cfg) -> dict:
    from es_ray.evaluation.es_eval import run

    return run(eval_cfg)


def _drift_config(cfg: CompareConfig, tuned: str, run_dir: Path):
    from es_ray.evaluation.config import DriftJobConfig, validate_drift

    return validate_drift(DriftJobConfig(base=cfg.model.path, tuned=tuned, thresholds=list(cfg.drift_thresholds),
                                         run=dataclasses.replace(cfg.run, dir=str(run_dir))))


def _run_drift(drift_cfg) -> dict:
    from es_ray.evaluation.es_drift import run_drift

    return run_drift(drift_cfg)


PART_STAGES = {"es": (_es_config, _run_es), "grpo": (_grpo_config, _run_grpo)}
"""How each training part (``methods.PARTS``) is built: (its config from the comparison's, its run)."""


def stage_plan(cfg: CompareConfig, method: str, root: Path, pool: int | dict[str, int] | None = None,
               seed: int = 0) -> list[Stage]:
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
            stages.append(Stage(name, f"train_{part}",
                                (lambda s=start, d=run_dir, f=make, n=size, t=task: f(cfg, s, d, epochs, n, seed,
                                                                                       task=t)),
                                run_part, pool=size, task=task or cfg.task.name))
            model_path = str(run_dir / "checkpoints" / "final")
        if parts and task and i < len(tasks) - 1:  # the tasks so far, scored before the next one is trained
            d = root / "stages" / f"eval.{method}.after.{task}{suffix}"
            stages.append(Stage(d.name, "seq_eval", (lambda p=model_path, d=d, t=tasks[:i + 1]:
                                                     _eval_config(cfg, p, d, seed, t)), _run_eval, task=task))
    eval_dir = root / "stages" / f"eval.{method}{suffix}"
    stages.append(Stage(eval_dir.name, "eval", (lambda p=model_path, d=eval_dir: _eval_config(cfg, p, d, seed)),
                        _run_eval))
    if parts:
        drift_dir = root / "stages" / f"drift.{method}{suffix}"
        stages.append(Stage(drift_dir.name, "drift", (lambda p=model_path, d=drift_dir: _drift_config(cfg, p, d)),
                            _run_drift))
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
        out.append(Stage(d.name, "interpolate",
                         (lambda a=first, b=second, d=d: _interpolate_config(cfg, a, b, d, seed, root)),
                         _run_interpolate, task=f"{first}-{second}"))
    return out


def _interpolate_config(cfg: CompareConfig, first: str, second: str, run_dir: Path, seed: int, root: Path):
    from es_ray.evaluation.config import InterpolateJobConfig, validate_interpolate

    return validate_interpolate(InterpolateJobConfig(
        a=final_weights(cfg, first, root, seed), b=final_weights(cfg, second, root, seed), base=cfg.model.path,
        grid=list(cfg.interpolate.grid), draws=cfg.interpolate.draws,
        eval=dataclasses.replace(cfg.eval, kl_base=False), engine=cfg.engine,
        run=dataclasses.replace(cfg.run, dir=str(run_dir), seed=seed, checkpoint_every=0)))


def _run_interpolate(interp_cfg) -> dict:
    from es_ray.evaluation.es_interpolate import run

    return run(interp_cfg)


def _json_safe(x):
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x if isinstance(x, (str, int, float, bool)) or x is None else str(x)


def run_stage(stage: Stage, root: Path, log: Callable[[str], None]) -> dict:
    """Run one stage unless its done.json exists; a directory without it is a cut-off attempt and is cleared."""
    d = stage.dir(root)
    done = d / "done.json"
    settings = stage_settings(stage.config())
    record = done_record(stage, root, settings)
    if record is not None:
        log(f"{stage.name}: done earlier, skipped")
        return record
    if d.exists():
        log(f"{stage.name}: an earlier attempt did not finish; starting it again")
        shutil.rmtree(d)
    log(f"{stage.name}: running")
    t0 = time.perf_counter()
    out = stage.run(stage.config())
    record = {"stage": stage.name, "kind": stage.kind, "seconds": time.perf_counter() - t0,
              "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "result": _json_safe(_stage_result(stage, out)),
              "settings": settings}
    tmp = d / "done.json.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(done)
    log(f"{stage.name}: finished in {record['seconds']:.0f} s")
    return record


def done_record(stage: Stage, root: Path, settings: dict | None = None) -> dict | None:
    """The stage's done.json (None: not done); one done with other settings than this command's is refused."""
    done = stage.dir(root) / "done.json"
    if not done.is_file():
        return None
    record = json.loads(done.read_text())
    now = stage_settings(stage.config()) if settings is None else settings
    # a record without settings (written before they were kept) is trusted as it is; a key only one side has is a
    # change (a stage's settings come from one version of this code)
    before = record.get("settings")
    changed = [] if before is None else changed_settings(before, now, RESULT_NEUTRAL, missing=True)
    if changed:
        raise ConfigError(
            f"{stage.name} in {root} was done with other settings ({', '.join(changed[:8])}); its results would "
            f"not match this command. Use a new run.dir (or run.overwrite=true to move this comparison aside), or "
            f"delete {stage.dir(root)} to redo that stage (and the stages after it that use its checkpoint)")
    return record


def claim_compare_dir(root: Path, cfg: CompareConfig, log: Callable[[str], None]) -> None:
    """Repeating a comparison's command continues it (its finished stages are checked against this command before
    any work: ``done_record``); run.overwrite=true moves an earlier comparison aside first, and a run.dir holding
    another kind of run is refused."""
    from es_ray.runtime.rundir import claim_run_dir, move_aside

    if not (root / "compare_config.json").is_file():
        claim_run_dir(root, cfg.run.overwrite, "compare")  # an es-train/grpo-train/es-eval run there
    elif cfg.run.overwrite:
        log(f"es-compare: run.overwrite=true: the comparison that was in {root} is now in {move_aside(root)}")


def stage_settings(stage_cfg) -> dict:
    """The stage's full configuration, flattened to dotted keys, without the keys that cannot change results."""
    flat: dict = {}

    def walk(prefix: str, x) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = x

    walk("", _json_safe(dataclasses.asdict(stage_cfg)))
    return {k: v for k, v in flat.items() if k not in RESULT_NEUTRAL and not k.startswith("faults.")}


def _stage_result(stage: Stage, out: dict) -> dict:
    if stage.kind.startswith("train"):
        return {"run_dir": out.get("run_dir"), "final_checkpoint": out.get("final_checkpoint")}
    return {"run_dir": out.get("run_dir")}


def run(cfg: CompareConfig, log: Callable[[str], None] = print) -> dict:
    from es_ray.runtime.cluster import connect
    from es_ray.runtime.tracking import log_summary
    from es_ray.launch.compare.report import write_report
    from es_ray.models import resolve_model

    if not cfg.run.dir:
        raise ConfigError("run.dir= is required: the comparison's absolute directory (repeat the command with the "
                          "same run.dir to resume it)")
    root = Path(cfg.run.dir).expanduser().resolve()
    check_stage_memory(cfg)
    claim_compare_dir(root, cfg, log)
    root.mkdir(parents=True, exist_ok=True)
    resolve_model(cfg.model.path)  # converts the embedded model once, before any stage starts
    pools = {t: pool_size(cfg, t) for t in training_tasks(cfg)}
    pool = pools[training_tasks(cfg)[0]]
    plan = {m: {s: stage_plan(cfg, m, root, pools, s) for s in cfg.seeds} for m in cfg.methods}
    paths = {s: interpolation_plan(cfg, root, s) for s in cfg.seeds}
    sens = sensitivity.plan(cfg, root, pools, stage_plan)  # short runs at other step sizes, after the report
    every = [st for by_seed in plan.values() for stages in by_seed.values() for st in stages]
    for stage in every + [st for stages in paths.values() for st in stages]:
        done_record(stage, root)  # a finished stage with other settings: refused before any work
    for _, vroot, stages in sens:
        for stage in stages:
            done_record(stage, vroot)
    (root / "compare_config.json").write_text(json.dumps(_json_safe(dataclasses.asdict(cfg)), indent=2))
    connect(cfg.cluster)
    # seed by seed, so an interrupted comparison has whole seeds; a seed's paths after its methods' stages
    order = [st for seed in cfg.seeds for st in [st for m in cfg.methods for st in plan[m][seed]] + paths[seed]]
    if "base" in plan:  # the base evaluation first, to measure completion lengths
        first = plan["base"][cfg.seeds[0]]
        order = first + [st for st in order if st not in first]
    checked = "base" not in plan or cfg.budget.unit != "tokens"
    for i, stage in enumerate(order):
        if stage.kind.startswith("train") and not checked:
            measured = check_reach_measured(cfg, root, plan, pools)
            log(f"es-compare: budget.tokens={cfg.budget.tokens} reachable by every method at the base model's "
                f"measured {measured:.1f} tokens per completion")
            checked = True
        run_stage(stage, root, lambda line, i=i: log(f"es-compare: stage {i + 1}/{len(order)} {line}"))
    report = write_report(root, cfg, plan, pool, paths)
    report["sensitivity"] = sensitivity.run(cfg, sens, report, root, log, run_stage)
    log_summary(root, cfg, tracker_metrics(report), "es-compare")
    log(f"es-compare: done; report in {root / 'report.md'} (report.json and the plots beside it)")
    return report


def check_reach_measured(cfg: CompareConfig, root: Path, plan: dict, pools: dict[str, int]) -> float:
    """The token budget's reachability at the base model's measured mean completion length (its evaluation's
    results.json), before any training; returns that length. ``pools``: each training task's pool."""
    res = json.loads((plan["base"][cfg.seeds[0]][-1].dir(root) / "results.json").read_text())
    lengths = [t["tokens"]["mean_per_completion"] for t in res["tasks"].values()]
    measured = sum(lengths) / len(lengths)
    for method in cfg.methods:
        parts = TRAINED.get(method, ())
        for part in parts:
            make = PART_STAGES[part][0]
            for task in cfg.sequence or [""]:
                make(cfg, cfg.model.path, root / "stages" / "check", cfg.budget.epochs / len(parts),
                     pools[task or cfg.task.name], cfg.seeds[0], measured, task=task)
    return measured


_LEDGER_METRICS = ("tokens_generated", "tokens_backpropagated", "wall_s", "startup_s", "device_s",
                   "peak_rss_bytes_max", "peak_gpu_bytes_max")


def tracker_metrics(report: dict) -> dict[str, float]:
    """The report's numbers per method under the names every tracker gets: compare/<method>/pass_at_<k> (mean over
    the tasks), entropy, drift_l2, the measured ledger and (eval.kl_base) kl_base_tuned / kl_tuned_base (mean over
    the tasks)."""
    out = {}
    for method, m in report["methods"].items():
        out.update({f"compare/{method}/pass_at_{k}": v for k, v in m["average"].items()})
        out[f"compare/{method}/entropy"] = m["entropy"]["mean_per_token"]
        out[f"compare/{method}/drift_l2"] = (m.get("drift") or {}).get("l2")
        out.update({f"compare/{method}/{k}": (m["ledger"] or {}).get(k) for k in _LEDGER_METRICS})
    for method, by_task in ((report.get("kl") or {}).get("methods") or {}).items():  # eval.kl_base: over the tasks
        for d in ("base_tuned", "tuned_base"):
            v = [c[d]["mean"] for c in by_task.values() if c[d]["mean"] is not None]
            out[f"compare/{method}/kl_{d}"] = sum(v) / len(v) if v else None
    return {k: v for k, v in out.items() if v is not None}


# -- entry point ------------------------------------------------------------------------------------------------


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="es_compare_schema", node=CompareConfig)


def to_compare_config(dict_cfg: Any) -> CompareConfig:
    from es_ray.core.config import to_config

    return validate_compare(to_config(dict_cfg, CompareConfig))


def _main(dict_cfg) -> None:
    from es_ray.runtime.entry import run_or_exit

    run_or_exit("es-compare", lambda: run(to_compare_config(dict_cfg)))  # its last line names the report


def plan_main(dict_cfg) -> None:
    """es-compare --plan: the primary family's seeds, problems and compute (launch/compare/plan.py), no spend."""
    from es_ray.launch.compare.plan import plan
    from es_ray.runtime.entry import run_or_exit

    run_or_exit("es-compare --plan", lambda: plan(to_compare_config(dict_cfg)))


def main() -> None:
    import sys

    from es_ray.runtime.entry import hydra_main

    if "--plan" in sys.argv[1:]:  # the seeds, problems and compute the primary family needs, before any spend
        sys.argv.remove("--plan")
        return hydra_main("es_compare", plan_main, "es-compare --plan", register_configs)
    hydra_main("es_compare", _main, "es-compare", register_configs)


if __name__ == "__main__":
    main()
