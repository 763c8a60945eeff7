"""Typed configuration: the dataclasses are the Hydra schema; YAML under conf/ holds presets only.

Every entry point converts the composed DictConfig once (``to_config``) and passes these frozen-in-spirit
dataclasses to actors. ``validate`` refuses bad input before any work, with a message saying what to change.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

SHAPINGS = ("zscore", "centered_rank")
ESTIMATORS = ("one_point", "antithetic")
OPTIMIZERS = ("sgd", "adam")
NOISE_KINDS = ("auto", "per_tensor", "table")
ENGINES = ("hf", "vllm")
DTYPES = ("bfloat16", "float16", "float32", "auto")
ON_MISMATCH = ("stop", "rebuild")
KILL_PHASES = ("evaluate", "update")
PLACEMENTS = ("pack", "spread")


class ConfigError(ValueError):
    """A setting that cannot work; the message names the key and what to change."""


@dataclass
class ModelConfig:
    path: str = ""
    """HF directory, HF hub id, or empty for the embedded SmolLM2-135M-Instruct."""
    trainable: str = ""
    """Regex on HF parameter names; only matching tensors are perturbed and updated (empty: all)."""


@dataclass
class TaskConfig:
    name: str = "arithmetic"
    """arithmetic, countdown, gsm8k, deepscaler, math500, aime24, aime25, amc23, gpqa, csqa, mbpp, or a user task
    as an import path package.module:TaskClass."""
    path: str = ""
    """Local JSONL/JSON/Parquet file in the hub schema (for offline clusters); empty uses the hub id."""
    split: str = "train"
    """Split of the hub dataset (or local file) used for the training pool."""
    train_size: int = 16
    """Size of the fixed training pool (generated tasks) or the cap on rows taken (dataset tasks; 0 = all)."""
    eval_size: int = 32
    """Size of the fixed held-out set used for the evaluation curve."""
    digits: int = 2
    """arithmetic: number of digits per operand (difficulty)."""
    operations: str = "+-"
    """arithmetic: operators drawn from this string (subset of '+-*')."""
    num_operands: int = 2
    """arithmetic: operands per problem."""
    countdown_numbers: int = 3
    """countdown: how many source numbers per problem (3 or 4)."""
    seed: int = 1234
    """Seed for generated problems and the train/held-out split (independent of run.seed)."""


@dataclass
class ESConfig:
    population: int = 8
    """Members per iteration (N). The reference code uses 30; the paper found 16 enough for 1.5B-3B models."""
    sigma: float = 5e-3
    """Noise scale of the perturbation theta + sigma * eps."""
    lr: float = 2.5e-5
    """Step size: theta <- theta + lr * g with g = 1/(N sigma) sum_i z_i eps_i. Reference alpha = lr / sigma
    (the reference's sigma 1e-3, alpha 5e-4 is lr 5e-7). Default: the CPU demo's sweep, alpha 5e-3."""
    iterations: int = 32
    """Number of ES iterations."""
    prompts_per_iteration: int = 16
    """Prompts scored per member; every member of an iteration sees the same prompts (common random numbers)."""
    shaping: str = "zscore"
    """Fitness shaping: zscore (default) or centered_rank."""
    estimator: str = "one_point"
    """one_point (default) or antithetic (members in +/- pairs; population must be even)."""
    optimizer: str = "sgd"
    """sgd or adam, applied to the ascent direction g."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    """Decoupled decay: theta <- theta - lr * weight_decay * theta."""
    anchor_decay: float = 0.0
    """Anchored decay toward the initial weights: theta <- theta - lr * anchor_decay * (theta - theta_0)."""
    noise: str = "auto"
    """per_tensor: a generator per (seed, iteration, member, tensor); table: slices of one shared seeded table;
    auto: table on CPU (5-10x cheaper there), per_tensor on GPU."""
    noise_table_size: int = 1 << 25
    """Number of fp32 values in the shared noise table (noise=table); must exceed the largest tensor."""
    checksum_every: int = 1
    """Compare the replicas' master-weight checksums every k iterations (0 disables)."""
    on_mismatch: str = "stop"
    """When replica checksums differ: stop (with an error) or rebuild (the odd actors are rebuilt from the last
    checkpoint plus the seed log, logged)."""


@dataclass
class SamplingConfig:
    max_new_tokens: int = 16
    temperature: float = 0.0
    """0 is greedy decoding."""
    top_p: float = 1.0


@dataclass
class EngineConfig:
    name: str = "hf"
    """Generation engine: hf (transformers) or vllm."""
    dtype: str = "auto"
    """Engine weight dtype (auto: float32 on CPU, where bf16 matmuls are ~4x slower here; bfloat16 on GPU).
    The master copy is always fp32."""
    device: str = "auto"
    """auto (cuda when the actor has a GPU, else cpu), cpu, or cuda."""
    batch_size: int = 64
    """Largest generation batch (prompts per forward pass) for the transformers engine."""
    threads: int = 0
    """torch threads per actor on CPU (0: the CPUs Ray gives the actor)."""
    gpu_memory_utilization: float = 0.0
    """vLLM: share of GPU memory for its weights and KV cache (0: 0.5 on GPU, room for the fp32 master; on CPU a
    1 GiB KV cache, since vLLM reads this as a share of host RAM there)."""
    max_model_len: int = 0
    """vLLM: longest prompt + completion in tokens (0: the model's own maximum)."""
    tensor_parallel_size: int = 1
    """vLLM: GPUs per engine; noise stays per HF tensor, so it does not depend on this."""
    enforce_eager: bool = False
    """vLLM: no torch.compile or CUDA graphs: starts in seconds (CPU: 11 s vs 88 s here), decodes slower."""


@dataclass
class ClusterConfig:
    address: str = ""
    """Empty starts a local Ray; otherwise the address of an existing cluster (ray://host:10001 or host:6379)."""
    num_actors: int = 2
    """ES actors; members are spread over them."""
    gpus_per_actor: float = 0.0
    cpus_per_actor: float = 1.0
    num_cpus: int = 0
    """CPUs for a local Ray (0: all of this machine's)."""
    placement: str = "pack"
    """Actors go into one Ray placement group, one bundle each: pack (fill a node before the next) or spread
    (one node per actor where possible)."""
    wait_for_resources_s: float = 0.0
    """Seconds to wait for the actors' resources to be reserved, e.g. while an autoscaling cluster adds GPU nodes.
    0: the cluster must already hold them; the run fails at once saying how many GPUs/CPUs it needs and has."""


@dataclass
class EvalConfig:
    every: int = 6
    """Evaluate the unperturbed weights on the held-out set every k iterations (and at the first; 0: never)."""


@dataclass
class RunConfig:
    dir: str = ""
    """Absolute run directory (created); empty makes <run.root>/es-<timestamp>."""
    root: str = ""
    """Absolute parent of the default run directory, e.g. shared storage on a cluster (empty: ./runs)."""
    seed: int = 0
    """Run seed: the noise of member i of iteration t on tensor `name` is a function of (seed, t, i, name)."""
    checkpoint_every: int = 0
    """Write checkpoints/iter_<t> every k iterations (0: only the final one)."""
    resume: bool = False
    """Continue the run in run.dir from its last checkpoint (ES: plus a replay of the seed log since it); the
    result equals an uninterrupted run. A run.dir with nothing to resume starts a new run."""
    tensorboard: bool = True
    progress: bool = True


@dataclass
class FaultsConfig:
    """Fault tolerance (how long to wait for an actor, how many to replace) and fault injection, which the tests
    use and users can use to rehearse a failure. Injection keys: -1 = off; each fires once (a replacement actor
    started during iteration t ignores the faults of iterations up to t)."""

    actor_timeout_s: float = 1800.0
    """An actor call unanswered this long counts as a dead actor: it is killed and replaced (0: wait forever).
    A killed process or a lost node is noticed by Ray itself, without waiting for this."""
    max_replacements: int = 8
    """Dead actors replaced per run before the run stops (it can then be resumed with run.resume=true)."""
    actor_rank: int = 0
    """The actor the injected faults hit."""
    kill_actor_at_iteration: int = -1
    """That actor's process exits in the middle of this iteration (see kill_actor_phase)."""
    kill_actor_phase: str = "evaluate"
    """evaluate: after scoring its first member; update: before applying the update."""
    hang_actor_at_iteration: int = -1
    """That actor stops answering during this iteration's evaluation (needs actor_timeout_s > 0)."""
    corrupt_replica_at_iteration: int = -1
    """That actor flips one bit of its master weights after this iteration's update (a replica mismatch)."""
    interrupt_at_iteration: int = -1
    """The driver sends itself SIGTERM while this iteration's members are being evaluated (rehearses
    `ray job stop`)."""
    actor_delay_s: float = 0.0
    """Every actor sleeps this long before each evaluation (a slow node; tests use it to pace a run)."""


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    es: ESConfig = field(default_factory=ESConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)


def _choice(key: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(options)}; set {key}= to one of them")


def _positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key}={value} must be {bound}; set {key}= to a value {bound}")


