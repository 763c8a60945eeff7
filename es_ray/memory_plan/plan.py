"""The memory plan itself: a run's ``Settings``, the ``MemoryPlan`` of its fullest GPU (the parts' lines summed, what
fits, what to change when it does not), the planners (``plan_es``, ``plan_grpo``, ``plan_eval``), vLLM's share of the
card, and the cards as they report themselves. es_ray/memory_plan/__init__.py says what each part states."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from es_ray.core.memory import CUDA_CONTEXT_BYTES, GiB, Line, Settings, gib
from es_ray.engine_memory import MAX_SHARE, SLEEPING_BYTES, engine_lines
from es_ray.grpo.learner_memory import OFFLOADS, RESIDENT, build_lines, learner_lines
from es_ray.model_shape import ModelShape
from es_ray.noise_kinds import NOISE_MEMORY
from es_ray.replica_memory import TensorPart, replica_lines
from es_ray.replica_spec import selects

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
            return {
                "colocated": max(
                    self.part("learner") + SLEEPING_BYTES,
                    self.learner_resident + awake,
                    self.item_bytes("build", "learner build (device)") + awake,
                )
            }
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
            if self.model.num_attention_heads % tp == 0 and self.with_settings(tensor_parallel_size=tp).fits(
                card_bytes
            ):
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
            return (
                f"{self.model.name}: the evaluation engine needs {gib(self.part('vllm'))} on a "
                f"{gib(card_bytes)} GPU: "
                + (
                    f"set engine.tensor_parallel_size={tp}"
                    if tp
                    else "set a shorter engine.max_model_len or use a larger card"
                )
            )
        need = self.part("es")
        free = card_bytes - self.part("vllm") if free_bytes is None else free_bytes
        if need <= free:
            return None
        items = ", ".join(f"{line.item} {gib(line.nbytes)}" for line in self.lines if line.part == "es")
        where = (
            f"{gib(free)} are free beside vLLM (engine.gpu_memory_utilization={share:.2f} of {gib(card_bytes)})"
            if share is not None
            else f"a {gib(card_bytes)} card leaves {gib(free)} beside vLLM's {gib(self.part('vllm'))}"
        )
        room, floor = (card_bytes - need) / card_bytes, self.gpu_memory_utilization(card_bytes)
        if room < floor:
            fixes = [f"(no engine.gpu_memory_utilization leaves room: vLLM needs at least {floor:.2f} of the card)"]
        else:
            fixes = [
                f"engine.gpu_memory_utilization={math.floor(room * 100) / 100:.2f} (the most that leaves room "
                f"for ES; vLLM needs at least {floor:.2f})"
            ]
        tp = self.tp_needed(card_bytes) or max(t for t in TP_DEGREES if self.model.num_attention_heads % t == 0)
        changes = [
            ("es.optimizer=sgd", {"optimizer": "sgd"}, ""),
            ("es.anchor_decay=0", {"anchor_decay": 0.0}, ""),
            (
                "es.noise=per_tensor",
                {"noise": "per_tensor" if NOISE_MEMORY.get(self.settings.noise).table else self.settings.noise},
                "",
            ),
            (
                f"engine.tensor_parallel_size={tp}",
                {"tensor_parallel_size": tp},
                "; it splits vLLM's part"
                + (" and the master" if self.settings.master_sharded else ", every rank keeps the whole master"),
            ),
        ]
        for key, change, why in changes:
            alt = self.with_settings(**change)
            # a change of the ES part meets the same free memory; tensor parallelism shrinks vLLM's part
            short = alt.part("es") - (free if key.startswith("es.") else card_bytes - alt.part("vllm"))
            if alt.settings != self.settings and short < need - free:  # only what brings it closer
                fixes.append(f"{key} ({'fits' if short <= 0 else gib(short) + ' short still'}{why})")
        kv = self.item_bytes("vllm", "KV cache")
        if kv >= need - free:
            fixes.append(
                f"a shorter engine.max_model_len (vLLM keeps {gib(kv)} of KV cache for "
                f"{self.settings.sequences} x {self.settings.tokens_per_sequence} tokens)"
            )
        fixes.append("model.trainable=REGEX (perturb and update a subset of the tensors)")
        fixes.append(f"a GPU with at least {gib(self.part('vllm') + need)}")
        return (
            f"{self.model.name}: the ES replica needs {gib(need)} on this GPU ({items}) but {where}; it would run "
            f"out of memory at its first update, after a whole iteration of generation. Change one of: "
            + "; ".join(fixes)
        )

    def _grpo_refusal(self, card_bytes: int) -> str | None:
        if self.fits(card_bytes):
            return None
        s, out = self.settings, []
        where = "colocated" if s.colocate else "learner"
        if self.gpus[where] > card_bytes:
            items = ", ".join(f"{line.item} {gib(line.nbytes)}" for line in self.lines if line.part == "learner")
            if s.colocate and s.card_bytes:
                items += (
                    f"; awake beside it, vLLM's engine.gpu_memory_utilization={engine_share(self):.2f} of the "
                    f"card: {gib(self.vllm_mapped)}"
                )
            # the first (smallest) change of each kind that fits on its own
            offloads = OFFLOADS.names()
            groups = [
                [(f"grpo.fsdp_size>={f}", {"fsdp_size": f}) for f in FSDP_DEGREES if f > s.fsdp_size],
                [(f"grpo.offload={o}", {"offload": o}) for o in offloads[offloads.index(s.offload) + 1 :]],
            ]
            if not s.gradient_checkpointing:
                groups[:0] = [
                    [("grpo.gradient_checkpointing=true", {"gradient_checkpointing": True})],
                    [
                        (
                            f"grpo.gradient_checkpointing=true grpo.fsdp_size>={f}",
                            {"gradient_checkpointing": True, "fsdp_size": f},
                        )
                        for f in FSDP_DEGREES
                        if f > s.fsdp_size
                    ],
                ]
            if s.colocate:
                groups.append([("grpo.colocate=false", {"colocate": False})])
                if s.gpu_memory_utilization and s.card_bytes:  # the share set by hand, larger than fits
                    room = card_bytes - max(self.learner_resident, self.item_bytes("build", "learner build (device)"))
                    most = math.floor(100 * room / s.card_bytes) / 100
                    least = self.gpu_memory_utilization(s.card_bytes)
                    if least <= most:
                        groups.insert(
                            0,
                            [
                                (
                                    f"engine.gpu_memory_utilization={most:.2f} or lower (vLLM needs at least "
                                    f"{least:.2f}; 0 takes the plan's {least:.2f})",
                                    {"gpu_memory_utilization": most},
                                )
                            ],
                        )
            fixes = [
                next((key for key, change in group if self.with_settings(**change).fits(card_bytes)), None)
                for group in groups
            ]
            fixes = list(dict.fromkeys(f for f in fixes if f))
            what = f"a GRPO learner rank (grpo.fsdp_size={s.fsdp_size})" + (
                " beside its colocated rollout engine" if s.colocate else ""
            )
            on = " (grpo.gradient_checkpointing is on)" if s.gradient_checkpointing else ""
            out.append(
                f"{what} needs {gib(self.gpus[where])} ({items}) on a {gib(card_bytes)} GPU{on}: set "
                + (" or ".join(fixes) + "; or " if fixes else "")
                + "a smaller grpo.micro_batch_size or grpo.logit_chunk_tokens, model.trainable=REGEX "
                "(gradients and AdamW for those tensors only), or a larger GPU (grpo.gradient_checkpointing and "
                "grpo.fsdp_size shrink the learner; engine.tensor_parallel_size does not)"
            )
        if not s.colocate and self.part("vllm") > card_bytes:
            tp = self.tp_needed(card_bytes)
            out.append(
                f"a rollout engine needs {gib(self.part('vllm'))}: set engine.tensor_parallel_size={tp}"
                if tp
                else f"a rollout engine needs {gib(self.part('vllm'))}: use a larger card"
            )
        return f"{self.model.name}: " + "; ".join(out)

    def item_bytes(self, part: str, prefix: str) -> int:
        """Bytes of the lines of ``part`` whose item starts with ``prefix``."""
        return sum(line.nbytes for line in self.lines if line.part == part and line.item.startswith(prefix))

    def markdown(self) -> str:
        rows = [f"| {line.part} | {line.item} | {gib(line.nbytes)} | {line.note} |" for line in self.lines]
        per_gpu = ", ".join(f"{k} {gib(v)}" for k, v in self.gpus.items())
        return "\n".join(
            [
                f"{self.model.name}, {self.method} ({per_gpu}):",
                "",
                "| part | item | size | how |",
                "|---|---|---:|---|",
                *rows,
            ]
        )


def replica_parts(m: ModelShape, s: Settings) -> dict[str, TensorPart]:
    """The parts of the tensors the ES replica of one GPU rank holds: those it trains (model.trainable, and what
    es.perturbation perturbs: ``replica_spec.selects``), each the rank's shard under tensor parallelism."""
    tp = s.tensor_parallel_size if s.master_sharded else 1
    parts = {
        k: TensorPart(v, *m.tp_part(k, v, tp))
        for k, v in m.tensors().items()
        if selects(s.trainable, s.perturbation, k, v)
    }
    if not parts:
        raise ValueError(f"model.trainable={s.trainable!r} selects no tensor of {m.name}")
    return parts


def plan_es(m: ModelShape, s: Settings = Settings()) -> MemoryPlan:
    """vLLM and the ES replica on one GPU (one rank under tensor parallelism): the engine's lines and the replica's
    (``replica_lines`` of the parts it would hold)."""
    es = replica_lines(
        replica_parts(m, s),
        optimizer=s.optimizer,
        anchor_decay=s.anchor_decay,
        noise=s.noise,
        noise_table_size=s.noise_table_size,
        perturbation=s.perturbation,
        rank=s.rank,
        members=s.members,
    )
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


def usable_bytes(reported: int) -> int:
    """What a plan may use on a GPU that reports ``reported`` bytes: minus PLAN_MARGIN of it and the process's CUDA
    context (the plans' own lines already hold the allocator's slack)."""
    return int(reported * (1 - PLAN_MARGIN)) - CUDA_CONTEXT_BYTES


def card_bytes(gb: float) -> int:
    """An "N GB" card as it reports itself (CARD_GIB), in bytes."""
    return int(CARD_GIB.get(gb, gb) * GiB)
