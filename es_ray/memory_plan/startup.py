"""The start-up check: every trainer (es-train, grpo-train, each es-compare stage) plans its memory from the model's
config.json and its actual settings before any model is loaded, against the device it will run on, and refuses what
cannot fit, naming the keys that would make it fit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from es_ray.core.config import ConfigError
from es_ray.core.memory import CUDA_CONTEXT_BYTES, GiB, gib
from es_ray.engine_memory import vllm_batch_defaults
from es_ray.memory_plan.plan import (
    PLAN_MARGIN,
    PLANNERS,
    PROMPT_TOKENS,
    MemoryPlan,
    Settings,
    engine_share,
    usable_bytes,
)
from es_ray.model_shape import PRESETS, ModelShape, preset
from es_ray.models import EMBEDDED_NAMES, cache_root
from es_ray.perturbation import PERTURBATIONS

HOST_SHARE = 0.9
"""Share of the host's RAM a CPU run may plan to use (the OS, Ray's object store and the driver keep the rest)."""


def model_shape(path: str) -> ModelShape | None:
    """The shape of model.path without loading or downloading anything: a local directory's config.json, a paper
    preset's hub id, the converted embedded model, or a hub id already in the local cache; None when unknown."""
    ref = (path or "").strip()
    if ref in EMBEDDED_NAMES:
        local = cache_root() / "SmolLM2-135M-Instruct-hf"
    else:
        local = Path(ref).expanduser()
    if (local / "config.json").is_file():
        return ModelShape.from_dir(local)
    for name, spec in PRESETS.items():
        if ref in (name, spec["hub"]):
            return preset(name)
    try:
        from huggingface_hub import try_to_load_from_cache  # optional here: only a hub id's cached config needs it

        cached = try_to_load_from_cache(ref, "config.json")
        if isinstance(cached, str):
            return ModelShape.from_hf_config(json.loads(Path(cached).read_text()), name=ref)
    except Exception:  # not a hub id, or no cache
        pass
    return None


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype in ("float32", "fp32") else 2  # auto is bf16 on GPU (and on CPU for the engines here)


def _engine(cfg, shape: ModelShape, sequences: int, new_tokens: int, card: int, device_name: str = "") -> dict:
    e = cfg.engine
    tokens = e.max_model_len or PROMPT_TOKENS + new_tokens
    floor = (e.max_model_len or shape.max_position_embeddings) if e.name == "vllm" else 0
    return dict(
        engine_dtype_bytes=_dtype_bytes(e.dtype),
        tensor_parallel_size=e.tensor_parallel_size,
        sequences=max(1, sequences),
        tokens_per_sequence=tokens,
        kv_floor_tokens=floor,
        trainable=cfg.model.trainable,
        **vllm_batch_defaults(card, device_name),
    )