def validate(cfg: TrainConfig) -> TrainConfig:
    es = cfg.es
    if es.population < 2:
        raise ConfigError(f"es.population={es.population}: ES needs at least 2 members; set es.population>=2")
    if es.estimator == "antithetic" and es.population % 2:
        raise ConfigError(
            f"es.population={es.population} must be even when es.estimator=antithetic (members come in +/- pairs)"
        )
    _positive("es.sigma", es.sigma)
    _positive("es.lr", es.lr, allow_zero=True)
    _positive("es.iterations", es.iterations, allow_zero=True)
    _positive("es.prompts_per_iteration", es.prompts_per_iteration)
    _positive("es.weight_decay", es.weight_decay, allow_zero=True)
    _positive("es.anchor_decay", es.anchor_decay, allow_zero=True)
    _positive("es.noise_table_size", es.noise_table_size)
    _choice("es.shaping", es.shaping, SHAPINGS)
    _choice("es.estimator", es.estimator, ESTIMATORS)
    _choice("es.optimizer", es.optimizer, OPTIMIZERS)
    _choice("es.noise", es.noise, NOISE_KINDS)
    _choice("engine.name", cfg.engine.name, ENGINES)
    _choice("engine.dtype", cfg.engine.dtype, DTYPES)
    _choice("engine.device", cfg.engine.device, ("auto", "cpu", "cuda"))
    _positive("engine.batch_size", cfg.engine.batch_size)
    if not 0 <= cfg.engine.gpu_memory_utilization <= 1:
        raise ConfigError(f"engine.gpu_memory_utilization={cfg.engine.gpu_memory_utilization} must be in [0, 1] "
                          "(0: the engine's default)")
    _positive("engine.max_model_len", cfg.engine.max_model_len, allow_zero=True)
    _positive("engine.tensor_parallel_size", cfg.engine.tensor_parallel_size)
    if cfg.engine.tensor_parallel_size > 1 and cfg.engine.name != "vllm":
        raise ConfigError(f"engine.tensor_parallel_size={cfg.engine.tensor_parallel_size} needs engine.name=vllm")
    if cfg.engine.name == "vllm" and cfg.cluster.gpus_per_actor and \
            cfg.cluster.gpus_per_actor < cfg.engine.tensor_parallel_size:
        raise ConfigError(f"engine.tensor_parallel_size={cfg.engine.tensor_parallel_size} needs that many GPUs per "
                          f"actor; set cluster.gpus_per_actor={cfg.engine.tensor_parallel_size}")
    _positive("sampling.max_new_tokens", cfg.sampling.max_new_tokens)
    _positive("sampling.temperature", cfg.sampling.temperature, allow_zero=True)
    if not 0 < cfg.sampling.top_p <= 1:
        raise ConfigError(f"sampling.top_p={cfg.sampling.top_p} must be in (0, 1]")
    _positive("cluster.num_actors", cfg.cluster.num_actors)
    _positive("cluster.gpus_per_actor", cfg.cluster.gpus_per_actor, allow_zero=True)
    _positive("cluster.cpus_per_actor", cfg.cluster.cpus_per_actor, allow_zero=True)
    _check_cluster_and_run(cfg.cluster, cfg.run)
    if cfg.cluster.num_actors > es.population:
        raise ConfigError(
            f"cluster.num_actors={cfg.cluster.num_actors} exceeds es.population={es.population}; "
            "every actor needs at least one member: lower cluster.num_actors or raise es.population"
        )
    from es_ray.tasks import TASKS  # late: tasks import graders

    if ":" not in cfg.task.name:  # an import path is checked where it is imported (in the actors)
        _choice("task.name", cfg.task.name, tuple(sorted(TASKS)))
    if cfg.task.train_size < 0 or cfg.task.eval_size < 0:
        raise ConfigError("task.train_size and task.eval_size must be >= 0")
    if cfg.run.dir and not os.path.isabs(cfg.run.dir):
        # Ray Jobs run the driver in a temporary directory: relative outputs would vanish.
        raise ConfigError(f"run.dir={cfg.run.dir!r} must be an absolute path (Ray Jobs run in a temporary directory)")
    validate_resume(cfg)
    return cfg


