"""GPU memory plan of one ES actor, or of one GRPO learner and its rollout GPUs, from the model's HF config alone.

Pure arithmetic (no torch): ``python -m es_ray.memory_plan`` prints the paper's four models on 24, 40 and 80 GB
cards (docs/memory-plan.md's table); the vLLM engine sizes vLLM's share of the GPU from it when
engine.gpu_memory_utilization=0, and its ES replica host checks it against the free memory before the first
generation, so a run that cannot fit stops at start-up, not after a whole iteration.

One ES actor is one process holding vLLM and the replica (es_ray/replica.py) on the same GPU:

    vLLM   weights (engine dtype) / TP + KV cache / TP + allowance (CUDA context, workspaces, CUDA graphs, its
           profile run's activations and sampler)                      engine.gpu_memory_utilization = vLLM / card
    ES     fp32 master 4 B/param + Adam moments 8 B/param + theta_0 4 B/param (es.anchor_decay), each of the rank's
           shards under tensor parallelism + _buf (fp32, the largest whole HF tensor) + _nbuf (fp32, the largest
           noise drawn; none with es.noise=table, whose table adds noise_table_size * 4) + es.noise=counter's chunk
           temporaries + one largest-part temporary (Adam's denominator, the anchor's theta - theta_0) + the
           realised-update chunks + allocator slack

A GRPO learner (a GPU of its own) holds weights + gradients + AdamW in one of ``LEARNER_VARIANTS``, one chunk of
logits (grpo.logit_chunk_tokens positions) and a micro-batch's activations; its rollout engines are vLLM on other
GPUs. Sizes are in bytes; GiB = 2**30, and an "N GB card" is N GiB (the plan is a bound to check against, not a
measurement: the check in the engine reads ``torch.cuda.mem_get_info``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

GiB = 1 << 30

REPLICA_CHUNK = 1 << 20
"""es_ray.replica.CHUNK (a test keeps them equal): elements per chunk of the realised-update measurement."""
CHUNK_TEMPORARIES = 4
"""fp32-sized temporaries per chunk element there: the cast to the engine dtype and back, the difference r, and the
mismatch masks (16 MiB at 2**20 elements)."""
ES_SLACK_BYTES = GiB // 2
"""Beside the ES tensors: the caching allocator rounds blocks up and fragments when tensor sizes vary."""
VLLM_FIXED_BYTES = 2 * GiB
"""vLLM memory no formula here gives: the CUDA context with cuBLAS/NCCL workspaces (0.5-1 GiB outside torch's
allocator, which vLLM's profiler counts as non-torch memory) and its CUDA graphs (vLLM logs what capturing took:
well under 1 GiB for dense 1.5B-8B models). Assumed, not measured here (no GPU)."""
SAMPLER_BYTES_PER_LOGIT = 8
"""vLLM's profile run samples max_num_seqs rows of the vocabulary: fp32 logits and fp32 probabilities."""
LOGIT_COPIES = 4
"""GRPO learner: fp32 [chunk, V] tensors alive while one chunk of grpo.logit_chunk_tokens completion positions is
scored or back-propagated (the logits, logits / T, their log-softmax and its gradient; grpo.learner.LOGIT_COPIES)."""
COUNTER_NOISE_BYTES = GiB // 4
"""es.noise=counter: es_ray.noise draws 2^22 elements per step on CUDA with about 32 B of int64/fp32
Philox temporaries per element (128 MiB), plus its small Box-Muller tables: a quarter GiB covers it."""
MAX_SHARE = 0.9
"""The largest vLLM share the engine picks by itself (vLLM's own default utilization)."""
TP_DEGREES = (1, 2, 4, 8)
FSDP_DEGREES = (2, 4, 8)
"""grpo.fsdp_size values a refusal suggests (one 8-GPU node)."""
CUDA_CONTEXT_BYTES = GiB // 2
"""Per process on a GPU, outside torch's caching allocator (the CUDA context, cuBLAS and NCCL workspaces): what
torch.cuda.mem_get_info counts as used before anything is allocated. Assumed (0.3-0.6 GiB on recent GPUs)."""
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
OFFLOADS = ("none", "optimizer", "all")
"""grpo.offload: none; optimizer (AdamW moments and the step on the host); all (FSDP2's CPUOffloadPolicy: sharded
parameters, gradients and AdamW on the host, each layer copied to the device for its forward and backward)."""


