"""The configuration sections every method shares, and the checks and conversion every entry point uses.

The dataclasses are the Hydra schema (YAML under conf/ holds presets only). Each entry point converts the
composed DictConfig once (``to_config``) and passes dataclasses to its actors. ``ConfigError`` carries a message
that names the key and what to change; every entry point prints it in one line and exits with 2.

Method sections live with their method: ES in ``es_ray.es.config``, GRPO in ``es_ray.grpo.config``, es-eval and es-drift
in ``es_ray.evaluation.config``. The checks that look a name up in a registry of a higher layer (engines, tasks,
trackers) are in ``es_ray.runtime.validation``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any

# OmegaConf is imported by to_config only: the schema imports (and tests) without Hydra's stack.


class ConfigError(ValueError):
    """A setting that cannot work; the message names the key and what to change."""


# -- checks ---------------------------------------------------------------------------------------------------


def check_positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key}={value} must be {bound}; set {key}= to a value {bound}")


def check_absolute(key: str, value: str) -> None:
    """Ray Jobs run the driver in a temporary directory: a relative output path would vanish with it."""
    if value and not os.path.isabs(value):
        raise ConfigError(
            f"{key}={value!r} must be an absolute path (Ray Jobs run the driver in a temporary directory)"
        )


# -- sections -------------------------------------------------------------------------------------------------


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
    countdown_source: str = "generated"
    """countdown: generated (from task.seed) or hub (Jiayi-Pan/Countdown-Tasks-3to4); task.path= overrides both."""
    answer: str = "boxed"
    """Math tasks: boxed (only the final \\boxed{} answer counts, as the prompt asks) or last (lenient, opt-in: the
    final box when there is one, else math-verify takes the last expression; a superset of boxed)."""
    seed: int = 1234
    """Seed for generated problems and the train/held-out split (independent of run.seed)."""
    objective: str = "mean"
    """What training maximises per prompt (es_ray.metrics.coverage.OBJECTIVES): mean (the mean reward over its
    samples) or pass_at_k (the unbiased pass@k over them, k = task.objective_k; ES needs es.samples_per_prompt >= k,
    GRPO grpo.group_size >= k)."""
    objective_k: int = 4
    """task.objective=pass_at_k: the k."""
    reward: str = ""
    """A reward of one's own for training, package.module:function in TRL's reward_funcs shape
    (f(prompts, completions, **columns) -> list of floats; docs/tasks.md); empty: the task's own reward."""


@dataclass
class SamplingConfig:
    max_new_tokens: int = 16
    """Tokens generated per completion at most (a prompt whose tokens and these do not fit the model's context is
    refused, never cut)."""
    temperature: float = 0.0
    """0 is greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p (1: all)."""


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
    """vLLM: no torch.compile or CUDA graphs: starts without the compile (most of a CPU start), decodes slower."""
    batch_invariant: bool = False
    """vLLM on GPU: its batch-invariant kernels (VLLM_BATCH_INVARIANT=1), so a sequence's output does not depend on
    what else is in the batch: low-rank members batched equal each alone, outputs equal a cold cache (README
    "Engines"); slower. Refused on CPU and with engine.name=hf."""


@dataclass
class ClusterConfig:
    address: str = ""
    """Empty starts a local Ray; otherwise the address of an existing cluster (ray://host:10001 or host:6379)."""
    num_actors: int = 2
    """Actors of the method's main role (ES actors, GRPO rollout actors, es-eval actors)."""
    gpus_per_actor: float = 0.0
    """GPUs each actor asks Ray for (0 on CPU; a fraction shares a GPU between actors)."""
    cpus_per_actor: float = 1.0
    """CPUs each actor asks Ray for."""
    num_cpus: int = 0
    """CPUs for a local Ray (0: all of this machine's)."""
    placement: str = "pack"
    """Actors go into one Ray placement group, one bundle each: pack (fill a node before the next) or spread
    (one node per actor where possible)."""
    wait_for_resources_s: float = 0.0
    """Seconds to wait for the actors' resources to be reserved, e.g. while an autoscaling cluster adds GPU nodes.
    0: the cluster must already hold them; the run fails at once saying how many GPUs/CPUs it needs and has."""
    worker_niceness: int = 0
    """How much nicer than the driver the actors of a local Ray run (0-19; Ray's own default is 15, under which any
    other busy process on the machine starves the run: an es-compare took 631 s beside three busy loops, 68 s
    alone). A cluster at cluster.address keeps what its nodes were started with (RAY_worker_niceness)."""


@dataclass
class HeldOutConfig:
    """The trainers' held-out curve (the `eval` section of es-train and grpo-train)."""

    every: int = 6
    """Score the current (unperturbed) weights on the held-out set every k iterations / steps (and at the first;
    0: never): greedy reward, and pass@1 and token entropy of completions sampled at eval.temperature."""
    temperature: float = 1.0
    """Sampling temperature of the held-out pass@1 and entropy (> 0)."""
    top_p: float = 1.0
    """Nucleus of the held-out sampling (es-compare sets both to its eval.temperature / eval.top_p)."""
    max_new_tokens: int = 0
    """Completion length of the held-out scoring (0: the training sampling's max_new_tokens)."""


QUIET_FLAG = "ES_RAY_QUIET"
"""Set to 1 in an actor's environment when run.verbose=false (``es_ray.runtime.cluster.QUIET_ENV``): the actor's
first act (``quiet_third_party``) and the engines read it before any third-party import."""


