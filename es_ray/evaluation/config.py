"""Configuration of es-eval (``EvalJobConfig``, its `eval` section ``BenchmarkConfig``) and es-drift
(``DriftJobConfig``). The shared sections are the runtime's."""

from __future__ import annotations

from dataclasses import dataclass, field

from es_ray.core.config import (
    ClusterConfig,
    ConfigError,
    EngineConfig,
    FaultPolicy,
    ModelConfig,
    RunConfig,
    check_positive,
    to_config,
    validate_faults,
)
from es_ray.core.registry import Registry
from es_ray.runtime.validation import validate_cluster, validate_engine, validate_run
from es_ray.grading.boxed import ANSWER_MODES
from es_ray.tasks import EVAL_TASKS, TASKS

# Hydra's ConfigStore is imported by register_configs only: the schema converts and checks without Hydra.


# Hub datasets that need their terms accepted (and a token) before they download: not in the default task list.
GATED_TASKS = ("gpqa",)
DEFAULT_EVAL_TASKS = tuple(t for t in EVAL_TASKS if t not in GATED_TASKS)

CAST_DTYPES = Registry(
    "cast_dtype", {"bfloat16": "what a bf16 GPU engine holds", "float16": "fp16", "float32": "fp32 (no cast)"}
)
"""es-drift's cast_dtype (empty: fp32 only)."""


@dataclass
class BenchmarkConfig:
    """es-eval's `eval` section: which benchmarks, how many samples, how they are sampled and graded."""

    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_EVAL_TASKS))
    """Tasks to evaluate (any task.name; default: the paper's eight evaluation sets less the gated GPQA, which needs
    its terms accepted on the Hub first: then add it, eval.tasks=[gpqa,mbpp,...], or give a local copy with
    +eval.paths.gpqa=/abs/gpqa_diamond.jsonl)."""
    n: int = 32
    """Samples per problem (must be >= max(k))."""
    k: list[int] = field(default_factory=lambda: [1, 16, 32])
    """pass@k and maj@k are reported for each k."""
    temperature: float = 0.6
    """Sampling temperature (0 is greedy, which only makes sense with n=1)."""
    top_p: float = 0.95
    """Nucleus sampling of the evaluation (the paper's 0.95)."""
    max_new_tokens: int = 1024
    """Tokens per completion at most; one that hits it without an answer scores 0."""
    limit: int = 0
    """Problems per task, the first ones in dataset order (0: all)."""
    data_dir: str = ""
    """Directory of local files named <task>.jsonl (or .json/.parquet/.csv) in each hub schema; empty: the hub."""
    paths: dict[str, str] = field(default_factory=dict)
    """Per-task local file, overriding data_dir: +eval.paths.gpqa=/data/gpqa_diamond.jsonl"""
    answer: str = "boxed"
    """Math tasks: boxed (only the final \\boxed{} answer counts, as the prompts ask) or last (lenient: the final box
    when there is one, else math-verify takes the last expression). Either way results count correct samples
    without a box and restating ones."""
    entropy: bool = True
    """Token entropy of the completions from a teacher-forced forward pass (one extra forward per completion)."""
    save_samples: bool = True
    """Write every completion with its grade to samples.jsonl."""
    chunk_size: int = 0
    """Completions per generation call (0: engine.batch_size); chunks are the unit spread over the actors."""
    math_timeout_s: float = 10.0
    """Per-answer math-verify time limit (the worker is killed past it; the sample scores 0, counted)."""
    code_timeout_s: float = 10.0
    """MBPP: wall-clock limit per program (CPU limit: the same, rounded up)."""
    code_memory_mb: int = 1024
    """MBPP: address-space limit per program."""
    grader_workers: int = 2
    """Grader processes per actor (math-verify workers; concurrent sandboxed programs)."""
    kl_base: bool = False
    """Off-task KL: per task, the per-token KL between eval.kl_reference (the base) and this model, both directions,
    of the distributions sampled at eval.temperature and eval.top_p, over the reference's own samples on the task's
    prompts (es_ray.metrics.kl; docs/evaluation.md "Off-task KL")."""
    kl_reference: str = ""
    """eval.kl_base: the reference model (HF directory, hub id, or empty for the embedded SmolLM2-135M-Instruct)."""
    kl_samples: int = 4
    """eval.kl_base: the reference model's samples per problem the KL is measured over."""


