"""Typed configuration for `grpo-train`: es_ray's sections (model, task, sampling, engine, cluster, eval, run) plus
a GRPOConfig. The dataclasses are the Hydra schema; conf/grpo_train.yaml only picks presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from es_ray.config import (ClusterConfig, ConfigError, EngineConfig, ESConfig, EvalConfig, ModelConfig, RunConfig,
                           SamplingConfig, TaskConfig, TrainConfig, _choice, _positive, validate)

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
ADV_SCALES = ("group", "batch", "none")
LEARNER_DTYPES = ("float32", "bfloat16")


@dataclass
class GRPOConfig:
    steps: int = 12
    """Optimizer steps (one batch of prompts_per_step x group_size completions each, epochs_per_batch passes)."""
    lr: float = 1e-5
    """AdamW learning rate (constant after warmup_steps of linear warmup)."""
    group_size: int = 8
    """Completions sampled per prompt (G); advantages are relative to the group."""
    prompts_per_step: int = 4
    """Prompts per step, drawn from the task's training pool (fixed by run.seed and the step)."""
    beta: float = 0.0
    """Weight of the k3 KL to the frozen initial model; the reference model is loaded only when beta > 0."""
    loss_type: str = "grpo"
    """grpo: mean of per-sequence token means; dr_grpo: token sum / (sequences x max_new_tokens);
    dapo: token mean over the whole batch (formulas in grpo/loss.py)."""
    clip_eps: float = 0.2
    """Lower clip of the ratio (1 - clip_eps), and the upper one unless clip_eps_high is set."""
    clip_eps_high: float = 0.0
    """Upper clip 1 + clip_eps_high (DAPO's clip-higher, e.g. 0.28); 0: the same as clip_eps."""
    adv_scale: str = "group"
    """Advantage (r - group mean) divided by: group (the group's std), batch (the whole batch's std), none."""
    adv_eps: float = 1e-6
    """Added to the std before dividing; a group whose rewards are all equal has advantage 0."""
    epochs_per_batch: int = 1
    """Optimizer steps on each batch; the log-probs before the first one are kept as the ratio's old policy."""
    micro_batch_size: int = 16
    """Sequences per forward/backward pass (gradients are accumulated over the batch)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0: no clipping; the norm is logged either way)."""
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    warmup_steps: int = 0
    """Linear learning-rate warmup over this many optimizer steps."""
    dtype: str = "float32"
    """Learner weights and optimizer: float32 or bfloat16 (the rollout engines use engine.dtype)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more learner time)."""
    sync_tolerance: float = 0.0
    """Largest |log p_engine - log p_learner| over the probe tokens accepted after a weight sync (0: 2e-3 when
    both sides are float32, 0.25 otherwise: bf16 rounding alone moves single-token log-probs by ~0.1)."""


@dataclass
class GRPOSamplingConfig(SamplingConfig):
    """es_ray's sampling section with GRPO's defaults: groups must be sampled (temperature > 0)."""

    max_new_tokens: int = 16
    temperature: float = 1.0


@dataclass
class GRPOClusterConfig(ClusterConfig):
    """es_ray's cluster section; num_actors counts rollout actors (the learner is one more actor, asking for the
    same cpus_per_actor and gpus_per_actor)."""

    num_actors: int = 1


@dataclass
class GRPOEngineConfig(EngineConfig):
    """es_ray's engine section; ``threads`` also sets the learner's torch threads on CPU."""

    threads: int = 2
    """torch threads per actor, learner included (0: cluster.cpus_per_actor). GRPO's phases alternate (generate,
    train, sync), so on the 2-core CPU demo each actor uses both cores while the other waits."""


@dataclass
class GRPOTrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    sampling: GRPOSamplingConfig = field(default_factory=GRPOSamplingConfig)
    engine: GRPOEngineConfig = field(default_factory=GRPOEngineConfig)
    cluster: GRPOClusterConfig = field(default_factory=GRPOClusterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)


def validate_grpo(cfg: GRPOTrainConfig) -> GRPOTrainConfig:
    g = cfg.grpo
    if g.group_size < 2:
        raise ConfigError(f"grpo.group_size={g.group_size}: a group needs at least 2 completions to have a mean to "
                          "compare with; set grpo.group_size>=2")
    if g.prompts_per_step < 1:
        raise ConfigError(f"grpo.prompts_per_step={g.prompts_per_step} must be >= 1; set grpo.prompts_per_step=1 "
                          "or more")
    if g.beta < 0:
        raise ConfigError(f"grpo.beta={g.beta} must be >= 0 (0 disables the KL term and the reference model)")
    _choice("grpo.loss_type", g.loss_type, LOSS_TYPES)
    _choice("grpo.adv_scale", g.adv_scale, ADV_SCALES)
    _choice("grpo.dtype", g.dtype, LEARNER_DTYPES)
    _positive("grpo.steps", g.steps, allow_zero=True)
    _positive("grpo.lr", g.lr, allow_zero=True)
    _positive("grpo.clip_eps", g.clip_eps)
    _positive("grpo.clip_eps_high", g.clip_eps_high, allow_zero=True)
    _positive("grpo.adv_eps", g.adv_eps)
    _positive("grpo.epochs_per_batch", g.epochs_per_batch)
    _positive("grpo.micro_batch_size", g.micro_batch_size)
    _positive("grpo.max_grad_norm", g.max_grad_norm, allow_zero=True)
    _positive("grpo.weight_decay", g.weight_decay, allow_zero=True)
    _positive("grpo.warmup_steps", g.warmup_steps, allow_zero=True)
    _positive("grpo.sync_tolerance", g.sync_tolerance, allow_zero=True)
    if cfg.sampling.temperature <= 0:
        raise ConfigError(f"sampling.temperature={cfg.sampling.temperature}: GRPO samples its groups, and greedy "
                          "decoding gives every completion of a group the same reward (advantage 0); set "
                          "sampling.temperature>0, e.g. 1.0")
    # The shared sections (engine, sampling, cluster, task, run) are checked by es_ray's own validation, through
    # an ES config that carries them (its population is set so that the ES-only checks pass).
    validate(TrainConfig(model=cfg.model, task=cfg.task, es=ESConfig(population=max(2, cfg.cluster.num_actors)),
                         sampling=cfg.sampling, engine=cfg.engine, cluster=cfg.cluster, eval=cfg.eval, run=cfg.run))
    return cfg


def to_grpo_config(cfg: Any) -> GRPOTrainConfig:
    """Composed DictConfig (or plain dict) -> validated GRPOTrainConfig."""
    from es_ray.config import to_config

    return validate_grpo(to_config(cfg, GRPOTrainConfig))


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="grpo_train_schema", node=GRPOTrainConfig)


def replace(cfg: GRPOTrainConfig, **sections: Any) -> GRPOTrainConfig:
    """A copy with some fields of sections replaced: replace(cfg, grpo={"steps": 2})."""
    out = {k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()}
    return dataclasses.replace(cfg, **out)
