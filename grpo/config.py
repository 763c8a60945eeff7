"""Typed configuration for `grpo-train`: the runtime's shared sections (model, task, sampling, engine, cluster,
eval, run, faults) plus a GRPOConfig. The dataclasses are the Hydra schema; conf/grpo_train.yaml only picks
presets. Loss types and advantage scales are the registries of grpo.loss."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
from es_ray.grpo.learner_memory import OFFLOADS  # the learner's memory statement holds grpo.offload's values
from es_ray.grpo.loss_kinds import ADV_SCALES, LOSS_AGGREGATIONS
from es_ray.metrics.coverage import check_objective
from es_ray.runtime.validation import validate_trainer

# Hydra's ConfigStore is imported by register_configs only: the schema converts and checks without Hydra.

LEARNER_DTYPES = Registry(
    "grpo.dtype",
    {
        "float32": "fp32 weights, gradients, AdamW and compute",
        "bf16_mixed": "fp32 master weights, gradients and AdamW, bf16 compute (autocast; FSDP2's MixedPrecisionPolicy)",
    },
)
# Settings a resumed GRPO run may change besides the runtime's (es_ray.runtime.rundir.RESUME_FREE).
RESUME_FREE = frozenset({"grpo.steps", "cluster.num_actors"})


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
    """AdamW's decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW's first moment decay."""
    adam_beta2: float = 0.999
    """AdamW's second moment decay."""
    adam_eps: float = 1e-8
    """AdamW's epsilon."""
    warmup_steps: int = 0
    """Linear learning-rate warmup over this many optimizer steps."""
    dtype: str = "float32"
    """Learner precision (the rollout engines use engine.dtype). float32: fp32 weights, gradients, AdamW and compute.
    bf16_mixed: the same fp32 master weights, fp32 gradients and fp32 AdamW, with the forward and backward under
    torch.autocast(bfloat16) (no weight-cast cache); the LM head's log-softmax stays fp32. Chosen over bf16
    weights + an fp32 master copy: both hold 16 bytes per trainable parameter, but here gradients accumulate over
    micro-batches in fp32, the optimizer and checkpoints are plain torch, and nothing is cast back after a step.
    Pure bf16 weights are refused: an AdamW step of ~lr = 1e-5 is below half of bf16's spacing near 1 (2^-8) and
    vanishes."""
    logit_chunk_tokens: int = 1024
    """Completion positions whose [chunk, vocabulary] logits exist at once: the LM head, log-softmax at the sampling
    temperature, token log-prob and entropy run this many positions at a time, each chunk recomputed in the
    backward pass (torch.utils.checkpoint), so the learner never holds N x vocabulary logits."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more learner time)."""
    fsdp_size: int = 1
    """Learner ranks: an actor group of this many processes (one device each) in one torch.distributed group (NCCL on
    GPU, gloo on CPU), the model sharded with FSDP2 (fully_shard per decoder layer and at the root), each rank running
    its share of every micro-batch. Must divide grpo.micro_batch_size and the batch (prompts_per_step x group_size).
    1: one learner process, no torch.distributed."""
    offload: str = "none"
    """none; optimizer: AdamW's moments and its step on the host (the device keeps weights and gradients); all:
    FSDP2's CPUOffloadPolicy (sharded weights, gradients and AdamW on the host, each layer copied in for its pass)."""
    colocate: bool = False
    """Each rollout engine shares its device with a learner rank: on CPU one actor holds both (no core idles while
    the other phase runs); on GPU vLLM sleeps (sleep mode level 2) while the learner trains."""
    sync_tolerance: float = 0.0
    """Largest |log p_engine - log p_learner| over the probe tokens accepted after a weight sync. 0: calibrated at
    the first sync, max(2e-3, 4 x the difference measured there) (grpo.driver.sync_tolerance); > 0: this value."""


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
    eval: HeldOutConfig = field(default_factory=HeldOutConfig)
    run: RunConfig = field(default_factory=RunConfig)
    faults: FaultPolicy = field(default_factory=FaultPolicy)