def validate_resume(cfg: TrainConfig) -> None:
    """run.resume, es.on_mismatch and the faults group."""
    if cfg.run.resume and not cfg.run.dir:
        raise ConfigError("run.resume=true needs run.dir= the absolute directory of the run to continue")
    _choice("es.on_mismatch", cfg.es.on_mismatch, ON_MISMATCH)
    f = cfg.faults
    _positive("faults.actor_timeout_s", f.actor_timeout_s, allow_zero=True)
    _positive("faults.max_replacements", f.max_replacements, allow_zero=True)
    _positive("faults.actor_delay_s", f.actor_delay_s, allow_zero=True)
    _choice("faults.kill_actor_phase", f.kill_actor_phase, KILL_PHASES)
    if not 0 <= f.actor_rank < cfg.cluster.num_actors:
        raise ConfigError(f"faults.actor_rank={f.actor_rank} is not an actor: set it in "
                          f"[0, cluster.num_actors={cfg.cluster.num_actors})")
    for key in ("kill_actor_at_iteration", "hang_actor_at_iteration", "corrupt_replica_at_iteration",
                "interrupt_at_iteration"):
        value = getattr(f, key)
        if value < -1 or value >= cfg.es.iterations:
            raise ConfigError(f"faults.{key}={value} never fires: set it in [0, es.iterations={cfg.es.iterations}) "
                              "or -1 (off)")
    if f.hang_actor_at_iteration >= 0 and not f.actor_timeout_s:
        raise ConfigError("faults.hang_actor_at_iteration needs faults.actor_timeout_s > 0 (with 0 the driver "
                          "would wait for the hung actor forever)")


