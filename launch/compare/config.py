"""es-compare's configuration: the CompareConfig schema (its budget and interpolation sections) and its checks.

``validate_compare`` checks the comparison's own keys, then builds every stage's configuration once
(launch/compare/stages.py), so a key a stage refuses is refused when the command starts, not hours into a run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from es_ray.core.config import (
    ClusterConfig,
    ConfigError,
    EngineConfig,
    FaultPolicy,
    ModelConfig,
    RunConfig,
    SamplingConfig,
    TaskConfig,
    check_positive,
)
from es_ray.core.registry import Registry
from es_ray.es.config import ESConfig
from es_ray.evaluation.config import BenchmarkConfig
from es_ray.grpo.config import GRPOConfig, GRPOSamplingConfig
from es_ray.launch.compare import sensitivity
from es_ray.launch.compare.methods import METHODS
from es_ray.launch.compare.stages import interpolation_plan, stage_plan
from es_ray.launch.compare.verdict import VerdictConfig, validate_verdict
from es_ray.tasks import load_task

BUDGET_UNITS = Registry(
    "budget.unit",
    {
        "epochs": "prompts seen: passes over the training pool",
        "tokens": "tokens generated in training",
        "device_seconds": "the ledger's device-seconds of training",
    },
)


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
        raise ConfigError(
            f"eval.temperature=0 (greedy) leaves the training runs' held-out curves nothing to sample "
            f"(their pass@1 and entropy, every curve_every={cfg.curve_every} steps, are of sampled "
            "completions at eval.temperature): set eval.temperature > 0, or curve_every=0 for no "
            "curves"
        )
    if not cfg.seeds or len(set(cfg.seeds)) != len(cfg.seeds):
        raise ConfigError(f"seeds={list(cfg.seeds)}: give one or more distinct run seeds, e.g. seeds=[0,1,2]")
    if cfg.run.seed:
        raise ConfigError(
            f"run.seed={cfg.run.seed}: es-compare takes its run seeds from seeds=[...]; set "
            f"seeds=[{cfg.run.seed}] instead"
        )
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
            raise ConfigError(
                f"sequence={seq}: give two or more distinct task names in training order, e.g. "
                "sequence=[countdown,gsm8k] (or sequence=[] for one training task, task.name)"
            )
        missing = [t for t in seq if t not in cfg.eval.tasks]
        if missing:
            raise ConfigError(
                f"sequence={seq}: {missing} not in eval.tasks={list(cfg.eval.tasks)}; the final "
                f"evaluation must score every task of the sequence: add them to eval.tasks"
            )
    for pair in cfg.interpolate.pairs:
        ends = str(pair).split("-")
        if len(ends) != 2 or ends[0] == ends[1] or not all(e in cfg.methods or e == "base" for e in ends):
            raise ConfigError(
                f"interpolate.pairs: {pair!r} is not first-second of two different methods run "
                f"(methods={list(cfg.methods)}, or base), e.g. interpolate.pairs=[base-es,es-grpo]"
            )


def training_tasks(cfg: CompareConfig) -> list[str]:
    """The tasks trained on, in order: the sequence, or task.name alone."""
    return list(cfg.sequence) or [cfg.task.name]


def pool_size(cfg: CompareConfig, name: str = "") -> int:
    """The training pool's size of task ``name`` (default task.name); a held-out set that is empty while curves are
    asked for is refused here."""
    task_cfg = dataclasses.replace(cfg.task, name=name or cfg.task.name)
    task = load_task(task_cfg)
    if cfg.curve_every and not task.eval:
        raise ConfigError(
            f"task.name={task_cfg.name} with task.eval_size={cfg.task.eval_size} leaves no held-out "
            "problems, and curve_every asks for held-out curves: set task.eval_size > 0, or "
            "curve_every=0 for no curves"
        )
    return len(task.train)
