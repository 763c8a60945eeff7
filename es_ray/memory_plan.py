"""GPU memory plan of one ES actor, or of one GRPO learner and its rollout GPUs, from the model's HF config alone.

Pure arithmetic (no torch): ``python -m es_ray.memory_plan`` prints the paper's four models on 24, 40 and 80 GB
cards (docs/memory-plan.md's table); the vLLM engine sizes vLLM's share of the GPU from it when
engine.gpu_memory_utilization=0, and its ES replica host checks it against the free memory before the first
generation, so a run that cannot fit stops at start-up, not after a whole iteration.

The plan itemises nothing itself: each part states what it allocates, as ``Line``s (es_ray/core/memory.py), and
the plan sums them per GPU. One ES actor is one process holding vLLM and the replica (es_ray/replica.py) on the same
GPU: the engine's lines (es_ray/engines/memory.py: weights, KV cache, allowance, LoRA slots;
engine.gpu_memory_utilization = their sum / card) and the replica's (es_ray/replica_memory.py: master, optimizer
state, theta_0, its buffers, the noise source's memory, slack). A GRPO learner rank (a GPU of its own) holds the
learner's lines (grpo/learner_memory.py: weights, gradients and AdamW in one of ``LEARNER_VARIANTS``, one chunk of
logits, a micro-batch's activations) and its build's; its rollout engines are vLLM on other GPUs, or on its own with
grpo.colocate. Sizes are in bytes; GiB = 2**30, and an "N GB card" is what such a card reports (``CARD_GIB``; the
plan is a bound to check against, not a measurement: the check in the engine reads ``torch.cuda.mem_get_info``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from es_ray.core.memory import ALLOCATOR_SLACK_BYTES, CUDA_CONTEXT_BYTES, GiB, Line, gib
from es_ray.engines.memory import MAX_SHARE, SLEEPING_BYTES, engine_lines, vllm_batch_defaults
from es_ray.grpo.learner_memory import (LEARNER_VARIANTS, LOGIT_COPIES, OFFLOADS, RESIDENT,  # noqa: F401 - callers'
                                        LearnerVariant, build_lines, learner_lines)
from es_ray.model_shape import LLAMA_3_1_8B, PRESETS, ModelShape, preset  # noqa: F401 - callers' names
from es_ray.noise_kinds import NOISE_MEMORY
from es_ray.perturbation import PERTURBATIONS
from es_ray.replica_memory import TensorPart, replica_lines
from es_ray.replica_spec import selects

ES_SLACK_BYTES = ALLOCATOR_SLACK_BYTES
"""The allocator's slack beside a part's tensors (es_ray/core/memory.py); scripts/gpu_smoke.py's tolerance."""
TP_DEGREES = (1, 2, 4, 8)
FSDP_DEGREES = (2, 4, 8)
"""grpo.fsdp_size values a refusal suggests (one 8-GPU node)."""
PLAN_MARGIN = 0.02
"""Share of the card the plan keeps free beyond its lines: what no line itemises (NCCL buffers, fragmentation
beyond the slack line, another library's small workspace)."""
CARD_GIB = {24: 22.0, 40: 39.4, 80: 79.6, 141: 140.4}
"""What an "N GB" card reports (torch.cuda.get_device_properties().total_memory, GiB): 80 is an H100 SXM
(79.6 GiB; an A100-80GB reports slightly less, 79.2), 141 an H200 (140.4 GiB); 24 (L4 / A10 class) and 40 (A100-40GB)
are the smaller cards' reports as assumed here. A card size not listed is planned as that many GiB."""
CARD_NAMES = {24: "NVIDIA L4", 40: "NVIDIA A100-SXM4-40GB", 80: "NVIDIA H100 80GB HBM3", 141: "NVIDIA H200"}
"""The device name each CARD_GIB card is planned with (vLLM's batch defaults read it: ``vllm_batch_defaults``)."""
PROMPT_TOKENS = 512
"""Prompt tokens per sequence the start-up plans assume (chat template + problem; GSM8K and DeepScaleR prompts stay
under it) when engine.max_model_len is not set."""