def _check_cluster_and_run(cluster: ClusterConfig, run: RunConfig) -> None:
    _choice("cluster.placement", cluster.placement, PLACEMENTS)
    _positive("cluster.wait_for_resources_s", cluster.wait_for_resources_s, allow_zero=True)
    if run.root and not os.path.isabs(run.root):
        raise ConfigError(f"run.root={run.root!r} must be an absolute path (Ray Jobs run in a temporary directory)")


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="es_train_schema", node=TrainConfig)
    cs.store(name="es_eval_schema", node=EvaluateConfig)
    cs.store(name="es_drift_schema", node=DriftConfig)


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    kwargs = {}
    names = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"unknown key {where}{key}; known keys: {', '.join(sorted(names))}")
        sub = names[key].default_factory if names[key].default_factory is not dataclasses.MISSING else None
        if sub is not None and dataclasses.is_dataclass(sub) and isinstance(value, dict):
            kwargs[key] = _build(sub, value, f"{where}{key}.")
        else:
            kwargs[key] = value
    return cls(**kwargs)


def to_config(cfg: Any, cls: type = TrainConfig) -> Any:
    """DictConfig (or plain dict) -> dataclass, validated when it is a TrainConfig."""
    if not isinstance(cfg, dict):
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(cfg, resolve=True)
    cfg = {k: v for k, v in cfg.items() if k != "hydra"}
    out = _build(cls, cfg, "")
    return validate(out) if isinstance(out, TrainConfig) else out


# -- es-eval and es-drift -----------------------------------------------------------------------------------

EVAL_TASK_NAMES = ("gpqa", "mbpp", "csqa", "countdown", "aime24", "aime25", "amc23", "math500")


@dataclass
class EvalSuiteConfig:
    tasks: list[str] = field(default_factory=lambda: list(EVAL_TASK_NAMES))
    """Tasks to evaluate (any task.name; default: the paper's eight evaluation sets)."""
    n: int = 32
    """Samples per problem (must be >= max(k))."""
    k: list[int] = field(default_factory=lambda: [1, 16, 32])
    """pass@k and maj@k are reported for each k."""
    temperature: float = 0.6
    """Sampling temperature (0 is greedy, which only makes sense with n=1)."""
    top_p: float = 0.95
    max_new_tokens: int = 1024
    limit: int = 0
    """Problems per task, the first ones in dataset order (0: all)."""
    data_dir: str = ""
    """Directory of local files named <task>.jsonl (or .json/.parquet/.csv) in each hub schema; empty: the hub."""
    paths: dict[str, str] = field(default_factory=dict)
    """Per-task local file, overriding data_dir: +eval.paths.gpqa=/data/gpqa_diamond.jsonl"""
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