def validate_grpo(cfg: GRPOTrainConfig) -> GRPOTrainConfig:
    g = cfg.grpo
    if g.group_size < 2:
        raise ConfigError(
            f"grpo.group_size={g.group_size}: a group needs at least 2 completions to have a mean to "
            "compare with; set grpo.group_size>=2"
        )
    check_objective(cfg.task.objective, cfg.task.objective_k, g.group_size, "grpo.group_size")
    if g.prompts_per_step < 1:
        raise ConfigError(
            f"grpo.prompts_per_step={g.prompts_per_step} must be >= 1; set grpo.prompts_per_step=1 or more"
        )
    if g.beta < 0:
        raise ConfigError(f"grpo.beta={g.beta} must be >= 0 (0 disables the KL term and the reference model)")
    LOSS_AGGREGATIONS.check(g.loss_type)
    ADV_SCALES.check(g.adv_scale)
    if g.dtype == "bfloat16":
        raise ConfigError(
            "grpo.dtype=bfloat16 (bf16 weights under AdamW) loses small steps: an update of ~lr=1e-5 "
            "is below bf16's rounding of weights near 1 (2^-8) and vanishes; set grpo.dtype=bf16_mixed "
            "(fp32 master weights and AdamW, bf16 compute) or grpo.dtype=float32"
        )
    LEARNER_DTYPES.check(g.dtype)
    check_positive("grpo.logit_chunk_tokens", g.logit_chunk_tokens)
    check_positive("grpo.steps", g.steps, allow_zero=True)
    check_positive("grpo.lr", g.lr, allow_zero=True)
    check_positive("grpo.clip_eps", g.clip_eps)
    check_positive("grpo.clip_eps_high", g.clip_eps_high, allow_zero=True)
    check_positive("grpo.adv_eps", g.adv_eps)
    check_positive("grpo.epochs_per_batch", g.epochs_per_batch)
    check_positive("grpo.micro_batch_size", g.micro_batch_size)
    check_positive("grpo.max_grad_norm", g.max_grad_norm, allow_zero=True)
    check_positive("grpo.weight_decay", g.weight_decay, allow_zero=True)
    check_positive("grpo.warmup_steps", g.warmup_steps, allow_zero=True)
    check_positive("grpo.sync_tolerance", g.sync_tolerance, allow_zero=True)
    OFFLOADS.check(g.offload)
    check_fsdp(cfg)
    if cfg.sampling.temperature <= 0:
        raise ConfigError(
            f"sampling.temperature={cfg.sampling.temperature}: GRPO samples its groups, and greedy "
            "decoding gives every completion of a group the same reward (advantage 0); set "
            "sampling.temperature>0, e.g. 1.0"
        )
    if cfg.sampling.top_p < 1:
        raise ConfigError(
            f"sampling.top_p={cfg.sampling.top_p}: GRPO's ratio and KL are taken against the sampling "
            "distribution, and the learner scores the full softmax(logits / temperature), not a nucleus "
            "truncated by top_p; set sampling.top_p=1.0 (and shape the distribution with "
            "sampling.temperature)"
        )
    validate_trainer(cfg)
    return cfg


def check_fsdp(cfg: GRPOTrainConfig) -> None:
    """grpo.fsdp_size against the batch (the devices are checked once connected: grpo.driver.check_devices)."""
    g = cfg.grpo
    if g.fsdp_size < 1:
        raise ConfigError(
            f"grpo.fsdp_size={g.fsdp_size}: the learner needs at least one rank; set grpo.fsdp_size=1 "
            "(one process) or more"
        )
    if g.colocate and cfg.cluster.num_actors != g.fsdp_size:
        raise ConfigError(
            f"grpo.colocate=true puts one rollout engine beside each learner rank: cluster.num_actors="
            f"{cfg.cluster.num_actors} rollout actors but grpo.fsdp_size={g.fsdp_size} ranks; set "
            f"cluster.num_actors={g.fsdp_size}"
        )
    batch = g.prompts_per_step * g.group_size
    for key, n in (
        ("grpo.micro_batch_size", g.micro_batch_size),
        ("the batch (grpo.prompts_per_step x grpo.group_size)", batch),
    ):
        if n % g.fsdp_size:
            raise ConfigError(
                f"grpo.fsdp_size={g.fsdp_size} does not divide {key}={n}: every rank runs an equal "
                f"share of every micro-batch; set grpo.fsdp_size to a divisor of {n}, or change {key}"
            )


def to_grpo_config(cfg: Any) -> GRPOTrainConfig:
    """Composed DictConfig (or plain dict) -> validated GRPOTrainConfig."""
    return validate_grpo(to_config(cfg, GRPOTrainConfig))


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="grpo_train_schema", node=GRPOTrainConfig)