# -- the model ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama- or Qwen2-shaped decoder (Mistral, SmolLM2 and the R1 distills share them)."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    head_dim: int
    qkv_bias: bool
    """q/k/v projections carry biases: always in Qwen2, attention_bias in Llama (which biases o_proj too)."""
    o_bias: bool
    mlp_bias: bool
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "") -> ModelShape:
        kind = cfg.get("model_type", "llama")
        if kind not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"{name or 'config'}: model_type {kind!r} is not Llama- or Qwen2-shaped; the memory "
                             "plan counts llama, qwen2 and mistral tensors only")
        heads = int(cfg["num_attention_heads"])
        bias = bool(cfg.get("attention_bias", False))
        return cls(
            name=name or cfg.get("_name_or_path", "") or kind, hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]), num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            qkv_bias=kind == "qwen2" or bias, o_bias=kind != "qwen2" and bias,
            mlp_bias=kind != "qwen2" and bool(cfg.get("mlp_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelShape:
        path = Path(model_dir) / "config.json"
        return cls.from_hf_config(json.loads(path.read_text()), name=Path(model_dir).name)

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """HF parameter name -> shape, as ``named_parameters()`` lists them (a tied LM head once, as the embedding)."""
        h, inter = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        projections = (("self_attn.q_proj", q, h, self.qkv_bias), ("self_attn.k_proj", kv, h, self.qkv_bias),
                       ("self_attn.v_proj", kv, h, self.qkv_bias), ("self_attn.o_proj", h, q, self.o_bias),
                       ("mlp.gate_proj", inter, h, self.mlp_bias), ("mlp.up_proj", inter, h, self.mlp_bias),
                       ("mlp.down_proj", h, inter, self.mlp_bias))
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            for proj, rows, cols, bias in projections:
                out[f"{p}{proj}.weight"] = (rows, cols)
                if bias:
                    out[f"{p}{proj}.bias"] = (rows,)
            out[f"{p}input_layernorm.weight"] = (h,)
            out[f"{p}post_attention_layernorm.weight"] = (h,)
        out["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (self.vocab_size, h)
        return out

    def parameters(self, trainable: str = "") -> int:
        """Parameters in the tensors the regex ``trainable`` selects (model.trainable; empty: all)."""
        return sum(math.prod(s) for n, s in self.tensors().items() if not trainable or re.search(trainable, n))

    def tp_part(self, name: str, shape: tuple[int, ...], tp: int) -> tuple[int, int | None]:
        """(elements of tensor ``name`` one tensor-parallel rank keeps, the dim they are cut along or None), as
        vllm_extension.tensor_parallel_parts finds vLLM's loaders: vocabulary rows of the embedding and LM head,
        output rows of q/k/v/gate/up (k and v at least one KV head: vLLM replicates KV heads when TP exceeds their
        number), input columns of o_proj and down_proj (their biases whole), norms whole."""
        n = math.prod(shape)
        proj, leaf = name.rsplit(".", 2)[-2], name.rsplit(".", 1)[-1]
        if tp == 1:
            return n, None
        if proj in ("o_proj", "down_proj"):
            return (n // shape[1] * -(-shape[1] // tp), 1) if leaf == "weight" else (n, None)
        if proj in ("k_proj", "v_proj"):
            return n // shape[0] * max(1, self.num_key_value_heads // tp) * self.head_dim, 0
        if proj in ("q_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"):
            return n // shape[0] * -(-shape[0] // tp), 0
        return n, None

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer: 2 x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    def forward_bytes_per_token(self, dtype_bytes: int) -> int:
        """One decoder layer's largest live set in a forward pass: residual, normed input, attention output and
        o_proj output (4 h), q, k and v, the MLP's gate/up output (2 I) and its activation (I)."""
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return dtype_bytes * (4 * self.hidden_size + q + 2 * kv + 3 * self.intermediate_size)

    def saved_bytes_per_token(self, dtype_bytes: int) -> int:
        """What one decoder layer keeps for backward per token: both norms' inputs and outputs (4 h), q, k, v and the
        attention output (2 q + 2 kv), gate, up, act(gate) and act(gate) * up (4 I)."""
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return dtype_bytes * (4 * self.hidden_size + 2 * q + 2 * kv + 4 * self.intermediate_size)


PRESETS: dict[str, dict] = {
    # The config.json numbers of the paper's models; the keys are conf/model/*.yaml's names, "hub" their path.
    "qwen2.5-1.5b": dict(hub="Qwen/Qwen2.5-1.5B-Instruct", model_type="qwen2", hidden_size=1536, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                         tie_word_embeddings=True, max_position_embeddings=32768),
    "llama3.2-3b": dict(hub="meta-llama/Llama-3.2-3B-Instruct", model_type="llama", hidden_size=3072,
                        num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                        max_position_embeddings=131072),
    "qwen2.5-7b": dict(hub="Qwen/Qwen2.5-7B-Instruct", model_type="qwen2", hidden_size=3584, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                       tie_word_embeddings=False, max_position_embeddings=32768),
    "r1-distill-qwen-1.5b": dict(hub="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", model_type="qwen2",
                                 hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=False,
                                 max_position_embeddings=131072),
}
LLAMA_3_1_8B = dict(hub="meta-llama/Llama-3.1-8B", model_type="llama", hidden_size=4096, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                    vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072)
"""scripts/gpu_smoke.py's ~8B model (the issue's 7-8B case)."""


def preset(name: str) -> ModelShape:
    if name not in PRESETS:
        raise ValueError(f"no preset {name!r}; presets: {', '.join(PRESETS)} (or pass --config config.json)")
    return ModelShape.from_hf_config(PRESETS[name], name=name)


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


def vllm_batch_defaults(card_bytes: int, device_name: str = "") -> dict[str, int]:
    """The (max_num_batched_tokens, max_num_seqs) vLLM 0.32's offline LLM picks when unset (this engine does not set
    them), by the card: its ``EngineArgs.get_batch_defaults`` (vllm/engine/arg_utils.py, LLM_CLASS): 16384 / 1024 on
    160 GiB or more, and on 70 GiB or more unless the device's name holds "a100" (H100 / H200 class); else 8192 / 256
    (an A100-80GB, 79.2 GiB, and every smaller card). ``device_name``: torch.cuda.get_device_name's (nvidia-smi's)."""
    big = card_bytes >= 160 * GiB or (card_bytes >= 70 * GiB and "a100" not in device_name.lower())
    return {"max_num_batched_tokens": 16384 if big else 8192, "max_num_seqs": 1024 if big else 256}


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
    "float32": LearnerVariant(4, 4, 0, 8, 4, 4, "grpo.dtype=float32",
                              "fp32 weights, gradients, AdamW moments and compute"),
    "bf16_mixed": LearnerVariant(4, 4, 0, 8, 2, 2, "grpo.dtype=bf16_mixed",
                                 "fp32 master weights, gradients and AdamW; forward and backward under "
                                 "autocast(bf16), no weight-cast cache"),
    "bf16_fp32_master": LearnerVariant(2, 2, 4, 8, 2, 2, "bf16 weights + fp32 master (no grpo.dtype)",
                                       "bf16 weights and gradients; an fp32 master and fp32 AdamW moments take the "
                                       "step (the same 16 B/param; grpo.dtype=bf16_mixed was chosen instead)"),
}
"""The GRPO learner's precisions: bytes per parameter of weights, gradients, an fp32 master and AdamW's two moments,
then the reference model's and the activations' dtype bytes. Pure bf16 weights are not a variant: grpo.dtype refuses
them (an AdamW step of ~1e-5 is below bf16's spacing near 1 and vanishes)."""


# -- the plan ---------------------------------------------------------------------------------------------------


def _perturbation(name: str):
    """The es.perturbation mode (``es_ray.perturbation``), imported when a plan needs it (this module's command line
    imports no torch)."""
    from es_ray.perturbation import PERTURBATIONS

    return PERTURBATIONS.get(name)


def _noise(name: str):
    """What the es.noise value holds (``es_ray.noise.NOISE_MEMORY``), imported as ``_perturbation`` is."""
    from es_ray.noise_kinds import NOISE_MEMORY

    return NOISE_MEMORY.get(name)


@dataclass(frozen=True)
class Line:
    part: str
    """vllm (ES actor or GRPO rollout GPU), es (the replica beside vLLM) or learner (the GRPO learner's GPU)."""
    item: str
    nbytes: int
    note: str = ""


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
            return {"colocated": max(self.part("learner") + VLLM_FIXED_BYTES, self.learner_resident + awake,
                                     self.item_bytes("build", "learner build (device)") + awake)}
        return {"learner": self.part("learner"), "rollout": self.part("vllm")}

    @property
    def learner_resident(self) -> int:
        """A colocated learner rank's bytes that stay on the device while vLLM is awake (its weights, master, AdamW,
        reference and the allocator's slack; gradients and activations are freed after the step)."""
        return sum(line.nbytes for line in self.lines if line.part == "learner" and line.item in
                   ("weights", "fp32 master", "AdamW moments", "reference model", "allocator slack"))

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
            return (f"{self.model.name}: the evaluation engine needs {_gib(self.part('vllm'))} on a "
                    f"{_gib(card_bytes)} GPU: " + (f"set engine.tensor_parallel_size={tp}" if tp else
                                                    "set a shorter engine.max_model_len or use a larger card"))
        need = self.part("es")
        free = card_bytes - self.part("vllm") if free_bytes is None else free_bytes
        if need <= free:
            return None
        items = ", ".join(f"{line.item} {_gib(line.nbytes)}" for line in self.lines if line.part == "es")
        where = (f"{_gib(free)} are free beside vLLM (engine.gpu_memory_utilization={share:.2f} of {_gib(card_bytes)})"
                 if share is not None else f"a {_gib(card_bytes)} card leaves {_gib(free)} beside vLLM's "
                 f"{_gib(self.part('vllm'))}")
        room, floor = (card_bytes - need) / card_bytes, self.gpu_memory_utilization(card_bytes)
        if room < floor:
            fixes = [f"(no engine.gpu_memory_utilization leaves room: vLLM needs at least {floor:.2f} of the card)"]
        else:
            fixes = [f"engine.gpu_memory_utilization={math.floor(room * 100) / 100:.2f} (the most that leaves room "
                     f"for ES; vLLM needs at least {floor:.2f})"]
        tp = self.tp_needed(card_bytes) or max(t for t in TP_DEGREES if self.model.num_attention_heads % t == 0)
        changes = [("es.optimizer=sgd", {"optimizer": "sgd"}, ""), ("es.anchor_decay=0", {"anchor_decay": 0.0}, ""),
                   ("es.noise=per_tensor", {"noise": "per_tensor" if _noise(self.settings.noise).table else
                                            self.settings.noise}, ""),
                   (f"engine.tensor_parallel_size={tp}", {"tensor_parallel_size": tp},
                    "; it splits vLLM's part" + (" and the master" if self.settings.master_sharded else
                                                 ", every rank keeps the whole master"))]
        for key, change, why in changes:
            alt = self.with_settings(**change)
            # a change of the ES part meets the same free memory; tensor parallelism shrinks vLLM's part
            short = alt.part("es") - (free if key.startswith("es.") else card_bytes - alt.part("vllm"))
            if alt.settings != self.settings and short < need - free:  # only what brings it closer
                fixes.append(f"{key} ({'fits' if short <= 0 else _gib(short) + ' short still'}{why})")
        kv = self.item_bytes("vllm", "KV cache")
        if kv >= need - free:
            fixes.append(f"a shorter engine.max_model_len (vLLM keeps {_gib(kv)} of KV cache for "
                         f"{self.settings.sequences} x {self.settings.tokens_per_sequence} tokens)")
        fixes.append("model.trainable=REGEX (perturb and update a subset of the tensors)")
        fixes.append(f"a GPU with at least {_gib(self.part('vllm') + need)}")
        return (f"{self.model.name}: the ES replica needs {_gib(need)} on this GPU ({items}) but {where}; it would run "
                f"out of memory at its first update, after a whole iteration of generation. Change one of: "
                + "; ".join(fixes))

    def _grpo_refusal(self, card_bytes: int) -> str | None:
        if self.fits(card_bytes):
            return None
        s, out = self.settings, []
        where = "colocated" if s.colocate else "learner"
        if self.gpus[where] > card_bytes:
            items = ", ".join(f"{line.item} {_gib(line.nbytes)}" for line in self.lines if line.part == "learner")
            if s.colocate and s.card_bytes:
                items += (f"; awake beside it, vLLM's engine.gpu_memory_utilization={engine_share(self):.2f} of the "
                          f"card: {_gib(self.vllm_mapped)}")
            # the first (smallest) change of each kind that fits on its own
            groups = [[(f"grpo.fsdp_size>={f}", {"fsdp_size": f}) for f in FSDP_DEGREES if f > s.fsdp_size],
                      [(f"grpo.offload={o}", {"offload": o}) for o in OFFLOADS[OFFLOADS.index(s.offload) + 1:]]]
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
            out.append(f"{what} needs {_gib(self.gpus[where])} ({items}) on a {_gib(card_bytes)} GPU{on}: set "
                       + (" or ".join(fixes) + "; or " if fixes else "")
                       + "a smaller grpo.micro_batch_size or grpo.logit_chunk_tokens, model.trainable=REGEX "
                       "(gradients and AdamW for those tensors only), or a larger GPU (grpo.gradient_checkpointing and "
                       "grpo.fsdp_size shrink the learner; engine.tensor_parallel_size does not)")
        if not s.colocate and self.part("vllm") > card_bytes:
            tp = self.tp_needed(card_bytes)
            out.append(f"a rollout engine needs {_gib(self.part('vllm'))}: set engine.tensor_parallel_size={tp}"
                       if tp else f"a rollout engine needs {_gib(self.part('vllm'))}: use a larger card")
        return f"{self.model.name}: " + "; ".join(out)

    def item_bytes(self, part: str, prefix: str) -> int:
        """Bytes of the lines of ``part`` whose item starts with ``prefix``."""
        return sum(line.nbytes for line in self.lines if line.part == part and line.item.startswith(prefix))

    def markdown(self) -> str:
        rows = [f"| {line.part} | {line.item} | {_gib(line.nbytes)} | {line.note} |" for line in self.lines]
        per_gpu = ", ".join(f"{k} {_gib(v)}" for k, v in self.gpus.items())
        return "\n".join([f"{self.model.name}, {self.method} ({per_gpu}):", "", "| part | item | size | how |",
                          "|---|---|---:|---|", *rows])


def _vllm_lines(m: ModelShape, s: Settings) -> list[Line]:
    tp, dt = s.tensor_parallel_size, s.engine_dtype_bytes
    kv_heads = max(1, m.num_key_value_heads // tp)  # vLLM replicates KV heads when TP exceeds their number
    kv_per_token = 2 * m.num_hidden_layers * kv_heads * m.head_dim * dt
    tokens = max(s.sequences * s.tokens_per_sequence, s.kv_floor_tokens)
    floor = (f"; at least one max_model_len sequence: {s.kv_floor_tokens} tok" if s.kv_floor_tokens > s.sequences *
             s.tokens_per_sequence else "")
    act = s.max_num_batched_tokens * m.forward_bytes_per_token(dt) // tp
    sampler = s.max_num_seqs * m.vocab_size * SAMPLER_BYTES_PER_LOGIT
    lines = [
        Line("vllm", "engine weights", m.parameters() * dt // tp, f"all parameters x {dt} B / TP {tp}"),
        Line("vllm", "KV cache", tokens * kv_per_token,
             f"{s.sequences} seq x {s.tokens_per_sequence} tok x {kv_per_token} B/token (2 x layers x kv heads x "
             f"head dim x dtype, per rank){floor}"),
        Line("vllm", "vLLM allowance", VLLM_FIXED_BYTES + act + sampler,
             f"{VLLM_FIXED_BYTES // GiB} GiB context/workspaces/CUDA graphs + profile run of "
             f"{s.max_num_batched_tokens} tokens + sampler over {s.max_num_seqs} x vocab fp32"),
    ]
    if _perturbation(s.perturbation).batched:
        per = lowrank_elements(m, s.rank)
        lines.append(Line("vllm", "LoRA slots", s.members * per * dt // tp,
                          f"{s.members} slots x {per:,} factor elements (rank {s.rank}) x {dt} B / TP {tp}"))
    return lines


def lowrank_elements(m: ModelShape, rank: int) -> int:
    """Elements of one member's low-rank factors: r x (rows + columns) of every 2-D layer weight (es_ray.lowrank's
    targets: not the embedding or the LM head)."""
    return sum(rank * (shape[0] + shape[1]) for name, shape in m.tensors().items()
               if len(shape) == 2 and ".layers." in name)


def plan_es(m: ModelShape, s: Settings = Settings()) -> MemoryPlan:
    """vLLM and the ES replica on one GPU (one rank under tensor parallelism)."""
    tensors = {k: v for k, v in m.tensors().items() if not s.trainable or re.search(s.trainable, k)}
    if not tensors:
        raise ValueError(f"model.trainable={s.trainable!r} selects no tensor of {m.name}")
    tp = s.tensor_parallel_size if s.master_sharded else 1
    parts = {k: m.tp_part(k, v, tp) for k, v in tensors.items()}
    n, big = sum(p for p, _ in parts.values()), max(p for p, _ in parts.values())
    whole = max(math.prod(v) for v in tensors.values())
    kind, noise = s.noise, _noise(s.noise)
    adam = s.optimizer == "adam"
    es = [Line("es", "fp32 master", 4 * n, f"{n:,} trainable parameters x 4 B"
               + (f" (this rank's shards at TP {tp})" if tp > 1 else ""))]
    if adam:
        es.append(Line("es", "Adam moments", 8 * n, "m and v, fp32: 8 B per trainable parameter"))
    if s.anchor_decay:
        es.append(Line("es", "theta_0 anchor", 4 * n, "es.anchor_decay: the initial weights, fp32"))
    es.append(Line("es", "_buf", 4 * whole, f"fp32, the largest whole HF tensor ({whole:,} elements)"))
    if noise.table:
        es.append(Line("es", "noise table", 4 * s.noise_table_size, f"es.noise_table_size={s.noise_table_size} x 4 B"))
    else:  # the noise of a rank's part: those rows alone for counter, the whole tensor for per_tensor or columns
        drawn = max(math.prod(tensors[k]) if noise.whole_tensor or dim == 1 else p
                    for k, (p, dim) in parts.items())
        es.append(Line("es", "_nbuf", 4 * drawn, f"fp32, the largest noise drawn ({drawn:,} elements, "
                                                 f"es.noise={kind})"))
    if noise.counter_chunks:
        es.append(Line("es", "counter noise chunks", COUNTER_NOISE_BYTES, "es.noise=counter's Philox temporaries"))
    if adam or s.anchor_decay:
        es.append(Line("es", "step temporary", 4 * big, "Adam's sqrt(v) or the anchor's theta - theta_0"))
    es.append(Line("es", "update chunks", 4 * CHUNK_TEMPORARIES * min(REPLICA_CHUNK, big),
                   f"{CHUNK_TEMPORARIES} fp32 temporaries of replica.CHUNK={REPLICA_CHUNK} elements"))
    if _perturbation(s.perturbation).factored:
        per = lowrank_elements(m, s.rank)
        es.append(Line("es", "low-rank factors", 4 * s.members * per,
                       f"fp32 A and B of {s.members} members x {per:,} elements (rank {s.rank})"))
    es.append(Line("es", "allocator slack", ES_SLACK_BYTES, "caching-allocator rounding and fragmentation"))
    return MemoryPlan(m, "es", s, tuple(_vllm_lines(m, s) + es))


def plan_grpo(m: ModelShape, s: Settings = Settings()) -> MemoryPlan:
    """One GRPO learner rank's GPU (FSDP2 over grpo.fsdp_size ranks; the whole learner at 1), and one rollout
    engine's (vLLM alone on its GPUs, or on the learner rank's GPU with grpo.colocate)."""
    if s.learner not in LEARNER_VARIANTS:
        raise ValueError(f"learner={s.learner!r} is not one of {', '.join(LEARNER_VARIANTS)}")
    if s.offload not in OFFLOADS:
        raise ValueError(f"grpo.offload={s.offload!r} is not one of {', '.join(OFFLOADS)}")
    v, f = LEARNER_VARIANTS[s.learner], max(1, s.fsdp_size)
    total, n = m.parameters(), m.parameters(s.trainable)
    micro = -(-s.micro_batch_size // f)  # each rank's share of a micro-batch
    tokens = micro * s.tokens_per_sequence
    if s.gradient_checkpointing:  # each layer's input, plus one layer's activations while it is recomputed
        act = tokens * (m.num_hidden_layers * m.hidden_size * v.activation_bytes
                        + m.saved_bytes_per_token(v.activation_bytes))
        act_note = "checkpointed: every layer's input + one layer recomputed"
    else:
        act = tokens * m.num_hidden_layers * m.saved_bytes_per_token(v.activation_bytes)
        act_note = "every layer's saved activations"
    shard = f" / fsdp {f}" if f > 1 else ""
    host = {"weights": s.offload == "all", "gradients": s.offload == "all",
            "AdamW moments": s.offload in ("optimizer", "all")}
    lines = [Line("learner", "weights", total * v.weights // f, f"{total:,} x {v.weights} B{shard} ({v.note})"),
             Line("learner", "gradients", n * v.grads // f, f"{n:,} trainable x {v.grads} B{shard}")]
    if v.master:
        lines.append(Line("learner", "fp32 master", n * v.master // f, f"the optimizer's fp32 copy{shard}"))
    lines.append(Line("learner", "AdamW moments", n * v.optimizer // f, f"m and v, {v.optimizer // 2} B each{shard}"))
    lines = [replace(line, part="host", note=line.note + " (grpo.offload: on the host)") if host.get(line.item)
             else line for line in lines]
    if f > 1 or s.offload == "all":  # FSDP2 all-gathers a layer (and prefetches the next), the root stays whole
        layer = sum(math.prod(t) for name, t in m.tensors().items() if ".layers.0." in name)
        root = total - m.num_hidden_layers * layer
        cb = v.activation_bytes
        lines.append(Line("learner", "gathered parameters", (3 * layer + 2 * root) * cb,
                          f"unsharded in {cb} B: 2 layers (current + prefetched) + one layer's gradients, the root "
                          "(embedding, norm, LM head) and its gradients"))
    if s.reference_model:
        lines.append(Line("learner", "reference model", total * v.reference_bytes,
                          f"grpo.beta > 0: a frozen copy, {v.reference_bytes} B/param, whole on every rank"))
    chunk = min(s.logit_chunk_tokens, micro * s.completion_tokens)
    logits = chunk * m.vocab_size * 4 * LOGIT_COPIES
    lines.append(Line("learner", "logits chunk", logits,
                      f"min(grpo.logit_chunk_tokens, {micro} seq x {s.completion_tokens} completion tok)"
                      f" = {chunk} positions x vocab x 4 B x {LOGIT_COPIES}"))
    lines.append(Line("learner", "activations", act,
                      f"{micro} seq{' (this rank)' if f > 1 else ''} x {s.tokens_per_sequence} tok, {act_note}"))
    fsdp = f > 1 or s.offload == "all"  # FSDP2's mixed precision gathers bf16 copies ("gathered parameters")
    if v.weights > v.activation_bytes and not fsdp:  # autocast casts each matmul's weight; the widest: the vocabulary's
        lines.append(Line("learner", "weight casts", m.vocab_size * m.hidden_size * v.activation_bytes * 2,
                          f"vocab x hidden x {v.activation_bytes} B x 2: the LM head's autocast copy and its "
                          "gradient, alive together in its backward"))
    # measured on an H200 (scripts/gpu_smoke.py, bf16_mixed, micro-batch 4 x 256 tokens, a 1.74 GiB logits chunk):
    # the allocator's reserved peak stood 1.38 GiB (Qwen2.5-0.5B-shaped) and 1.65 GiB (1.5B) above its allocated peak
    lines.append(Line("learner", "allocator slack", ES_SLACK_BYTES + logits,
                      "caching-allocator rounding and fragmentation: 0.5 GiB + the logits chunk's blocks once more"))
    lines.append(Line("learner", "CUDA context", CUDA_CONTEXT_BYTES, "outside torch's allocator"))
    return MemoryPlan(m, "grpo", s, tuple(lines + _build_lines(m, s) + _vllm_lines(m, s)))


def _build_lines(m: ModelShape, s: Settings) -> list[Line]:
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
        return [Line("build", "learner build (device)", device,
                     f"this rank's fp32 shard: {total:,} x 4 B / fsdp {f}" if device else
                     "none: grpo.offload=all keeps the shards on the host"),
                Line("build", "learner build (host)", rows * 8 + (total * 4 // f if not device else 0),
                     f"one tensor's rows read at a time: the largest, {largest:,} / fsdp {f} x (4 B read + 4 B fp32)"
                     + (" + the rank's fp32 shard" if not device else "")),
                Line("build", "learner resume (host)", rows * 8,
                     f"beside the built learner: one tensor's rows of the checkpoint at a time, {largest:,} / fsdp "
                     f"{f} x (4 B read + 4 B fp32)")]
    return [Line("build", "learner build (device)", total * 4, f"the whole fp32 model: {total:,} x 4 B"),
            Line("build", "learner build (host)", total * 4, "from_pretrained's whole fp32 model, before the move"),
            Line("build", "learner resume (host)", largest * 8,
                 f"beside the built learner: one whole tensor of the checkpoint at a time, {largest:,} x (4 B read + "
                 "4 B fp32)")]


def plan_eval(m: ModelShape, s: Settings = Settings()) -> MemoryPlan:
    """An evaluation (or any generation-only) engine: vLLM alone on its GPUs."""
    return MemoryPlan(m, "eval", s, tuple(_vllm_lines(m, s)))


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
        members = _perturbation(es.perturbation).members_at_once(es.population, cfg.cluster.num_actors)
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


GPU_ONLY = ("vLLM allowance", "CUDA context", "allocator slack", "gathered parameters", "LoRA slots")


def host_plan_bytes(kind: str, plan: MemoryPlan, cfg) -> tuple[int, str]:
    """A CPU run's processes all on this host: (bytes, how) summed over them, the GPU-only lines left out (the
    transformers engine has no vLLM allowance, KV pool or CUDA context)."""
    per = {p: sum(line.nbytes for line in plan.lines if line.part == p and line.item not in GPU_ONLY)
           for p in ("vllm", "es", "learner", "host")}
    n = max(1, cfg.cluster.num_actors)
    if kind == "grpo":
        f = max(1, cfg.grpo.fsdp_size)
        total = f * (per["learner"] + per["host"]) + n * per["vllm"]
        return total, (f"{f} learner rank(s) x {_gib(per['learner'] + per['host'])} + {n} rollout(s) x "
                       f"{_gib(per['vllm'])}")
    if kind == "es":
        return n * (per["vllm"] + per["es"]), f"{n} ES actor(s) x {_gib(per['vllm'] + per['es'])}"
    return n * per["vllm"], f"{n} engine(s) x {_gib(per['vllm'])}"


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
            raise ConfigError(f"{message} [memory plan: {_gib(usable)} usable of the {_gib(reported)} the GPU reports "
                              f"(less {PLAN_MARGIN:.0%} margin and {_gib(CUDA_CONTEXT_BYTES)} CUDA context); every "
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
        raise ConfigError(f"{shape.name}: this CPU run needs {_gib(need)} of host memory ({how}) but "
                          f"{_gib(have)} ({HOST_SHARE:.0%} of the host's RAM) is available; change {fixes}")
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


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB"


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