# -- the run's settings -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """What the plan needs besides the model; each field names the config key it stands for."""

    engine_dtype_bytes: int = 2
    """engine.dtype: 2 for bfloat16 (auto on GPU), 4 for float32."""
    tensor_parallel_size: int = 1
    """engine.tensor_parallel_size."""
    sequences: int = 32
    """Sequences whose KV cache vLLM holds at once (ES: es.prompts_per_iteration; GRPO: prompts x group)."""
    tokens_per_sequence: int = 1024
    """Prompt + completion tokens per sequence (engine.max_model_len; vLLM needs at least one such sequence)."""
    max_num_batched_tokens: int = 16384
    """vLLM's profile-run batch (``vllm_batch_defaults``: 16384 on an H100 / H200, 8192 on an A100 or a smaller
    card)."""
    max_num_seqs: int = 1024
    """vLLM's largest decode batch (``vllm_batch_defaults``: 1024 on an H100 / H200, 256 on an A100 or smaller)."""
    optimizer: str = "sgd"
    """es.optimizer."""
    anchor_decay: float = 0.0
    """es.anchor_decay (non-zero keeps theta_0)."""
    noise: str = "auto"
    """es.noise: per_tensor, counter, table, or auto (on GPU one of the first two, es_ray.noise.resolve_kind's choice:
    planned as the larger of both)."""
    noise_table_size: int = 1 << 25
    """es.noise_table_size (es.noise=table)."""
    trainable: str = ""
    """model.trainable (regex on HF names; empty: all)."""
    master_sharded: bool = True
    """Each tensor-parallel rank keeps the master, Adam moments and theta_0 of its own shard of every tensor
    (``vllm_extension.tensor_parallel_parts``); False plans a whole master on every rank."""
    learner: str = "float32"
    """GRPO learner precision, a LEARNER_VARIANTS name (grpo.dtype: float32 or bf16_mixed)."""
    micro_batch_size: int = 16
    """grpo.micro_batch_size."""
    completion_tokens: int = 512
    """GRPO: completion tokens per sequence (sampling.max_new_tokens): the positions that get logits."""
    logit_chunk_tokens: int = 1024
    """grpo.logit_chunk_tokens: completion positions whose [chunk, V] logits exist at once."""
    gradient_checkpointing: bool = True
    """grpo.gradient_checkpointing (without it a 7B learner's activations alone exceed any card at these sizes)."""
    reference_model: bool = False
    """grpo.beta > 0: a frozen reference copy of the weights."""
    fsdp_size: int = 1
    """grpo.fsdp_size: learner ranks; weights, gradients and AdamW are split over them (FSDP2), each rank runs
    1/fsdp_size of every micro-batch."""
    offload: str = "none"
    """grpo.offload (OFFLOADS)."""
    colocate: bool = False
    """grpo.colocate: each rollout engine shares its GPU with a learner rank and sleeps (vLLM sleep mode level 2:
    weights discarded, KV cache dropped) while the learner trains; awake, vLLM holds ``engine_share`` of the card."""
    kv_floor_tokens: int = 0
    """vLLM keeps KV cache for at least one sequence of max_model_len tokens (engine.max_model_len, else the model's
    max_position_embeddings): the KV cache is planned as max(sequences x tokens_per_sequence, this)."""
    perturbation: str = "full"
    """es.perturbation: lowrank adds each member's factors (fp32, the ES side) and vLLM's LoRA slots."""
    rank: int = 8
    """es.rank (es.perturbation=lowrank)."""
    members: int = 0
    """Members one actor generates together under es.perturbation=lowrank (vLLM's LoRA slots)."""
    card_bytes: int = 0
    """What the GPU reports (total_memory): a colocated engine's share is of it (``engine_share``); 0: not known,
    vLLM planned at its own part."""
    gpu_memory_utilization: float = 0.0
    """engine.gpu_memory_utilization (0: the share ``engine_share`` gives the colocated engine)."""


