"""What a part of a run states about the memory it allocates: ``Line``s (part, item, bytes, how), each part's own
(the ES replica: es_ray/replica_memory.py; the GRPO learner: grpo/learner_memory.py; the engines:
es_ray/engines/memory.py), which es_ray/memory_plan/ sums per GPU. Pure: no torch, nothing of the project."""

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
