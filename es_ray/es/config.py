"""ES configuration: the `es` and `faults` sections and es-train's schema (``ESTrainConfig``).

The shared sections (model, task, sampling, engine, cluster, eval, run) are the runtime's
(``es_ray.core.config``); option lists come from their registries (shapings and optimizers in
``es_ray.strategy``, noise kinds in ``es_ray.noise``, engines in ``es_ray.engines``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from es_ray.core.config import (
    ClusterConfig,
    ConfigError,
    EngineConfig,
    FaultPolicy,
    HeldOutConfig,
    ModelConfig,
    RunConfig,
    SamplingConfig,
    TaskConfig,
    check_positive,
    to_config,
)
from es_ray.core.registry import Registry
from es_ray.engines import ENGINES, engines_that
from es_ray.metrics.coverage import FITNESS_BASELINES, check_objective
from es_ray.noise_kinds import ES_NOISE, NOISE_SCOPES, check_reference_noise
from es_ray.perturbation import PERTURBATIONS
from es_ray.replica_spec import ReplicaSpec
from es_ray.runtime.validation import validate_trainer
from es_ray.strategy import OPTIMIZERS, SHAPERS

if TYPE_CHECKING:
    from es_ray.replica_spec import ReplicaSpec

# Hydra's ConfigStore is imported by register_configs only: the schema converts and checks without Hydra.

ESTIMATORS = Registry(
    "es.estimator",
    {
        "one_point": "each member's own noise, the update sum_i f_i eps_i / (N sigma) (the paper's)",
        "antithetic": "members in +/- pairs sharing one noise (es.population even): lower variance for the same draws",
    },
)
ON_MISMATCH = Registry(
    "es.on_mismatch",
    {
        "stop": "a replica whose checksum differs from the others' stops the run",
        "rebuild": "it is rebuilt from the last checkpoint and the seed log, and the run goes on",
    },
)
KILL_PHASES = Registry(
    "faults.kill_actor_phase", {"evaluate": "during a member evaluation", "update": "during the update"}
)
KILL_WAYS = Registry(
    "faults.kill_actor_by",
    {
        "exit": "the actor's process exits",
        "oom": "the call fails with Ray's OutOfMemoryError (what the caller gets when Ray's memory monitor kills the "
        "worker), with the monitor's message",
    },
)


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
    samples_per_prompt: int = 1
    """Completions each member generates per prompt (one engine call holds them all); a prompt's value is their mean
    reward (task.objective=mean) or their pass@k (pass_at_k), the member's fitness the mean over prompts. The ledger
    counts every completion."""
    fitness_baseline: str = "none"
    """none, or per_prompt: each prompt's values are centred on their mean over the members and scaled by their
    spread before the mean over prompts (es_ray.metrics.coverage), so a prompt's difficulty does not drown the
    members' differences."""
    shaping: str = "zscore"
    """Fitness shaping (es_ray.strategy.SHAPERS): zscore (default) or centered_rank."""
    estimator: str = "one_point"
    """one_point (default) or antithetic (members in +/- pairs; population must be even)."""
    optimizer: str = "sgd"
    """sgd or adam (es_ray.strategy.OPTIMIZERS), applied to the ascent direction g."""
    adam_beta1: float = 0.9
    """es.optimizer=adam: the first moment's decay."""
    adam_beta2: float = 0.999
    """es.optimizer=adam: the second moment's decay."""
    adam_eps: float = 1e-8
    """es.optimizer=adam: added to sqrt(v) in the step's denominator."""
    weight_decay: float = 0.0
    """Decoupled decay: theta <- theta - lr * weight_decay * theta."""
    anchor_decay: float = 0.0
    """Anchored decay toward the initial weights: theta <- theta - lr * anchor_decay * (theta - theta_0)."""
    noise: str = "auto"
    """per_tensor: a generator per (seed, iteration, member, tensor); table: slices of one shared seeded table;
    counter: Philox of (tensor seed, element index), the same numbers on a CPU and every GPU model (mixed GPU
    types, replay on another GPU type); auto: table on CPU (the cheapest there), per_tensor on GPU (per_tensor and
    table need one device model for all actors, which the driver checks at start)."""
    noise_scope: str = "per_tensor"
    """per_tensor: every tensor of a member draws its own noise (the textbook estimator, default); reference: one
    seed for all tensors of a member, as the reference ES implementation does (equal-shaped tensors then get equal
    noise): a parity mode to reproduce the paper's own setting or measure the difference."""
    perturbation: str = "full"
    """full: every trainable tensor gets full-rank noise, written into the weights member by member (the paper's
    ES); lowrank: each linear layer's weight gets sigma * B A^T / sqrt(es.rank) and all of an actor's members are
    generated in one batched pass, the weights written once per iteration (es_ray.lowrank;
    docs/population-batching.md). lowrank leaves 1-D tensors and embeddings out."""
    rank: int = 8
    """es.perturbation=lowrank: rank r of each member's perturbation (1 <= r <= min(out, in); vLLM: one of the
    LoRA ranks it supports)."""
    noise_table_size: int = 1 << 25
    """Number of fp32 values in the shared noise table (noise=table); must exceed the largest tensor."""
    checksum_every: int = 1
    """Compare the replicas' master-weight checksums every k iterations (0 disables)."""
    on_mismatch: str = "stop"
    """When replica checksums differ: stop (with an error) or rebuild (the odd actors are rebuilt from the last
    checkpoint plus the seed log, logged)."""