# -- the plan ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPlan:
    model: ModelShape
    method: str
    """es: vLLM and the replica on one GPU; grpo: the learner's GPU, and vLLM on each rollout GPU."""
    settings: Settings
    lines: tuple[Line, ...] = field(default=())

    def part(self, name: str) -> int:
        return sum(line.nbytes for line in self.lines if line.part == name)

    @property
    def gpus(self) -> dict[str, int]:
        """Bytes per GPU (one rank under tensor parallelism)."""
        if self.method == "es":
            return {"ES actor": self.part("vllm") + self.part("es")}
        if self.method == "eval":
            return {"engine": self.part("vllm")}
        if self.settings.colocate:  # rollouts with the learner's state resident; training beside a sleeping vLLM
            awake = self.vllm_mapped
            return {"colocated": max(self.part("learner") + SLEEPING_BYTES, self.learner_resident + awake,
                                     self.item_bytes("build", "learner build (device)") + awake)}
        return {"learner": self.part("learner"), "rollout": self.part("vllm")}

    @property
    def learner_resident(self) -> int:
        """A colocated learner rank's bytes that stay on the device while vLLM is awake (its weights, master, AdamW,
        reference and the allocator's slack; gradients and activations are freed after the step)."""
        return sum(line.nbytes for line in self.lines if line.part == "learner" and line.item in RESIDENT)

    @property
    def vllm_mapped(self) -> int:
        """What an awake vLLM holds on its GPU: engine_share x the card when the card is known (vLLM fills its share
        with KV cache, so that is what wake_up maps), else the plan's vLLM part."""
        card = self.settings.card_bytes
        return max(self.part("vllm"), int(engine_share(self) * card)) if card else self.part("vllm")

    @property
    def total(self) -> int:
        """The most any one GPU of the plan needs."""
        return max(self.gpus.values())

    def fits(self, card_bytes: int) -> bool:
        return self.total <= card_bytes

    def gpu_memory_utilization(self, card_bytes: int) -> float:
        """vLLM's share: (weights + KV cache + allowance) / card, rounded up to 0.01; the ES part fits in the rest
        when ``fits``."""
        return math.ceil(100 * self.part("vllm") / card_bytes) / 100

    def with_settings(self, **changes) -> MemoryPlan:
        return PLANNERS[self.method](self.model, replace(self.settings, **changes))

    def tp_needed(self, card_bytes: int) -> int | None:
        """The smallest engine.tensor_parallel_size with which the plan fits (None: none does)."""
        for tp in TP_DEGREES:
            if self.model.num_attention_heads % tp == 0 and \
                    self.with_settings(tensor_parallel_size=tp).fits(card_bytes):
                return tp
        return None

    def refusal(self, card_bytes: int, free_bytes: int | None = None, share: float | None = None) -> str | None:
        """None when the plan fits, else what does not fit, by how much, and what to change, each change with what
        it saves and whether it alone is enough. ``free_bytes``: measured free memory beside vLLM (default: card -
        the plan's vLLM part); ``share``: the engine.gpu_memory_utilization vLLM runs with."""
        if self.method == "grpo":
            return self._grpo_refusal(card_bytes)
        if self.method == "eval":
            if self.fits(card_bytes):
                return None
            tp = self.tp_needed(card_bytes)
            return (f"{self.model.name}: the evaluation engine needs {gib(self.part('vllm'))} on a "
                    f"{gib(card_bytes)} GPU: " + (f"set engine.tensor_parallel_size={tp}" if tp else
                                                    "set a shorter engine.max_model_len or use a larger card"))
        need = self.part("es")
        free = card_bytes - self.part("vllm") if free_bytes is None else free_bytes
        if need <= free:
            return None
        items = ", ".join(f"{line.item} {gib(line.nbytes)}" for line in self.lines if line.part == "es")
        where = (f"{gib(free)} are free beside vLLM (engine.gpu_memory_utilization={share:.2f} of {gib(card_bytes)})"
                 if share is not None else f"a {gib(card_bytes)} card leaves {gib(free)} beside vLLM's "
                 f"{gib(self.part('vllm'))}")
        room, floor = (card_bytes - need) / card_bytes, self.gpu_memory_utilization(card_bytes)
        if room < floor:
            fixes = [f"(no engine.gpu_memory_utilization leaves room: vLLM needs at least {floor:.2f} of the card)"]
        else:
            fixes = [f"engine.gpu_memory_utilization={math.floor(room * 100) / 100:.2f} (the most that leaves room "
                     f"for ES; vLLM needs at least {floor:.2f})"]
        tp = self.tp_needed(card_bytes) or max(t for t in TP_DEGREES if self.model.num_attention_heads % t == 0)
        changes = [("es.optimizer=sgd", {"optimizer": "sgd"}, ""), ("es.anchor_decay=0", {"anchor_decay": 0.0}, ""),
                   ("es.noise=per_tensor", {"noise": "per_tensor" if NOISE_MEMORY.get(self.settings.noise).table else
                                            self.settings.noise}, ""),
                   (f"engine.tensor_parallel_size={tp}", {"tensor_parallel_size": tp},
                    "; it splits vLLM's part" + (" and the master" if self.settings.master_sharded else
                                                 ", every rank keeps the whole master"))]
        for key, change, why in changes:
            alt = self.with_settings(**change)
            # a change of the ES part meets the same free memory; tensor parallelism shrinks vLLM's part
            short = alt.part("es") - (free if key.startswith("es.") else card_bytes - alt.part("vllm"))
            if alt.settings != self.settings and short < need - free:  # only what brings it closer
                fixes.append(f"{key} ({'fits' if short <= 0 else gib(short) + ' short still'}{why})")
        kv = self.item_bytes("vllm", "KV cache")
        if kv >= need - free:
            fixes.append(f"a shorter engine.max_model_len (vLLM keeps {gib(kv)} of KV cache for "
                         f"{self.settings.sequences} x {self.settings.tokens_per_sequence} tokens)")
        fixes.append("model.trainable=REGEX (perturb and update a subset of the tensors)")
        fixes.append(f"a GPU with at least {gib(self.part('vllm') + need)}")
        return (f"{self.model.name}: the ES replica needs {gib(need)} on this GPU ({items}) but {where}; it would run "
                f"out of memory at its first update, after a whole iteration of generation. Change one of: "
                + "; ".join(fixes))

    def _grpo_refusal(self, card_bytes: int) -> str | None:
        if self.fits(card_bytes):
            return None
        s, out = self.settings, []
        where = "colocated" if s.colocate else "learner"
        if self.gpus[where] > card_bytes:
            items = ", ".join(f"{line.item} {gib(line.nbytes)}" for line in self.lines if line.part == "learner")
            if s.colocate and s.card_bytes:
                items += (f"; awake beside it, vLLM's engine.gpu_memory_utilization={engine_share(self):.2f} of the "
                          f"card: {gib(self.vllm_mapped)}")
            # the first (smallest) change of each kind that fits on its own
            offloads = OFFLOADS.names()
            groups = [[(f"grpo.fsdp_size>={f}", {"fsdp_size": f}) for f in FSDP_DEGREES if f > s.fsdp_size],
                      [(f"grpo.offload={o}", {"offload": o}) for o in offloads[offloads.index(s.offload) + 1:]]]
            if not s.gradient_checkpointing:
                groups[:0] = [[("grpo.gradient_checkpointing=true", {"gradient_checkpointing": True})],
                              [(f"grpo.gradient_checkpointing=true grpo.fsdp_size>={f}",
                                {"gradient_checkpointing": True, "fsdp_size": f})
                               for f in FSDP_DEGREES if f > s.fsdp_size]]
            if s.colocate:
                groups.append([("grpo.colocate=false", {"colocate": False})])
                if s.gpu_memory_utilization and s.card_bytes:  # the share set by hand, larger than fits
                    room = card_bytes - max(self.learner_resident, self.item_bytes("build", "learner build (device)"))
                    most = math.floor(100 * room / s.card_bytes) / 100
                    least = self.gpu_memory_utilization(s.card_bytes)
                    if least <= most:
                        groups.insert(0, [(f"engine.gpu_memory_utilization={most:.2f} or lower (vLLM needs at least "
                                           f"{least:.2f}; 0 takes the plan's {least:.2f})",
                                           {"gpu_memory_utilization": most})])
            fixes = [next((key for key, change in group if self.with_settings(**change).fits(card_bytes)), None)
                     for group in groups]
            fixes = list(dict.fromkeys(f for f in fixes if f))
            what = f"a GRPO learner rank (grpo.fsdp_size={s.fsdp_size})" + (" beside its colocated rollout engine"
                                                                             if s.colocate else "")
            on = " (grpo.gradient_checkpointing is on)" if s.gradient_checkpointing else ""
            out.append(f"{what} needs {gib(self.gpus[where])} ({items}) on a {gib(card_bytes)} GPU{on}: set "
                       + (" or ".join(fixes) + "; or " if fixes else "")
                       + "a smaller grpo.micro_batch_size or grpo.logit_chunk_tokens, model.trainable=REGEX "
                       "(gradients and AdamW for those tensors only), or a larger GPU (grpo.gradient_checkpointing and "
                       "grpo.fsdp_size shrink the learner; engine.tensor_parallel_size does not)")
        if not s.colocate and self.part("vllm") > card_bytes:
            tp = self.tp_needed(card_bytes)
            out.append(f"a rollout engine needs {gib(self.part('vllm'))}: set engine.tensor_parallel_size={tp}"
                       if tp else f"a rollout engine needs {gib(self.part('vllm'))}: use a larger card")
        return f"{self.model.name}: " + "; ".join(out)

    def item_bytes(self, part: str, prefix: str) -> int:
        """Bytes of the lines of ``part`` whose item starts with ``prefix``."""
        return sum(line.nbytes for line in self.lines if line.part == part and line.item.startswith(prefix))

    def markdown(self) -> str:
        rows = [f"| {line.part} | {line.item} | {gib(line.nbytes)} | {line.note} |" for line in self.lines]
        per_gpu = ", ".join(f"{k} {gib(v)}" for k, v in self.gpus.items())
        return "\n".join([f"{self.model.name}, {self.method} ({per_gpu}):", "", "| part | item | size | how |",
                          "|---|---|---:|---|", *rows])