@dataclass
class EvalJobConfig:
    """es-eval's schema."""

    model: ModelConfig = field(default_factory=ModelConfig)
    eval: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """cluster.num_actors: generation actors (0: in this process, without Ray; also chosen where one actor on a
    local Ray would do all the work, ``es_eval.in_process_reason``)."""
    run: RunConfig = field(default_factory=RunConfig)
    """run.dir for results (absolute); run.seed fixes the sampling."""
    faults: FaultPolicy = field(default_factory=FaultPolicy)
    """How long an evaluation actor may stay silent, and how many dead ones are replaced."""


def validate_eval(cfg: EvalJobConfig) -> EvalJobConfig:
    ev = cfg.eval
    if not ev.tasks:
        raise ConfigError("eval.tasks is empty; list at least one task, e.g. eval.tasks=[gsm8k]")
    for name in ev.tasks:
        if ":" not in name:
            TASKS.check(name, "eval.tasks")
    ANSWER_MODES.check(ev.answer, "eval.answer")
    check_positive("eval.n", ev.n)
    if not ev.k or any(k < 1 for k in ev.k):
        raise ConfigError(f"eval.k={list(ev.k)} must be a non-empty list of integers >= 1, e.g. eval.k=[1,16,32]")
    if max(ev.k) > ev.n:
        raise ConfigError(
            f"eval.k={list(ev.k)} needs eval.n >= {max(ev.k)} samples per problem (eval.n={ev.n}); "
            f"raise eval.n or drop k > {ev.n}"
        )
    check_positive("eval.temperature", ev.temperature, allow_zero=True)
    if ev.temperature == 0 and ev.n > 1:
        raise ConfigError(
            f"eval.temperature=0 is greedy decoding: all eval.n={ev.n} samples would be identical; "
            "set eval.temperature > 0 or eval.n=1 eval.k=[1]"
        )
    if not 0 < ev.top_p <= 1:
        raise ConfigError(f"eval.top_p={ev.top_p} must be in (0, 1]")
    check_positive("eval.max_new_tokens", ev.max_new_tokens)
    check_positive("eval.limit", ev.limit, allow_zero=True)
    check_positive("eval.chunk_size", ev.chunk_size, allow_zero=True)
    check_positive("eval.math_timeout_s", ev.math_timeout_s)
    check_positive("eval.code_timeout_s", ev.code_timeout_s)
    check_positive("eval.code_memory_mb", ev.code_memory_mb)
    check_positive("eval.grader_workers", ev.grader_workers)
    check_positive("eval.kl_samples", ev.kl_samples)
    if ev.kl_base and ev.temperature == 0:
        raise ConfigError(
            "eval.kl_base=true compares sampled distributions, and eval.temperature=0 samples none; set "
            "eval.temperature > 0 (e.g. 0.6)"
        )
    unknown = sorted(set(ev.paths) - set(ev.tasks))
    if unknown:
        raise ConfigError(f"eval.paths names tasks not in eval.tasks: {unknown}")
    validate_engine(cfg.engine)
    validate_cluster(cfg.cluster, cfg.engine, allow_zero_actors=True)
    validate_run(cfg.run)
    validate_faults(cfg.faults)
    return cfg


