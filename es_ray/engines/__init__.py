"""Generation engines behind one interface (``es_ray.engines.base``): transformers (``hf``) and vLLM (``vllm``).

``ENGINES`` is the list of valid ``engine.name`` values and the dispatch; entries are import paths, so listing
the names imports neither transformers nor vLLM."""

from es_ray.core.registry import Registry

ENGINES = Registry("engine.name", {"hf": "es_ray.engines.hf:HFEngine", "vllm": "es_ray.engines.vllm:VLLMEngine"})
LOWRANK_RANKS = Registry("engine.name", {"hf": "es_ray.engines.hf:lowrank_ranks",
                                         "vllm": "es_ray.engines.vllm:lowrank_ranks"})
"""Engines that batch a population of low-rank members (es.perturbation=lowrank): a function giving the ranks the
engine can serve (None: any rank)."""
TENSOR_PARALLEL = ("vllm",)
"""Engines that can split one model over several GPUs (engine.tensor_parallel_size > 1)."""