def replica_parts(m: ModelShape, s: Settings) -> dict[str, TensorPart]:
    """The parts of the tensors the ES replica of one GPU rank holds: those it trains (model.trainable, and what
    es.perturbation perturbs: ``replica_spec.selects``), each the rank's shard under tensor parallelism."""
    tp = s.tensor_parallel_size if s.master_sharded else 1
    parts = {k: TensorPart(v, *m.tp_part(k, v, tp)) for k, v in m.tensors().items()
             if selects(s.trainable, s.perturbation, k, v)}
    if not parts:
        raise ValueError(f"model.trainable={s.trainable!r} selects no tensor of {m.name}")
    return parts


def plan_es(m: ModelShape, s: Settings = Settings()) -> MemoryPlan:
    """vLLM and the ES replica on one GPU (one rank under tensor parallelism): the engine's lines and the replica's
    (``replica_lines`` of the parts it would hold)."""
    es = replica_lines(replica_parts(m, s), optimizer=s.optimizer, anchor_decay=s.anchor_decay, noise=s.noise,
                       noise_table_size=s.noise_table_size, perturbation=s.perturbation, rank=s.rank,
                       members=s.members)
    return MemoryPlan(m, "es", s, tuple(engine_lines(m, s) + es))


def plan_grpo(m: ModelShape, s: Settings = Settings()) -> MemoryPlan:
    """One GRPO learner rank's GPU (FSDP2 over grpo.fsdp_size ranks; the whole learner at 1), and one rollout
    engine's (vLLM alone on its GPUs, or on the learner rank's GPU with grpo.colocate): the learner's lines, its
    build's, and the engine's."""
    return MemoryPlan(m, "grpo", s, tuple(learner_lines(m, s) + build_lines(m, s) + engine_lines(m, s)))


