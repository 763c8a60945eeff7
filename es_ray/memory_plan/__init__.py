"""GPU memory plan of one ES actor, or of one GRPO learner and its rollout GPUs, from the model's HF config alone.

Pure arithmetic (no torch): ``python -m es_ray.memory_plan`` prints the paper's four models on 24, 40 and 80 GB
cards (docs/memory-plan.md's table); the vLLM engine sizes vLLM's share of the GPU from it when
engine.gpu_memory_utilization=0, and its ES replica host checks it against the free memory before the first
generation, so a run that cannot fit stops at start-up, not after a whole iteration.

The plan itemises nothing itself: each part states what it allocates, as ``Line``s (es_ray/core/memory.py), and
the plan sums them per GPU. One ES actor is one process holding vLLM and the replica (es_ray/replica.py) on the same
GPU: the engine's lines (es_ray/engine_memory.py: weights, KV cache, allowance, LoRA slots;
engine.gpu_memory_utilization = their sum / card) and the replica's (es_ray/replica_memory.py: master, optimizer
state, theta_0, its buffers, the noise source's memory, slack). A GRPO learner rank (a GPU of its own) holds the
learner's lines (grpo/learner_memory.py: weights, gradients and AdamW in one of ``LEARNER_VARIANTS``, one chunk of
logits, a micro-batch's activations) and its build's; its rollout engines are vLLM on other GPUs, or on its own with
grpo.colocate. Sizes are in bytes; GiB = 2**30, and an "N GB card" is what such a card reports (``CARD_GIB``; the
plan is a bound to check against, not a measurement: the check in the engine reads ``torch.cuda.mem_get_info``).

The package by role: ``plan`` (MemoryPlan, the planners, vLLM's share of the card; the run's ``Settings`` are
es_ray/core/memory.py's), ``startup`` (the start-up check every trainer runs before it loads a model), ``table`` (the
command line's table). Callers import from here.
"""

# fmt: off
from es_ray.core.memory import ALLOCATOR_SLACK_BYTES, CUDA_CONTEXT_BYTES, GiB, Line, gib  # noqa: F401
from es_ray.engine_memory import MAX_SHARE, vllm_batch_defaults  # noqa: F401
from es_ray.grpo.learner_memory import LEARNER_VARIANTS, LOGIT_COPIES, OFFLOADS, LearnerVariant  # noqa: F401
from es_ray.memory_plan.plan import (CARD_GIB, CARD_NAMES, ES_CANDIDATES, FSDP_DEGREES, PLAN_MARGIN,  # noqa: F401
                                     PLANNERS, PROMPT_TOKENS, TP_DEGREES, MemoryPlan, Settings,
                                     auto_gpu_memory_utilization, card_bytes, engine_share, plan_es, plan_eval,
                                     plan_grpo, replica_parts, usable_bytes)
from es_ray.memory_plan.startup import (HOST_SHARE, colocated_engine_share, gpu_name, gpu_reported_bytes,  # noqa: F401
                                        host_bytes, host_plan_bytes, model_shape, on_gpu, plan_for, settings_for,
                                        startup_check)
from es_ray.memory_plan.table import SETUPS, cell, main, table  # noqa: F401
from es_ray.model_shape import LLAMA_3_1_8B, PRESETS, ModelShape, preset  # noqa: F401
# fmt: on

ES_SLACK_BYTES = ALLOCATOR_SLACK_BYTES
"""The allocator's slack beside a part's tensors (es_ray/core/memory.py); scripts/gpu_smoke.py's tolerance."""