@dataclass
class EvaluateConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    eval: EvalSuiteConfig = field(default_factory=EvalSuiteConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """cluster.num_actors: generation actors (0: in this process, without Ray)."""
    run: RunConfig = field(default_factory=RunConfig)
    """run.dir for results (absolute); run.seed fixes the sampling."""


def validate_eval(cfg: EvaluateConfig) -> EvaluateConfig:
    ev = cfg.eval
    if not ev.tasks:
        raise ConfigError("eval.tasks is empty; list at least one task, e.g. eval.tasks=[gsm8k]")
    from es_ray.tasks import TASKS

    for name in ev.tasks:
        if ":" not in name:
            _choice("eval.tasks", name, tuple(sorted(TASKS)))
    _positive("eval.n", ev.n)
    if not ev.k or any(k < 1 for k in ev.k):
        raise ConfigError(f"eval.k={list(ev.k)} must be a non-empty list of integers >= 1, e.g. eval.k=[1,16,32]")
    if max(ev.k) > ev.n:
        raise ConfigError(f"eval.k={list(ev.k)} needs eval.n >= {max(ev.k)} samples per problem (eval.n={ev.n}); "
                          f"raise eval.n or drop k > {ev.n}")
    _positive("eval.temperature", ev.temperature, allow_zero=True)
    if ev.temperature == 0 and ev.n > 1:
        raise ConfigError(f"eval.temperature=0 is greedy decoding: all eval.n={ev.n} samples would be identical; "
                          "set eval.temperature > 0 or eval.n=1 eval.k=[1]")
    if not 0 < ev.top_p <= 1:
        raise ConfigError(f"eval.top_p={ev.top_p} must be in (0, 1]")
    _positive("eval.max_new_tokens", ev.max_new_tokens)
    _positive("eval.limit", ev.limit, allow_zero=True)
    _positive("eval.chunk_size", ev.chunk_size, allow_zero=True)
    _positive("eval.math_timeout_s", ev.math_timeout_s)
    _positive("eval.code_timeout_s", ev.code_timeout_s)
    _positive("eval.code_memory_mb", ev.code_memory_mb)
    _positive("eval.grader_workers", ev.grader_workers)
    unknown = sorted(set(ev.paths) - set(ev.tasks))
    if unknown:
        raise ConfigError(f"eval.paths names tasks not in eval.tasks: {unknown}")
    _choice("engine.name", cfg.engine.name, ENGINES)
    _choice("engine.dtype", cfg.engine.dtype, DTYPES)
    _choice("engine.device", cfg.engine.device, ("auto", "cpu", "cuda"))
    _positive("engine.batch_size", cfg.engine.batch_size)
    _positive("cluster.num_actors", cfg.cluster.num_actors, allow_zero=True)
    _positive("cluster.gpus_per_actor", cfg.cluster.gpus_per_actor, allow_zero=True)
    _positive("cluster.cpus_per_actor", cfg.cluster.cpus_per_actor, allow_zero=True)
    _check_cluster_and_run(cfg.cluster, cfg.run)
    if cfg.run.dir and not os.path.isabs(cfg.run.dir):
        raise ConfigError(f"run.dir={cfg.run.dir!r} must be an absolute path (Ray Jobs run in a temporary directory)")
    return cfg


@dataclass
class DriftConfig:
    base: str = ""
    """The reference checkpoint: HF directory, hub id, or empty for the embedded SmolLM2-135M-Instruct."""
    tuned: str = ""
    """The checkpoint compared with it (e.g. runs/es-.../checkpoints/final)."""
    thresholds: list[float] = field(default_factory=lambda: [1.0e-3, 1.5e-3, 2.0e-3])
    """Share of non-zero updates with |delta| below each threshold."""
    top: int = 5
    """Largest updates listed per module type."""
    run: RunConfig = field(default_factory=RunConfig)
    """run.dir for drift.json and drift_hist.png (absolute; empty: runs/drift-<timestamp>)."""


def validate_drift(cfg: DriftConfig) -> DriftConfig:
    if not cfg.tuned:
        raise ConfigError("tuned= is required: the checkpoint to compare with base= "
                          "(e.g. tuned=/abs/run/checkpoints/final)")
    if not cfg.thresholds or any(t <= 0 for t in cfg.thresholds):
        raise ConfigError(f"thresholds={list(cfg.thresholds)} must be a non-empty list of positive numbers")
    _positive("top", cfg.top, allow_zero=True)
    if cfg.run.dir and not os.path.isabs(cfg.run.dir):
        raise ConfigError(f"run.dir={cfg.run.dir!r} must be an absolute path")
    if cfg.run.root and not os.path.isabs(cfg.run.root):
        raise ConfigError(f"run.root={cfg.run.root!r} must be an absolute path")
    return cfg