def plan_eval(m: ModelShape, s: Settings = Settings()) -> MemoryPlan:
    """An evaluation (or any generation-only) engine: vLLM alone on its GPUs."""
    return MemoryPlan(m, "eval", s, tuple(engine_lines(m, s)))


PLANNERS = {"es": plan_es, "grpo": plan_grpo, "eval": plan_eval}


def engine_share(plan: MemoryPlan) -> float:
    """engine.gpu_memory_utilization of a colocated GRPO rollout engine (grpo.colocate=true on a GPU): the key when set,
    else the plan's vLLM part over the card (``Settings.card_bytes``), rounded up to 0.01. vLLM fills whatever share
    it is given with KV cache and maps all of it at every wake-up, so this one number is both what grpo/colocated.py
    passes to vLLM and what ``MemoryPlan.gpus`` adds beside the learner (0.0: the card is not known)."""
    s = plan.settings
    if s.gpu_memory_utilization:
        return s.gpu_memory_utilization
    return plan.gpu_memory_utilization(s.card_bytes) if s.card_bytes else 0.0
ES_CANDIDATES = ({"optimizer": "adam", "anchor_decay": 1.0}, {"optimizer": "adam"}, {"optimizer": "sgd"})
"""From the largest ES part to the smallest: the settings vLLM's automatic share leaves room for."""