@dataclass
class ESFaultsConfig(FaultPolicy):
    """The runtime's fault policy (actor_timeout_s, max_replacements) plus fault injection, which the tests use and
    users can use to rehearse a failure. Injection keys: -1 = off; each fires once (a replacement actor started
    during iteration t ignores the faults of iterations up to t)."""

    actor_rank: int = 0
    """The actor the injected faults hit."""
    kill_actor_at_iteration: int = -1
    """That actor's process exits in the middle of this iteration (see kill_actor_phase)."""
    kill_actor_phase: str = "evaluate"
    """evaluate: after scoring its first member; update: before applying the update."""
    kill_actor_by: str = "exit"
    """How the kill lands: exit (the process exits) or oom (Ray's OutOfMemoryError, as its memory monitor's)."""
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
class ESTrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    es: ESConfig = field(default_factory=ESConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    eval: HeldOutConfig = field(default_factory=HeldOutConfig)
    run: RunConfig = field(default_factory=RunConfig)
    faults: ESFaultsConfig = field(default_factory=ESFaultsConfig)


def replica_spec(cfg: ESTrainConfig) -> ReplicaSpec:
    """The replica's settings from the ES config, the one place a ``ReplicaSpec`` is built: each field reads the key
    its metadata names (``es.sigma``, ``run.seed``, ...)."""
    return ReplicaSpec(
        **{f.name: functools.reduce(getattr, f.metadata["config"].split("."), cfg) for f in fields(ReplicaSpec)}
    )


def validate(cfg: ESTrainConfig) -> ESTrainConfig:
    es = cfg.es
    if es.population < 2:
        raise ConfigError(f"es.population={es.population}: ES needs at least 2 members; set es.population>=2")
    if es.estimator == "antithetic" and es.population % 2:
        raise ConfigError(
            f"es.population={es.population} must be even when es.estimator=antithetic (members come in +/- pairs)"
        )
    check_positive("es.sigma", es.sigma)
    check_positive("es.lr", es.lr, allow_zero=True)
    check_positive("es.iterations", es.iterations, allow_zero=True)
    check_positive("es.prompts_per_iteration", es.prompts_per_iteration)
    check_positive("es.samples_per_prompt", es.samples_per_prompt)
    FITNESS_BASELINES.check(es.fitness_baseline)
    check_objective(cfg.task.objective, cfg.task.objective_k, es.samples_per_prompt, "es.samples_per_prompt")
    check_positive("es.weight_decay", es.weight_decay, allow_zero=True)
    check_positive("es.anchor_decay", es.anchor_decay, allow_zero=True)
    check_positive("es.noise_table_size", es.noise_table_size)
    SHAPERS.check(es.shaping)
    OPTIMIZERS.check(es.optimizer)
    ES_NOISE.check(es.noise)
    NOISE_SCOPES.check(es.noise_scope)
    if (problem := check_reference_noise(es.noise, es.noise_scope)) is not None:
        raise ConfigError(problem)
    if PERTURBATIONS.get(es.perturbation).batched:
        check_population_engine(cfg)
    ESTIMATORS.check(es.estimator)
    ON_MISMATCH.check(es.on_mismatch)
    validate_trainer(cfg)
    if cfg.cluster.num_actors > es.population:
        raise ConfigError(
            f"cluster.num_actors={cfg.cluster.num_actors} exceeds es.population={es.population}; "
            "every actor needs at least one member: lower cluster.num_actors or raise es.population"
        )
    validate_injection(cfg)
    return cfg


def check_population_engine(cfg: ESTrainConfig) -> None:
    """es.perturbation=lowrank: a rank of at least 1, and an engine that batches a population (the engine's
    ``lowrank_ranks``: the ranks it can serve, None for any). The rank's upper bound, min(out, in) of the model's
    linear layers, is checked where the model is at hand (``es_ray.es.driver.preflight`` and every replica)."""
    traits = ENGINES.get(cfg.engine.name)
    if cfg.es.rank < 1:
        raise ConfigError(f"es.rank={cfg.es.rank}: the rank of a low-rank perturbation must be >= 1 (e.g. es.rank=8)")
    if not traits.lowrank:
        raise ConfigError(
            f"es.perturbation={cfg.es.perturbation} needs an engine that batches a population; "
            f"engine.name={cfg.engine.name} does not: use engine.name= one of "
            f"{', '.join(engines_that('lowrank'))}, or es.perturbation=full"
        )
    if cfg.engine.tensor_parallel_size > 1:
        raise ConfigError(
            f"es.perturbation=lowrank with engine.tensor_parallel_size="
            f"{cfg.engine.tensor_parallel_size} is not supported yet: use tensor_parallel_size=1 or "
            "es.perturbation=full"
        )
    if cfg.engine.device != "auto":  # auto: checked where the engine starts
        traits.check_settings(cfg.engine.device, cfg.engine.dtype, True, cfg.engine.batch_invariant)
    ranks = traits.lowrank_ranks()
    if ranks is not None and cfg.es.rank not in ranks:
        raise ConfigError(
            f"es.rank={cfg.es.rank}: engine.name={cfg.engine.name} serves low-rank members at ranks "
            f"{', '.join(map(str, ranks))} only; set es.rank= to one of them"
        )


def validate_injection(cfg: ESTrainConfig) -> None:
    """The faults group's injection keys."""
    f = cfg.faults
    check_positive("faults.actor_delay_s", f.actor_delay_s, allow_zero=True)
    KILL_PHASES.check(f.kill_actor_phase)
    KILL_WAYS.check(f.kill_actor_by)
    if not 0 <= f.actor_rank < cfg.cluster.num_actors:
        raise ConfigError(
            f"faults.actor_rank={f.actor_rank} is not an actor: set it in "
            f"[0, cluster.num_actors={cfg.cluster.num_actors})"
        )
    for key in (
        "kill_actor_at_iteration",
        "hang_actor_at_iteration",
        "corrupt_replica_at_iteration",
        "interrupt_at_iteration",
    ):
        value = getattr(f, key)
        if value < -1 or value >= cfg.es.iterations:
            raise ConfigError(
                f"faults.{key}={value} never fires: set it in [0, es.iterations={cfg.es.iterations}) or -1 (off)"
            )
    if f.hang_actor_at_iteration >= 0 and not f.actor_timeout_s:
        raise ConfigError(
            "faults.hang_actor_at_iteration needs faults.actor_timeout_s > 0 (with 0 the driver "
            "would wait for the hung actor forever)"
        )


def to_train_config(cfg: Any) -> ESTrainConfig:
    """Composed DictConfig (or plain dict) -> validated ESTrainConfig."""
    return validate(to_config(cfg, ESTrainConfig))


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="es_train_schema", node=ESTrainConfig)
