"""What a generation engine holds on its GPU, stated from the model's shape and the engine's settings (no torch,
no vLLM): vLLM's weights, its KV cache, an allowance for what it holds besides (its CUDA context and graphs, its
profile run and sampler), the LoRA slots of a low-rank population, what it keeps asleep (sleep mode level 2), and
the batch sizes vLLM picks by itself on a card. es_ray/memory_plan/ sums these lines with the replica's and the
learner's; the vLLM engine (es_ray/engines/vllm.py) sizes its share of the GPU from that plan."""

from __future__ import annotations

from es_ray.core.memory import GiB, Line, Settings
from es_ray.model_shape import ModelShape
from es_ray.perturbation import PERTURBATIONS
from es_ray.replica_memory import factor_elements

VLLM_FIXED_BYTES = 2 * GiB
"""vLLM memory no formula here gives: the CUDA context with cuBLAS/NCCL workspaces (0.5-1 GiB outside torch's
allocator, which vLLM's profiler counts as non-torch memory) and its CUDA graphs (vLLM logs what capturing took:
well under 1 GiB for dense 1.5B-8B models). Assumed, not measured here (no GPU). A sleeping engine (level 2: weights
and KV cache released) keeps this much (``SLEEPING_BYTES``)."""
SLEEPING_BYTES = VLLM_FIXED_BYTES
"""What a vLLM engine asleep at level 2 (grpo/colocated.py) still holds on its GPU: its context and graphs."""
SAMPLER_BYTES_PER_LOGIT = 8
"""vLLM's profile run samples max_num_seqs rows of the vocabulary: fp32 logits and fp32 probabilities."""
MAX_SHARE = 0.9
"""The largest share of the GPU vLLM takes by itself (vLLM's own default utilization)."""


def vllm_batch_defaults(card_bytes: int, device_name: str = "") -> dict[str, int]:
    """The (max_num_batched_tokens, max_num_seqs) vLLM 0.32's offline LLM picks when unset (this engine does not set
    them), by the card: its ``EngineArgs.get_batch_defaults`` (vllm/engine/arg_utils.py, LLM_CLASS): 16384 / 1024 on
    160 GiB or more, and on 70 GiB or more unless the device's name holds "a100" (H100 / H200 class); else 8192 / 256
    (an A100-80GB, 79.2 GiB, and every smaller card). ``device_name``: torch.cuda.get_device_name's (nvidia-smi's)."""
    big = card_bytes >= 160 * GiB or (card_bytes >= 70 * GiB and "a100" not in device_name.lower())
    return {"max_num_batched_tokens": 16384 if big else 8192, "max_num_seqs": 1024 if big else 256}


def lora_slot_elements(m: ModelShape, rank: int, perturbation: str = "lowrank") -> int:
    """Elements of one LoRA slot: the low-rank factors of every tensor the perturbation perturbs in the whole model
    (vLLM's LoRA covers its target modules whatever model.trainable selects)."""
    kind = PERTURBATIONS.get(perturbation)
    return factor_elements((s for n, s in m.tensors().items() if kind.selects(n, s)), rank)


def engine_lines(m: ModelShape, s: Settings) -> list[Line]:
    """One vLLM engine rank (one GPU under tensor parallelism), as part "vllm" lines: weights in the engine's dtype,
    KV cache for ``s.sequences`` x ``s.tokens_per_sequence`` (at least vLLM's floor of one max_model_len sequence), the
    allowance, and with a batched perturbation a LoRA slot per member generated at once."""
    tp, dt = s.tensor_parallel_size, s.engine_dtype_bytes
    kv_heads = max(1, m.num_key_value_heads // tp)  # vLLM replicates KV heads when TP exceeds their number
    kv_per_token = 2 * m.num_hidden_layers * kv_heads * m.head_dim * dt
    tokens = max(s.sequences * s.tokens_per_sequence, s.kv_floor_tokens)
    floor = (
        f"; at least one max_model_len sequence: {s.kv_floor_tokens} tok"
        if s.kv_floor_tokens > s.sequences * s.tokens_per_sequence
        else ""
    )
    act = s.max_num_batched_tokens * m.forward_bytes_per_token(dt) // tp
    sampler = s.max_num_seqs * m.vocab_size * SAMPLER_BYTES_PER_LOGIT
    lines = [
        Line("vllm", "engine weights", m.parameters() * dt // tp, f"all parameters x {dt} B / TP {tp}"),
        Line(
            "vllm",
            "KV cache",
            tokens * kv_per_token,
            f"{s.sequences} seq x {s.tokens_per_sequence} tok x {kv_per_token} B/token (2 x layers x kv heads x "
            f"head dim x dtype, per rank){floor}",
        ),
        Line(
            "vllm",
            "vLLM allowance",
            VLLM_FIXED_BYTES + act + sampler,
            f"{VLLM_FIXED_BYTES // GiB} GiB context/workspaces/CUDA graphs + profile run of "
            f"{s.max_num_batched_tokens} tokens + sampler over {s.max_num_seqs} x vocab fp32",
            gpu_only=True,
        ),
    ]
    if PERTURBATIONS.get(s.perturbation).batched:
        per = lora_slot_elements(m, s.rank, s.perturbation)
        lines.append(
            Line(
                "vllm",
                "LoRA slots",
                s.members * per * dt // tp,
                f"{s.members} slots x {per:,} factor elements (rank {s.rank}) x {dt} B / TP {tp}",
                gpu_only=True,
            )
        )
    return lines
