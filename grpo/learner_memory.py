"""What one GRPO learner rank (grpo/learner.py) allocates, stated from the model's shape and the learner's settings
(no torch): weights, gradients, an fp32 master and AdamW's moments in one of ``LEARNER_VARIANTS``, split over
grpo.fsdp_size ranks and moved to the host by grpo.offload (``OFFLOADS``, the config's registry), FSDP2's gathered
layers, the reference model, one chunk of logits (``LOGIT_COPIES``), a micro-batch's activations, and the build and
resume's transients. es_ray/memory_plan/ sums these lines with the engines'."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from es_ray.core.memory import ALLOCATOR_SLACK_BYTES, CUDA_CONTEXT_BYTES, Line, Settings
from es_ray.core.registry import Registry
from es_ray.model_shape import ModelShape

OFFLOADS = Registry(
    "grpo.offload",
    {
        "none": "everything on the device",
        "optimizer": "AdamW moments and the step on the host",
        "all": "FSDP2's CPUOffloadPolicy: sharded parameters, gradients and AdamW on the host",
    },
)
"""grpo.offload: none; optimizer (AdamW moments and the step on the host); all (FSDP2's CPUOffloadPolicy: sharded
parameters, gradients and AdamW on the host, each layer copied to the device for its forward and backward). In the
order a refusal suggests them."""
LOGIT_COPIES = 4
"""fp32 [chunk, V] tensors alive while one chunk of grpo.logit_chunk_tokens completion positions is scored or
back-propagated (es_ray.metrics.entropy.chunked_token_scores): the logits, logits / T, their log-softmax, and its
gradient."""
RESIDENT = ("weights", "fp32 master", "AdamW moments", "reference model", "allocator slack")
"""The learner's lines that stay on the device between steps (gradients and activations are freed after the step):
what a colocated rank holds while its vLLM is awake."""


@dataclass(frozen=True)
class LearnerVariant:
    weights: int
    grads: int
    master: int
    optimizer: int
    reference_bytes: int
    activation_bytes: int
    label: str
    note: str


LEARNER_VARIANTS = {
    "float32": LearnerVariant(
        4, 4, 0, 8, 4, 4, "grpo.dtype=float32", "fp32 weights, gradients, AdamW moments and compute"
    ),
    "bf16_mixed": LearnerVariant(
        4,
        4,
        0,
        8,
        2,
        2,
        "grpo.dtype=bf16_mixed",
        "fp32 master weights, gradients and AdamW; forward and backward under autocast(bf16), no weight-cast cache",
    ),
    "bf16_fp32_master": LearnerVariant(
        2,
        2,
        4,
        8,
        2,
        2,
        "bf16 weights + fp32 master (no grpo.dtype)",
        "bf16 weights and gradients; an fp32 master and fp32 AdamW moments take the "
        "step (the same 16 B/param; grpo.dtype=bf16_mixed was chosen instead)",
    ),
}
"""The GRPO learner's precisions: bytes per parameter of weights, gradients, an fp32 master and AdamW's two moments,
then the reference model's and the activations' dtype bytes. Pure bf16 weights are not a variant: grpo.dtype refuses
them (an AdamW step of ~1e-5 is below bf16's spacing near 1 and vanishes)."""


def learner_lines(m: ModelShape, s: Settings) -> list[Line]:
    """One learner rank's GPU (FSDP2 over ``s.fsdp_size`` ranks; the whole learner at 1), as part "learner" lines,
    and part "host" for what ``s.offload`` keeps on the host."""
    if s.learner not in LEARNER_VARIANTS:
        raise ValueError(f"learner={s.learner!r} is not one of {', '.join(LEARNER_VARIANTS)}")
    if s.offload not in OFFLOADS:
        raise ValueError(f"grpo.offload={s.offload!r} is not one of {', '.join(OFFLOADS)}")
    v, f = LEARNER_VARIANTS[s.learner], max(1, s.fsdp_size)
    total, n = m.parameters(), m.parameters(s.trainable)
    micro = -(-s.micro_batch_size // f)  # each rank's share of a micro-batch
    tokens = micro * s.tokens_per_sequence
    if s.gradient_checkpointing:  # each layer's input, plus one layer's activations while it is recomputed
        act = tokens * (
            m.num_hidden_layers * m.hidden_size * v.activation_bytes + m.saved_bytes_per_token(v.activation_bytes)
        )
        act_note = "checkpointed: every layer's input + one layer recomputed"
    else:
        act = tokens * m.num_hidden_layers * m.saved_bytes_per_token(v.activation_bytes)
        act_note = "every layer's saved activations"
    shard = f" / fsdp {f}" if f > 1 else ""
    host = {
        "weights": s.offload == "all",
        "gradients": s.offload == "all",
        "AdamW moments": s.offload in ("optimizer", "all"),
    }
    lines = [
        Line("learner", "weights", total * v.weights // f, f"{total:,} x {v.weights} B{shard} ({v.note})"),
        Line("learner", "gradients", n * v.grads // f, f"{n:,} trainable x {v.grads} B{shard}"),
    ]
    if v.master:
        lines.append(Line("learner", "fp32 master", n * v.master // f, f"the optimizer's fp32 copy{shard}"))
    lines.append(Line("learner", "AdamW moments", n * v.optimizer // f, f"m and v, {v.optimizer // 2} B each{shard}"))
    lines = [
        replace(line, part="host", note=line.note + " (grpo.offload: on the host)") if host.get(line.item) else line
        for line in lines
    ]
    if f > 1 or s.offload == "all":  # FSDP2 all-gathers a layer (and prefetches the next), the root stays whole
        layer = sum(math.prod(t) for name, t in m.tensors().items() if ".layers.0." in name)
        root = total - m.num_hidden_layers * layer
        cb = v.activation_bytes
        lines.append(
            Line(
                "learner",
                "gathered parameters",
                (3 * layer + 2 * root) * cb,
                f"unsharded in {cb} B: 2 layers (current + prefetched) + one layer's gradients, the root "
                "(embedding, norm, LM head) and its gradients",
                gpu_only=True,
            )
        )
    if s.reference_model:
        lines.append(
            Line(
                "learner",
                "reference model",
                total * v.reference_bytes,
                f"grpo.beta > 0: a frozen copy, {v.reference_bytes} B/param, whole on every rank",
            )
        )
    chunk = min(s.logit_chunk_tokens, micro * s.completion_tokens)
    logits = chunk * m.vocab_size * 4 * LOGIT_COPIES
    lines.append(
        Line(
            "learner",
            "logits chunk",
            logits,
            f"min(grpo.logit_chunk_tokens, {micro} seq x {s.completion_tokens} completion tok)"
            f" = {chunk} positions x vocab x 4 B x {LOGIT_COPIES}",
        )
    )
    lines.append(
        Line(
            "learner",
            "activations",
            act,
            f"{micro} seq{' (this rank)' if f > 1 else ''} x {s.tokens_per_sequence} tok, {act_note}",
        )
    )
    fsdp = f > 1 or s.offload == "all"  # FSDP2's mixed precision gathers bf16 copies ("gathered parameters")
    if v.weights > v.activation_bytes and not fsdp:  # autocast casts each matmul's weight; the widest: the vocabulary's
        lines.append(
            Line(
                "learner",
                "weight casts",
                m.vocab_size * m.hidden_size * v.activation_bytes * 2,
                f"vocab x hidden x {v.activation_bytes} B x 2: the LM head's autocast copy and its "
                "gradient, alive together in its backward",
            )
        )
    # measured on an H200 (scripts/gpu_smoke.py, bf16_mixed, micro-batch 4 x 256 tokens, a 1.74 GiB logits chunk):
    # the allocator's reserved peak stood 1.38 GiB (Qwen2.5-0.5B-shaped) and 1.65 GiB (1.5B) above its allocated peak
    lines.append(
        Line(
            "learner",
            "allocator slack",
            ALLOCATOR_SLACK_BYTES + logits,
            "caching-allocator rounding and fragmentation: 0.5 GiB + the logits chunk's blocks once more",
            gpu_only=True,
        )
    )
    lines.append(Line("learner", "CUDA context", CUDA_CONTEXT_BYTES, "outside torch's allocator", gpu_only=True))
    return lines


def build_lines(m: ModelShape, s: Settings) -> list[Line]:
    """The learner's build (grpo.learner), before any gradient or optimizer state exists, and its resume. Sharded
    (grpo.fsdp_size > 1 or grpo.offload=all): built on the meta device, then each rank reads its rows of one tensor
    at a time, so the device holds its fp32 shard (none with grpo.offload=all) and the host one tensor's rows in the
    file's dtype (up to 4 B) and in fp32. One process: from_pretrained on the host (the whole fp32 model), then moved
    whole onto the device. A resume (``GRPOLearner.load``) reads a checkpoint the same way into the built model, a
    rank's rows (or, in one process, a whole tensor) at a time, and AdamW's moments a tensor's rows at a time
    (grpo.shards.load_moments). Part "build": not summed into the steady state; ``MemoryPlan.gpus`` adds the device
    line to an awake colocated vLLM (the learner ranks build while it is awake)."""
    f = max(1, s.fsdp_size)
    total = m.parameters()
    largest = max(math.prod(t) for t in m.tensors().values())
    if f > 1 or s.offload == "all":
        rows = -(-largest // f)
        device = 0 if s.offload == "all" else total * 4 // f
        return [
            Line(
                "build",
                "learner build (device)",
                device,
                f"this rank's fp32 shard: {total:,} x 4 B / fsdp {f}"
                if device
                else "none: grpo.offload=all keeps the shards on the host",
            ),
            Line(
                "build",
                "learner build (host)",
                rows * 8 + (total * 4 // f if not device else 0),
                f"one tensor's rows read at a time: the largest, {largest:,} / fsdp {f} x (4 B read + 4 B fp32)"
                + (" + the rank's fp32 shard" if not device else ""),
            ),
            Line(
                "build",
                "learner resume (host)",
                rows * 8,
                f"beside the built learner: one tensor's rows of the checkpoint at a time, {largest:,} / fsdp "
                f"{f} x (4 B read + 4 B fp32)",
            ),
        ]
    return [
        Line("build", "learner build (device)", total * 4, f"the whole fp32 model: {total:,} x 4 B"),
        Line("build", "learner build (host)", total * 4, "from_pretrained's whole fp32 model, before the move"),
        Line(
            "build",
            "learner resume (host)",
            largest * 8,
            f"beside the built learner: one whole tensor of the checkpoint at a time, {largest:,} x (4 B read + "
            "4 B fp32)",
        ),
    ]