def auto_gpu_memory_utilization(m: ModelShape, card_bytes: int, s: Settings = Settings()) -> float:
    """vLLM's share when engine.gpu_memory_utilization=0 on GPU. The engine is built before it learns the ES
    settings (and GRPO's rollout engines have none), so it leaves room for the largest ES part that fits this card
    beside vLLM's minimum (weights, ``s``'s KV cache, allowance): Adam with anchor decay, else Adam, else SGD.
    vLLM gets the rest, at most MAX_SHARE; when not even SGD fits, its minimum (and the ES setup check refuses)."""
    floor = plan_es(m, s).gpu_memory_utilization(card_bytes)
    for es in ES_CANDIDATES:
        plan = plan_es(m, replace(s, **es))
        if plan.fits(card_bytes):
            return min(MAX_SHARE, max(floor, math.floor(100 * (card_bytes - plan.part("es")) / card_bytes) / 100))
    return min(MAX_SHARE, floor)


# -- the start-up check ----------------------------------------------------------------------------------------
# Every trainer (es-train, grpo-train, each es-compare stage) plans its memory from the model's config.json and its
# actual settings before any model is loaded, against the device it will run on, and refuses what cannot fit.

HOST_SHARE = 0.9
"""Share of the host's RAM a CPU run may plan to use (the OS, Ray's object store and the driver keep the rest)."""


def usable_bytes(reported: int) -> int:
    """What a plan may use on a GPU that reports ``reported`` bytes: minus PLAN_MARGIN of it and the process's CUDA
    context (the plans' own lines already hold the allocator's slack)."""
    return int(reported * (1 - PLAN_MARGIN)) - CUDA_CONTEXT_BYTES


def card_bytes(gb: float) -> int:
    """An "N GB" card as it reports itself (CARD_GIB), in bytes."""
    return int(CARD_GIB.get(gb, gb) * GiB)


def model_shape(path: str) -> ModelShape | None:
    """The shape of model.path without loading or downloading anything: a local directory's config.json, a paper
    preset's hub id, the converted embedded model, or a hub id already in the local cache; None when unknown."""
    from es_ray.models import EMBEDDED_NAMES, cache_root

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
        from huggingface_hub import try_to_load_from_cache

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
    return dict(engine_dtype_bytes=_dtype_bytes(e.dtype), tensor_parallel_size=e.tensor_parallel_size,
                sequences=max(1, sequences), tokens_per_sequence=tokens, kv_floor_tokens=floor,
                trainable=cfg.model.trainable, **vllm_batch_defaults(card, device_name))