def settings_for(kind: str, cfg, shape: ModelShape, card: int = 80 * GiB, device_name: str = "") -> Settings:
    """The plan's Settings from a trainer's config: kind es (ESTrainConfig), grpo (GRPOTrainConfig) or eval (any
    config with engine, eval.max_new_tokens and model sections); ``card``: the bytes the GPU reports, ``device_name``
    its name (vLLM's batch defaults read both)."""
    if kind == "grpo":
        g = cfg.grpo
        per_engine = -(-g.prompts_per_step * g.group_size // max(1, cfg.cluster.num_actors))
        return Settings(
            **_engine(cfg, shape, per_engine, cfg.sampling.max_new_tokens, card, device_name),
            card_bytes=card,
            gpu_memory_utilization=cfg.engine.gpu_memory_utilization,
            learner=g.dtype,
            micro_batch_size=g.micro_batch_size,
            completion_tokens=cfg.sampling.max_new_tokens,
            logit_chunk_tokens=g.logit_chunk_tokens,
            gradient_checkpointing=g.gradient_checkpointing,
            reference_model=g.beta > 0,
            fsdp_size=g.fsdp_size,
            offload=g.offload,
            colocate=g.colocate,
        )
    if kind == "es":
        es = cfg.es
        members = PERTURBATIONS.get(es.perturbation).members_at_once(es.population, cfg.cluster.num_actors)
        sequences = es.prompts_per_iteration * max(1, members)
        return Settings(
            **_engine(cfg, shape, sequences, cfg.sampling.max_new_tokens, card, device_name),
            optimizer=es.optimizer,
            anchor_decay=es.anchor_decay,
            noise=es.noise,
            noise_table_size=es.noise_table_size,
            perturbation=es.perturbation,
            rank=es.rank,
            members=members,
        )
    if kind == "eval":
        return Settings(**_engine(cfg, shape, cfg.engine.batch_size, cfg.eval.max_new_tokens, card, device_name))
    raise ValueError(f"no memory plan for {kind!r}; one of {', '.join(PLANNERS)}")


def plan_for(kind: str, cfg, shape: ModelShape, card: int = 80 * GiB, device_name: str = "") -> MemoryPlan:
    return PLANNERS[kind](shape, settings_for(kind, cfg, shape, card, device_name))


def colocated_engine_share(cfg, reported: int, device_name: str = "") -> float | None:
    """engine.gpu_memory_utilization for the rollout engine of a colocated GRPO rank on a GPU reporting ``reported``
    bytes: ``engine_share`` of the plan the start-up check accepts (None: the model's shape is unknown)."""
    shape = model_shape(cfg.model.path)
    return None if shape is None else engine_share(plan_for("grpo", cfg, shape, reported, device_name))


def on_gpu(cfg) -> bool:
    return cfg.cluster.gpus_per_actor > 0 or cfg.engine.device.startswith("cuda")


def gpu_reported_bytes() -> int | None:
    """Memory of this machine's smallest GPU, without creating a CUDA context here (nvidia-smi; the driver must not
    take memory on GPU 0 that an actor then lacks); None when this machine shows no GPU (a remote cluster's head: the
    GRPO learner checks its own device before it loads the model)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        sizes = [int(x) for x in out.split() if x.strip().isdigit()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return min(sizes) * (1 << 20) if sizes else None  # MiB


def gpu_name() -> str:
    """This machine's first GPU's name (nvidia-smi), "" when none shows: vLLM's batch defaults read it."""
    if not shutil.which("nvidia-smi"):
        return ""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return (out.splitlines() or [""])[0].strip()


def host_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_plan_bytes(kind: str, plan: MemoryPlan, cfg) -> tuple[int, str]:
    """A CPU run's processes all on this host: (bytes, how) summed over them, the GPU-only lines left out (the
    transformers engine has no vLLM allowance, KV pool or CUDA context)."""
    per = {
        p: sum(line.nbytes for line in plan.lines if line.part == p and not line.gpu_only)
        for p in ("vllm", "es", "learner", "host")
    }
    n = max(1, cfg.cluster.num_actors)
    if kind == "grpo":
        f = max(1, cfg.grpo.fsdp_size)
        total = f * (per["learner"] + per["host"]) + n * per["vllm"]
        return total, (
            f"{f} learner rank(s) x {gib(per['learner'] + per['host'])} + {n} rollout(s) x {gib(per['vllm'])}"
        )
    if kind == "es":
        return n * (per["vllm"] + per["es"]), f"{n} ES actor(s) x {gib(per['vllm'] + per['es'])}"
    return n * per["vllm"], f"{n} engine(s) x {gib(per['vllm'])}"


def startup_check(
    kind: str,
    cfg,
    reported: int | None = None,
    host: int | None = None,
    shape: ModelShape | None = None,
    gpu: bool | None = None,
    device_name: str | None = None,
) -> MemoryPlan | None:
    """Refuse (ConfigError: the numbers and the keys that would make it fit) a run whose plan does not fit the
    device it will run on, before any model is loaded. GPU: each GPU's plan against ``reported`` bytes (default: this
    machine's smallest GPU; unknown: no check here), less usable_bytes's margin; CPU with a local Ray (cluster.address
    empty): every actor's bytes summed against HOST_SHARE of the host's RAM; CPU on a cluster: not checked here.
    Returns the plan checked (None: the model's shape is unknown, or no GPU is visible here)."""
    shape = shape or model_shape(cfg.model.path)
    if shape is None:
        return None
    if on_gpu(cfg) if gpu is None else gpu:
        reported = gpu_reported_bytes() if reported is None else reported
        if reported is None:
            return None
        name = gpu_name() if device_name is None else device_name
        plan, usable = plan_for(kind, cfg, shape, reported, name), usable_bytes(reported)
        share = cfg.engine.gpu_memory_utilization
        if kind == "es" and share:
            message = plan.refusal(usable, free_bytes=usable - int(share * reported), share=share)
        else:
            message = plan.refusal(usable)
        if message:
            raise ConfigError(
                f"{message} [memory plan: {gib(usable)} usable of the {gib(reported)} the GPU reports "
                f"(less {PLAN_MARGIN:.0%} margin and {gib(CUDA_CONTEXT_BYTES)} CUDA context); every "
                "line: python -m es_ray.memory_plan --detail]"
            )
        return plan
    plan = plan_for(kind, cfg, shape)
    if cfg.cluster.address:  # the actors run on the cluster's nodes, not on this host: each is sized by its node
        return plan
    need, how = host_plan_bytes(kind, plan, cfg)
    have = int(HOST_SHARE * (host_bytes() if host is None else host))
    if need > have:
        fixes = {
            "grpo": "grpo.fsdp_size (the learner's state is split over the ranks, which a CPU host holds all of: "
            "only more hosts help), grpo.gradient_checkpointing=true, a smaller grpo.micro_batch_size, "
            "model.trainable=REGEX or a smaller model",
            "es": "fewer cluster.num_actors, es.optimizer=sgd, model.trainable=REGEX or a smaller model",
            "eval": "fewer cluster.num_actors or a smaller model",
        }[kind]
        raise ConfigError(
            f"{shape.name}: this CPU run needs {gib(need)} of host memory ({how}) but "
            f"{gib(have)} ({HOST_SHARE:.0%} of the host's RAM) is available; change {fixes}"
        )
    return plan