@dataclass
class DriftJobConfig:
    """es-drift's schema."""

    base: str = ""
    """The reference checkpoint: HF directory, hub id, or empty for the embedded SmolLM2-135M-Instruct."""
    tuned: str = ""
    """The checkpoint compared with it (e.g. runs/es-.../checkpoints/final)."""
    thresholds: list[float] = field(default_factory=lambda: [1.0e-3, 1.5e-3, 2.0e-3])
    """Share of non-zero updates with |delta| below each threshold."""
    cast_dtype: str = "bfloat16"
    """Also report the drift of the weights cast to this dtype (what a GPU engine holds; empty: fp32 only)."""
    top: int = 5
    """Largest updates listed per module type."""
    run: RunConfig = field(default_factory=RunConfig)
    """run.dir for drift.json and drift_hist.png (absolute; empty: runs/drift-<timestamp>)."""


def validate_drift(cfg: DriftJobConfig) -> DriftJobConfig:
    if not cfg.tuned:
        raise ConfigError(
            "tuned= is required: the checkpoint to compare with base= (e.g. tuned=/abs/run/checkpoints/final)"
        )
    if not cfg.thresholds or any(t <= 0 for t in cfg.thresholds):
        raise ConfigError(f"thresholds={list(cfg.thresholds)} must be a non-empty list of positive numbers")
    check_positive("top", cfg.top, allow_zero=True)
    if cfg.cast_dtype:
        CAST_DTYPES.check(cfg.cast_dtype)
    validate_run(cfg.run)
    return cfg


@dataclass
class InterpolateJobConfig:
    """es-interpolate's schema: scores along theta(t) = (1 - t) theta_a + t theta_b."""

    a: str = ""
    """The checkpoint at t = 0 (HF directory or hub id; empty: base=)."""
    b: str = ""
    """The checkpoint at t = 1 (empty: base=)."""
    base: str = ""
    """theta_0, the model both were trained from (the cosine of their updates is taken from it); empty: the embedded
    SmolLM2-135M-Instruct."""
    grid: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    """The t evaluated, in [0, 1], 0 and 1 included (every t scores the same problems with the same seeds)."""
    draws: int = 2000
    """Bootstrap resamples of the problems for the barrier's interval."""
    eval: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    """What is scored at every t (es-eval's eval section; entropy and KL are not computed along the path)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    run: RunConfig = field(default_factory=RunConfig)
    """run.dir for interpolation.json and interpolation.md (absolute; empty: runs/interpolate-<timestamp>);
    run.seed fixes the sampling."""


def validate_interpolate(cfg: InterpolateJobConfig) -> InterpolateJobConfig:
    grid = list(cfg.grid)
    if (
        not grid
        or any(not 0.0 <= t <= 1.0 for t in grid)
        or 0.0 not in grid
        or 1.0 not in grid
        or len(set(grid)) != len(grid)
    ):
        raise ConfigError(
            f"grid={grid} must hold distinct values in [0, 1], 0 and 1 among them (the end points), "
            "e.g. grid=[0,0.25,0.5,0.75,1]"
        )
    if cfg.a == cfg.b:
        raise ConfigError(
            f"a={cfg.a!r} and b={cfg.b!r} are the same model: give two checkpoints (either may be empty for base=)"
        )
    if cfg.eval.kl_base:
        raise ConfigError("eval.kl_base is es-eval's: es-interpolate scores reward and pass@k only; drop it")
    check_positive("draws", cfg.draws)
    validate_eval(EvalJobConfig(eval=cfg.eval, engine=cfg.engine, run=cfg.run))
    return cfg


def to_interpolate_config(cfg) -> InterpolateJobConfig:
    return validate_interpolate(to_config(cfg, InterpolateJobConfig))


def to_eval_config(cfg) -> EvalJobConfig:
    return validate_eval(to_config(cfg, EvalJobConfig))


def to_drift_config(cfg) -> DriftJobConfig:
    return validate_drift(to_config(cfg, DriftJobConfig))


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="es_eval_schema", node=EvalJobConfig)
    cs.store(name="es_drift_schema", node=DriftJobConfig)
    cs.store(name="es_interpolate_schema", node=InterpolateJobConfig)