def settings_for(kind: str, cfg, shape: ModelShape, card: int = 80 * GiB, device_name: str = "") -> Settings:
    """The plan's Settings from a trainer's config: kind es (ESTrainConfig), grpo (GRPOTrainConfig) or eval (any
    config with engine, eval.max_new_tokens and model sections); ``card``: the bytes the GPU reports, ``device_name``
    its name (vLLM's batch defaults read both)."""
    if kind == "grpo":
        g = cfg.grpo
        per_engine = -(-g.prompts_per_step * g.group_size // max(1, cfg.cluster.num_actors))
        return Settings(**_engine(cfg, shape, per_engine, cfg.sampling.max_new_tokens, card, device_name),
                        card_bytes=card, gpu_memory_utilization=cfg.engine.gpu_memory_utilization, learner=g.dtype,
                        micro_batch_size=g.micro_batch_size, completion_tokens=cfg.sampling.max_new_tokens,
                        logit_chunk_tokens=g.logit_chunk_tokens, gradient_checkpointing=g.gradient_checkpointing,
                        reference_model=g.beta > 0, fsdp_size=g.fsdp_size, offload=g.offload, colocate=g.colocate)
    if kind == "es":
        es = cfg.es
        members = PERTURBATIONS.get(es.perturbation).members_at_once(es.population, cfg.cluster.num_actors)
        sequences = es.prompts_per_iteration * max(1, members)
        return Settings(**_engine(cfg, shape, sequences, cfg.sampling.max_new_tokens, card, device_name),
                        optimizer=es.optimizer,
                        anchor_decay=es.anchor_decay, noise=es.noise, noise_table_size=es.noise_table_size,
                        perturbation=es.perturbation, rank=es.rank, members=members)
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
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        sizes = [int(x) for x in out.split() if x.strip().isdigit()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return min(sizes) * (1 << 20) if sizes else None  # MiB


def gpu_name() -> str:
    """This machine's first GPU's name (nvidia-smi), "" when none shows: vLLM's batch defaults read it."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return ""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return (out.splitlines() or [""])[0].strip()


def host_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_plan_bytes(kind: str, plan: MemoryPlan, cfg) -> tuple[int, str]:
    """A CPU run's processes all on this host: (bytes, how) summed over them, the GPU-only lines left out (the
    transformers engine has no vLLM allowance, KV pool or CUDA context)."""
    per = {p: sum(line.nbytes for line in plan.lines if line.part == p and not line.gpu_only)
           for p in ("vllm", "es", "learner", "host")}
    n = max(1, cfg.cluster.num_actors)
    if kind == "grpo":
        f = max(1, cfg.grpo.fsdp_size)
        total = f * (per["learner"] + per["host"]) + n * per["vllm"]
        return total, (f"{f} learner rank(s) x {gib(per['learner'] + per['host'])} + {n} rollout(s) x "
                       f"{gib(per['vllm'])}")
    if kind == "es":
        return n * (per["vllm"] + per["es"]), f"{n} ES actor(s) x {gib(per['vllm'] + per['es'])}"
    return n * per["vllm"], f"{n} engine(s) x {gib(per['vllm'])}"


def startup_check(kind: str, cfg, reported: int | None = None, host: int | None = None,
                  shape: ModelShape | None = None, gpu: bool | None = None,
                  device_name: str | None = None) -> MemoryPlan | None:
    """Refuse (ConfigError: the numbers and the keys that would make it fit) a run whose plan does not fit the
    device it will run on, before any model is loaded. GPU: each GPU's plan against ``reported`` bytes (default: this
    machine's smallest GPU; unknown: no check here), less usable_bytes's margin; CPU with a local Ray (cluster.address
    empty): every actor's bytes summed against HOST_SHARE of the host's RAM; CPU on a cluster: not checked here.
    Returns the plan checked (None: the model's shape is unknown, or no GPU is visible here)."""
    from es_ray.core.config import ConfigError

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
            raise ConfigError(f"{message} [memory plan: {gib(usable)} usable of the {gib(reported)} the GPU reports "
                              f"(less {PLAN_MARGIN:.0%} margin and {gib(CUDA_CONTEXT_BYTES)} CUDA context); every "
                              "line: python -m es_ray.memory_plan --detail]")
        return plan
    plan = plan_for(kind, cfg, shape)
    if cfg.cluster.address:  # the actors run on the cluster's nodes, not on this host: each is sized by its node
        return plan
    need, how = host_plan_bytes(kind, plan, cfg)
    have = int(HOST_SHARE * (host_bytes() if host is None else host))
    if need > have:
        fixes = {"grpo": "grpo.fsdp_size (the learner's state is split over the ranks, which a CPU host holds all of: "
                         "only more hosts help), grpo.gradient_checkpointing=true, a smaller grpo.micro_batch_size, "
                         "model.trainable=REGEX or a smaller model",
                 "es": "fewer cluster.num_actors, es.optimizer=sgd, model.trainable=REGEX or a smaller model",
                 "eval": "fewer cluster.num_actors or a smaller model"}[kind]
        raise ConfigError(f"{shape.name}: this CPU run needs {gib(need)} of host memory ({how}) but "
                          f"{gib(have)} ({HOST_SHARE:.0%} of the host's RAM) is available; change {fixes}")
    return plan


# -- the table --------------------------------------------------------------------------------------------------

SETUPS = (
    ("ES, sgd", "es", {"optimizer": "sgd"}),
    ("ES, adam", "es", {"optimizer": "adam"}),
    *((f"GRPO, {v.label}", "grpo", {"learner": name}) for name, v in LEARNER_VARIANTS.items()),
    *((f"GRPO, bf16_mixed, grpo.fsdp_size={f}", "grpo", {"learner": "bf16_mixed", "fsdp_size": f})
      for f in FSDP_DEGREES),
    ("GRPO, bf16_mixed, fsdp 8, grpo.colocate=true", "grpo", {"learner": "bf16_mixed", "fsdp_size": 8,
                                                               "colocate": True}),
)


def cell(plan: MemoryPlan, card_bytes: int) -> str:
    """GiB on the fullest GPU, and whether it fits a card that reports ``card_bytes`` (usable_bytes of it)."""
    total, usable = f"{plan.total / GiB:.1f}", usable_bytes(card_bytes)
    if plan.fits(usable):
        share = f", vLLM {plan.gpu_memory_utilization(card_bytes):.2f}" if plan.method == "es" else \
            f", vLLM {engine_share(plan):.2f}" if plan.settings.colocate else ""
        return f"{total} fits{share}"
    if plan.method == "grpo" and (plan.gpus.get("learner", 0) > usable or plan.settings.colocate):
        return f"{total} no"
    tp = plan.tp_needed(usable)
    return f"{total} no, TP {tp} fits" if tp else f"{total} no (no TP fits)"


def table(models: list[ModelShape], cards_gb=(24, 40, 80, 141), base: Settings = Settings()) -> str:
    """Markdown: per model and setup, per card (as it reports itself: CARD_GIB): GiB on the fullest GPU, whether it
    fits (with vLLM's share for ES) and, when it does not, the tensor-parallel degree that would fit."""
    head = ["| model | params | setup | " + " | ".join(f"{c} GB" for c in cards_gb) + " |",
            "|---|---:|---|" + "---|" * len(cards_gb)]
    rows = []
    for m in models:
        for label, method, changes in SETUPS:
            cells = []
            for c in cards_gb:
                card = card_bytes(c)
                plan = PLANNERS[method](m, replace(base, **changes, card_bytes=card,
                                                   **vllm_batch_defaults(card, CARD_NAMES.get(c, ""))))
                cells.append(cell(plan, card))
            rows.append(f"| {m.name} | {m.parameters() / 1e9:.2f}B | {label} | " + " | ".join(cells) + " |")
    return "\n".join(head + rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m es_ray.memory_plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", choices=list(PRESETS), help="a preset (default: all four)")
    ap.add_argument("--config", action="append", default=[], help="an HF config.json (or a model directory)")
    ap.add_argument("--cards", type=int, nargs="+", default=list(CARD_GIB),
                    help="card sizes in GB, planned as what such a card reports (CARD_GIB; others as that many GiB)")
    ap.add_argument("--sequences", type=int, default=Settings.sequences)
    ap.add_argument("--tokens", type=int, default=Settings.tokens_per_sequence, help="prompt + completion per sequence")
    ap.add_argument("--completion-tokens", type=int, default=Settings.completion_tokens)
    ap.add_argument("--micro-batch", type=int, default=Settings.micro_batch_size)
    ap.add_argument("--detail", action="store_true", help="also every line of each plan (first card's defaults)")
    args = ap.parse_args(argv)
    models = [preset(n) for n in (args.model or ([] if args.config else list(PRESETS)))]
    for path in args.config:
        p = Path(path)
        models.append(ModelShape.from_dir(p) if p.is_dir() else
                      ModelShape.from_hf_config(json.loads(p.read_text()), name=p.parent.name or p.stem))
    base = Settings(sequences=args.sequences, tokens_per_sequence=args.tokens,
                    completion_tokens=args.completion_tokens, micro_batch_size=args.micro_batch)
    print(table(models, tuple(args.cards), base))
    cards = ", ".join(f"{c} GB = {card_bytes(c) / GiB:.1f} GiB" for c in args.cards)
    print("\nGiB on the fullest GPU (ES: vLLM + replica on one GPU; GRPO: a learner rank's GPU, a rollout GPU, or "
          "with grpo.colocate both on one); vLLM x.xx is engine.gpu_memory_utilization. Cards as they report "
          f"themselves ({cards}), of which a plan may use all but {PLAN_MARGIN:.0%} and "
          f"{CUDA_CONTEXT_BYTES / GiB:.1f} GiB of CUDA context. KV cache for {args.sequences} sequences x "
          f"{args.tokens} tokens, bf16 engine; GRPO micro-batch {args.micro_batch} x {args.tokens} tokens "
          f"({args.completion_tokens} completion; each FSDP rank its share), gradient checkpointing on.")
    if args.detail:
        for m in models:
            for label, method, changes in SETUPS:
                card = card_bytes(args.cards[0])
                plan = PLANNERS[method](m, replace(base, **changes, card_bytes=card,
                                                   **vllm_batch_defaults(card, CARD_NAMES.get(args.cards[0], ""))))
                print(f"\n{label}: " + plan.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