@dataclass
class RunConfig:
    dir: str = ""
    """Absolute run directory (created); empty makes <run.root>/<method>-<timestamp>."""
    root: str = ""
    """Absolute parent of the default run directory, e.g. shared storage on a cluster (empty: ./runs)."""
    seed: int = 0
    """Run seed: the noise of member i of iteration t on tensor `name` is a function of (seed, t, i, name)."""
    checkpoint_every: int = 0
    """Write a checkpoint every k iterations / steps (0: only the final one)."""
    keep_checkpoints: int = 2
    """Keep the newest k numbered checkpoints (periodic, stop-time) besides checkpoints/final and an extended run's
    earlier finals (never deleted); older ones are deleted once a newer one is written (0: keep all)."""
    resume: bool = False
    """Continue the run in run.dir from its last checkpoint (ES: plus a replay of the seed log since it); the
    result equals an uninterrupted run. A run.dir with nothing to resume starts a new run."""
    stop_at_tokens: int = 0
    """Stop after the iteration / step at which the run has generated this many training tokens (0: no limit;
    es-compare's budget.unit=tokens sets it)."""
    stop_at_device_seconds: float = 0.0
    """Stop after the iteration / step at which the run's actors have held this many device-seconds (the ledger's
    measure; 0: no limit; es-compare's budget.unit=device_seconds sets it)."""
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Metric backends besides metrics.jsonl: any of tensorboard, wandb, mlflow (offline by default; [] for none)."""
    progress: bool = True
    """A progress bar when stderr is a terminal (the training reward and the task's held-out metric: the reward
    where it is dense, else pass@1); false, or no terminal (Ray Jobs, Slurm), prints one line per step and per
    held-out scoring instead."""
    verbose: bool = False
    """Let third-party output through: the actors' transformers weight-loading bars, vLLM's info lines (Triton's
    included) and Ray's token-auth banner; false keeps them out of the run's log (errors always show)."""
    overwrite: bool = False
    """A new run into a run.dir that holds another run: refused unless true, which first moves the old run aside to
    <run.dir>.replaced-<timestamp> (never mixed with it)."""


@dataclass
class FaultPolicy:
    """How long an actor may stay silent and how many dead actors a run replaces (every method's `faults`)."""

    actor_timeout_s: float = 1800.0
    """An actor call unanswered this long counts as a dead actor: it is killed and replaced (0: wait forever).
    A killed process or a lost node is noticed by Ray itself, without waiting for this."""
    max_replacements: int = 8
    """Dead actors replaced per run before the run stops (it can then be resumed with run.resume=true)."""
    placement_timeout_s: float = 300.0
    """A replacement actor Ray cannot place this long (its node lost and no spare capacity: the placement group
    stays in RESCHEDULING) stops the run: a checkpoint from a live actor and the resume command (0: wait forever)."""
    unavailable_retries: int = 3
    """A call that fails with Ray's ActorUnavailableError (a transient network or node hiccup) is sent again this
    many times, after 1, 2, 4 ... s, before its actor counts as dead."""
    stop_timeout_s: float = 120.0
    """After SIGTERM / Ctrl-C the run ends within this long, checkpoint or not (a second signal ends it at once)."""


# -- shared validation -----------------------------------------------------------------------------------------


def validate_sampling(sampling: SamplingConfig, key: str = "sampling") -> None:
    check_positive(f"{key}.max_new_tokens", sampling.max_new_tokens)
    check_positive(f"{key}.temperature", sampling.temperature, allow_zero=True)
    check_top_p(f"{key}.top_p", sampling.top_p)


def check_top_p(key: str, value: float) -> None:
    """A nucleus: a probability mass in (0, 1] (1: every token)."""
    if not 0 < value <= 1:
        raise ConfigError(f"{key}={value} must be in (0, 1] (1: every token)")


def validate_held_out(held_out: HeldOutConfig) -> None:
    """The trainers' eval section: its cadence, and the sampling of its pass@1 and entropy (unused, so unchecked, when
    eval.every=0: es-compare's greedy evaluation with curve_every=0 hands its temperature 0 through)."""
    check_positive("eval.every", held_out.every, allow_zero=True)
    if not held_out.every:
        return
    check_positive("eval.temperature", held_out.temperature)
    check_top_p("eval.top_p", held_out.top_p)
    check_positive("eval.max_new_tokens", held_out.max_new_tokens, allow_zero=True)


def validate_faults(faults: FaultPolicy) -> None:
    check_positive("faults.actor_timeout_s", faults.actor_timeout_s, allow_zero=True)
    check_positive("faults.max_replacements", faults.max_replacements, allow_zero=True)
    check_positive("faults.placement_timeout_s", faults.placement_timeout_s, allow_zero=True)
    check_positive("faults.unavailable_retries", faults.unavailable_retries, allow_zero=True)
    check_positive("faults.stop_timeout_s", faults.stop_timeout_s)


# -- conversion -----------------------------------------------------------------------------------------------


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    kwargs = {}
    names = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(key, sorted(names), n=1)
            hint = f"did you mean {where}{close[0]}? " if close else ""
            raise ConfigError(f"unknown key {where}{key}; {hint}known keys: {', '.join(sorted(names))}")
        sub = names[key].default_factory if names[key].default_factory is not dataclasses.MISSING else None
        if sub is not None and dataclasses.is_dataclass(sub) and isinstance(value, dict):
            kwargs[key] = _build(sub, value, f"{where}{key}.")
        else:
            kwargs[key] = value
    return cls(**kwargs)


def to_config(cfg: Any, cls: type) -> Any:
    """Composed DictConfig (or plain dict) -> the dataclass ``cls`` (not yet validated)."""
    if not isinstance(cfg, dict):
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(cfg, resolve=True)
    cfg = {k: v for k, v in cfg.items() if k != "hydra"}
    return _build(cls, cfg, "")


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dict -> dotted keys (the `hydra` key at the top is dropped)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and not (prefix == "" and k == "hydra"):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
