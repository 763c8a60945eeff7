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
    """arithmetic, countdown, gsm8k, or a user task as an import path package.module:TaskClass."""
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


@dataclass
class EvalConfig:
    every: int = 6
    """Evaluate the unperturbed weights on the held-out set every k iterations (and at the first; 0: never)."""


@dataclass
class RunConfig:
    dir: str = ""
    """Absolute run directory (created); empty makes runs/es-<timestamp> under the current directory."""
    seed: int = 0
    """Run seed: the noise of member i of iteration t on tensor `name` is a function of (seed, t, i, name)."""
    checkpoint_every: int = 0
    """Write checkpoints/iter_<t> every k iterations (0: only the final one)."""
    tensorboard: bool = True
    progress: bool = True


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
    _positive("sampling.max_new_tokens", cfg.sampling.max_new_tokens)
    _positive("sampling.temperature", cfg.sampling.temperature, allow_zero=True)
    if not 0 < cfg.sampling.top_p <= 1:
        raise ConfigError(f"sampling.top_p={cfg.sampling.top_p} must be in (0, 1]")
    _positive("cluster.num_actors", cfg.cluster.num_actors)
    _positive("cluster.gpus_per_actor", cfg.cluster.gpus_per_actor, allow_zero=True)
    _positive("cluster.cpus_per_actor", cfg.cluster.cpus_per_actor, allow_zero=True)
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
    return cfg


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="es_train_schema", node=TrainConfig)


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
