"""What a part of a run states about the memory it allocates: ``Line``s (part, item, bytes, how), each part's own
(the ES replica: es_ray/replica_memory.py; the GRPO learner: grpo/learner_memory.py; the engines:
es_ray/engine_memory.py), which es_ray/memory_plan/ sums per GPU, and the run's ``Settings`` every part reads.
Pure: no torch, nothing of the project."""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
ALLOCATOR_SLACK_BYTES = GiB // 2
"""Beside a part's tensors on a GPU: the caching allocator rounds blocks up and fragments when tensor sizes vary."""
CUDA_CONTEXT_BYTES = GiB // 2
"""Per process on a GPU, outside torch's caching allocator (the CUDA context, cuBLAS and NCCL workspaces): what
torch.cuda.mem_get_info counts as used before anything is allocated. Assumed (0.3-0.6 GiB on recent GPUs)."""


@dataclass(frozen=True)
class Line:
    """One thing a part allocates."""

    part: str
    """vllm (an engine's GPU: an ES actor's or a GRPO rollout's), es (the replica beside it), learner (a GRPO learner
    rank's GPU), host (the learner's state grpo.offload moves to the host) or build (the learner's build, not summed
    into the steady state)."""
    item: str
    nbytes: int
    note: str = ""
    gpu_only: bool = False
    """Only on a GPU (a CUDA context, the allocator's slack, vLLM's allowance): a CPU run's host plan leaves it out."""


def gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB"


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
