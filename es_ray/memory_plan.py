"""GPU memory plan of one ES actor, or of one GRPO learner and its rollout GPUs, from the model's HF config alone.

Pure arithmetic (no torch): ``python -m es_ray.memory_plan`` prints the paper's four models on 24, 40 and 80 GB
cards (the README's "Memory plan (GPU)" table); the vLLM engine sizes vLLM's share of the GPU from it when
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
    """vLLM's profile-run batch (its default for the offline LLM on cards of 70 GiB or more; 8192 below)."""
    max_num_seqs: int = 1024
    """vLLM's largest decode batch (1024 on cards of 70 GiB or more, 256 below)."""
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


def vllm_batch_defaults(card_bytes: int) -> dict[str, int]:
    """The (max_num_batched_tokens, max_num_seqs) vLLM's offline LLM picks when unset, by card size (assumed from
    vLLM's EngineArgs defaults; this engine does not set them)."""
    big = card_bytes >= 70 * GiB
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
        return {"learner": self.part("learner"), "rollout": self.part("vllm")}

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
                   ("es.noise=per_tensor", {"noise": "per_tensor" if self.settings.noise == "table" else
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
        out = []
        if self.part("learner") > card_bytes:
            items = ", ".join(f"{line.item} {_gib(line.nbytes)}" for line in self.lines if line.part == "learner")
            out.append(f"the GRPO learner needs {_gib(self.part('learner'))} ({items}) on a {_gib(card_bytes)} GPU: "
                       "set grpo.gradient_checkpointing=true, a smaller grpo.micro_batch_size or "
                       "grpo.logit_chunk_tokens, model.trainable=REGEX (gradients and AdamW for those tensors only), "
                       f"or use a GPU with at least {_gib(self.part('learner'))} (the learner is one GPU: tensor "
                       "parallelism does not split it; every grpo.dtype keeps 16 B per trainable parameter)")
        if self.part("vllm") > card_bytes:
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
    tokens = s.sequences * s.tokens_per_sequence
    act = s.max_num_batched_tokens * m.forward_bytes_per_token(dt) // tp
    sampler = s.max_num_seqs * m.vocab_size * SAMPLER_BYTES_PER_LOGIT
    return [
        Line("vllm", "engine weights", m.parameters() * dt // tp, f"all parameters x {dt} B / TP {tp}"),
        Line("vllm", "KV cache", tokens * kv_per_token,
             f"{s.sequences} seq x {s.tokens_per_sequence} tok x {kv_per_token} B/token (2 x layers x kv heads x "
             "head dim x dtype, per rank)"),
        Line("vllm", "vLLM allowance", VLLM_FIXED_BYTES + act + sampler,
             f"{VLLM_FIXED_BYTES // GiB} GiB context/workspaces/CUDA graphs + profile run of "
             f"{s.max_num_batched_tokens} tokens + sampler over {s.max_num_seqs} x vocab fp32"),
    ]


def plan_es(m: ModelShape, s: Settings = Settings()) -> MemoryPlan:
    """vLLM and the ES replica on one GPU (one rank under tensor parallelism)."""
    tensors = {k: v for k, v in m.tensors().items() if not s.trainable or re.search(s.trainable, k)}
    if not tensors:
        raise ValueError(f"model.trainable={s.trainable!r} selects no tensor of {m.name}")
    tp = s.tensor_parallel_size if s.master_sharded else 1
    parts = {k: m.tp_part(k, v, tp) for k, v in tensors.items()}
    n, big = sum(p for p, _ in parts.values()), max(p for p, _ in parts.values())
    whole = max(math.prod(v) for v in tensors.values())
    kind = s.noise
    adam = s.optimizer == "adam"
    es = [Line("es", "fp32 master", 4 * n, f"{n:,} trainable parameters x 4 B"
               + (f" (this rank's shards at TP {tp})" if tp > 1 else ""))]
    if adam:
        es.append(Line("es", "Adam moments", 8 * n, "m and v, fp32: 8 B per trainable parameter"))
    if s.anchor_decay:
        es.append(Line("es", "theta_0 anchor", 4 * n, "es.anchor_decay: the initial weights, fp32"))
    es.append(Line("es", "_buf", 4 * whole, f"fp32, the largest whole HF tensor ({whole:,} elements)"))
    if kind == "table":
        es.append(Line("es", "noise table", 4 * s.noise_table_size, f"es.noise_table_size={s.noise_table_size} x 4 B"))
    else:  # the noise of a rank's part: those rows alone for counter, the whole tensor for per_tensor or columns
        drawn = max(math.prod(tensors[k]) if kind in ("per_tensor", "auto") or dim == 1 else p
                    for k, (p, dim) in parts.items())
        es.append(Line("es", "_nbuf", 4 * drawn, f"fp32, the largest noise drawn ({drawn:,} elements, "
                                                 f"es.noise={kind})"))
    if kind in ("counter", "auto"):
        es.append(Line("es", "counter noise chunks", COUNTER_NOISE_BYTES, "es.noise=counter's Philox temporaries"))
    if adam or s.anchor_decay:
        es.append(Line("es", "step temporary", 4 * big, "Adam's sqrt(v) or the anchor's theta - theta_0"))
    es.append(Line("es", "update chunks", 4 * CHUNK_TEMPORARIES * min(REPLICA_CHUNK, big),
                   f"{CHUNK_TEMPORARIES} fp32 temporaries of replica.CHUNK={REPLICA_CHUNK} elements"))
    es.append(Line("es", "allocator slack", ES_SLACK_BYTES, "caching-allocator rounding and fragmentation"))
    return MemoryPlan(m, "es", s, tuple(_vllm_lines(m, s) + es))


def plan_grpo(m: ModelShape, s: Settings = Settings()) -> MemoryPlan:
    """The GRPO learner's GPU, and one rollout engine's (vLLM alone on its GPUs)."""
    if s.learner not in LEARNER_VARIANTS:
        raise ValueError(f"learner={s.learner!r} is not one of {', '.join(LEARNER_VARIANTS)}")
    v = LEARNER_VARIANTS[s.learner]
    total, n = m.parameters(), m.parameters(s.trainable)
    tokens = s.micro_batch_size * s.tokens_per_sequence
    if s.gradient_checkpointing:  # each layer's input, plus one layer's activations while it is recomputed
        act = tokens * (m.num_hidden_layers * m.hidden_size * v.activation_bytes
                        + m.saved_bytes_per_token(v.activation_bytes))
        act_note = "checkpointed: every layer's input + one layer recomputed"
    else:
        act = tokens * m.num_hidden_layers * m.saved_bytes_per_token(v.activation_bytes)
        act_note = "every layer's saved activations"
    lines = [Line("learner", "weights", total * v.weights, f"{total:,} x {v.weights} B ({v.note})"),
             Line("learner", "gradients", n * v.grads, f"{n:,} trainable x {v.grads} B")]
    if v.master:
        lines.append(Line("learner", "fp32 master", n * v.master, "the optimizer's fp32 copy"))
    lines.append(Line("learner", "AdamW moments", n * v.optimizer, f"m and v, {v.optimizer // 2} B each"))
    if s.reference_model:
        lines.append(Line("learner", "reference model", total * v.reference_bytes,
                          f"grpo.beta > 0: a frozen copy, {v.reference_bytes} B/param"))
    chunk = min(s.logit_chunk_tokens, s.micro_batch_size * s.completion_tokens)
    lines.append(Line("learner", "logits chunk", chunk * m.vocab_size * 4 * LOGIT_COPIES,
                      f"min(grpo.logit_chunk_tokens, {s.micro_batch_size} seq x {s.completion_tokens} completion tok)"
                      f" = {chunk} positions x vocab x 4 B x {LOGIT_COPIES}"))
    lines.append(Line("learner", "activations", act,
                      f"{s.micro_batch_size} seq x {s.tokens_per_sequence} tok, {act_note}"))
    lines.append(Line("learner", "allocator slack", ES_SLACK_BYTES, "caching-allocator rounding and fragmentation"))
    return MemoryPlan(m, "grpo", s, tuple(lines + _vllm_lines(m, s)))


PLANNERS = {"es": plan_es, "grpo": plan_grpo}
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


# -- the table --------------------------------------------------------------------------------------------------

SETUPS = (
    ("ES, sgd", "es", {"optimizer": "sgd"}),
    ("ES, adam", "es", {"optimizer": "adam"}),
    *((f"GRPO, {v.label}", "grpo", {"learner": name}) for name, v in LEARNER_VARIANTS.items()),
)


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB"


def cell(plan: MemoryPlan, card_bytes: int) -> str:
    total = f"{plan.total / GiB:.1f}"
    if plan.fits(card_bytes):
        share = f", vLLM {plan.gpu_memory_utilization(card_bytes):.2f}" if plan.method == "es" else ""
        return f"{total} fits{share}"
    tp = plan.tp_needed(card_bytes)
    return f"{total} no, TP {tp} fits" if tp else f"{total} no (no TP fits)"


def table(models: list[ModelShape], cards_gb=(24, 40, 80), base: Settings = Settings()) -> str:
    """Markdown: per model and setup, per card: GiB on the fullest GPU, whether it fits (with vLLM's share for ES)
    and, when it does not, the tensor-parallel degree that would fit."""
    head = ["| model | params | setup | " + " | ".join(f"{c} GB" for c in cards_gb) + " |",
            "|---|---:|---|" + "---|" * len(cards_gb)]
    rows = []
    for m in models:
        for label, method, changes in SETUPS:
            cells = []
            for c in cards_gb:
                card = c * GiB
                plan = PLANNERS[method](m, replace(base, **changes, **vllm_batch_defaults(card)))
                cells.append(cell(plan, card))
            rows.append(f"| {m.name} | {m.parameters() / 1e9:.2f}B | {label} | " + " | ".join(cells) + " |")
    return "\n".join(head + rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m es_ray.memory_plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", choices=list(PRESETS), help="a preset (default: all four)")
    ap.add_argument("--config", action="append", default=[], help="an HF config.json (or a model directory)")
    ap.add_argument("--cards", type=int, nargs="+", default=[24, 40, 80], help="card sizes in GB (GiB)")
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
    print("\nGiB on the fullest GPU (ES: vLLM + replica on one GPU; GRPO: the learner's or a rollout GPU); "
          f"vLLM x.xx is engine.gpu_memory_utilization. KV cache for {args.sequences} sequences x {args.tokens} "
          f"tokens, bf16 engine; GRPO micro-batch {args.micro_batch} x {args.tokens} tokens "
          f"({args.completion_tokens} completion), gradient checkpointing on.")
    if args.detail:
        for m in models:
            for label, method, changes in SETUPS:
                plan = PLANNERS[method](m, replace(base, **changes, **vllm_batch_defaults(args.cards[0] * GiB)))
                print(f"\n{label}: " + plan.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
