"""The sizes of a Llama- or Qwen2-shaped decoder from its HF config.json alone (no torch): its tensors as
``named_parameters()`` lists them, their tensor-parallel parts, and the per-token sizes the parts' memory statements
use (es_ray/core/memory.py); the paper's models as presets (``PRESETS``, conf/model/*.yaml's names)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path


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
            raise ValueError(
                f"{name or 'config'}: model_type {kind!r} is not Llama- or Qwen2-shaped; the memory "
                "plan counts llama, qwen2 and mistral tensors only"
            )
        heads = int(cfg["num_attention_heads"])
        bias = bool(cfg.get("attention_bias", False))
        return cls(
            name=name or cfg.get("_name_or_path", "") or kind,
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            qkv_bias=kind == "qwen2" or bias,
            o_bias=kind != "qwen2" and bias,
            mlp_bias=kind != "qwen2" and bool(cfg.get("mlp_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelShape:
        path = Path(model_dir) / "config.json"
        return cls.from_hf_config(json.loads(path.read_text()), name=Path(model_dir).name)

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """HF parameter name -> shape, as ``named_parameters()`` lists them (a tied LM head once, as the embedding)."""
        h, inter = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        projections = (
            ("self_attn.q_proj", q, h, self.qkv_bias),
            ("self_attn.k_proj", kv, h, self.qkv_bias),
            ("self_attn.v_proj", kv, h, self.qkv_bias),
            ("self_attn.o_proj", h, q, self.o_bias),
            ("mlp.gate_proj", inter, h, self.mlp_bias),
            ("mlp.up_proj", inter, h, self.mlp_bias),
            ("mlp.down_proj", h, inter, self.mlp_bias),
        )
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
    "qwen2.5-1.5b": dict(
        hub="Qwen/Qwen2.5-1.5B-Instruct",
        model_type="qwen2",
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "llama3.2-3b": dict(
        hub="meta-llama/Llama-3.2-3B-Instruct",
        model_type="llama",
        hidden_size=3072,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
    "qwen2.5-7b": dict(
        hub="Qwen/Qwen2.5-7B-Instruct",
        model_type="qwen2",
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
    ),
    "r1-distill-qwen-1.5b": dict(
        hub="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
        model_type="qwen2",
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
    ),
}
LLAMA_3_1_8B = dict(
    hub="meta-llama/Llama-3.1-8B",
    model_type="llama",
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=14336,
    vocab_size=128256,
    tie_word_embeddings=False,
    max_position_embeddings=131072,
)
"""scripts/gpu_smoke.py's ~8B model (the issue's 7-8B case)."""


def preset(name: str) -> ModelShape:
    if name not in PRESETS:
        raise ValueError(f"no preset {name!r}; presets: {', '.join(PRESETS)} (or pass --config config.json)")
    return ModelShape.from_hf_config(PRESETS[name], name=name)
