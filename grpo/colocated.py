"""grpo.colocate=true: one actor per device holding a rollout engine and a learner rank (verl's and OpenRLHF's
"hybrid engine"). GRPO's phases alternate (generate, train, sync), so two actors on separate devices each idle while
the other works; here each device runs both phases in turn.

On CPU the two share the actor's cores. On GPU the engine sleeps while the learner trains (vLLM sleep mode, level 2:
its weights discarded, as the sync rewrites every one, its KV cache dropped; ``SLEEP_LEVEL``) and wakes in two steps
around the sync that follows the
optimizer step: the learner's cached blocks are returned to the device first (``torch.cuda.empty_cache``; at TP=1
vLLM's allocator does the same in this process when it wakes, at TP>1 its workers are other processes and cannot free
this one's cache), then the engine's weights wake and the sync writes them, and only then its KV cache is allocated,
so the sync's transient gathers and the KV cache never hold the device at once. Every engine call wakes what it
needs first; a vLLM without sleep mode is refused before any model loads. The weight sync is local: each actor
gathers every tensor from the learner's shards (full_tensor, all ranks together, one layer at a time), casts it to
the engine's dtype and writes it into its own engine.
"""

from __future__ import annotations

import time
from dataclasses import replace

from es_ray.engines import ENGINES
from es_ray.grpo.config import GRPOTrainConfig
from es_ray.grpo.learner import GRPOLearner
from es_ray.grpo.rollout import RolloutWorker, Sample
from es_ray.memory_plan import colocated_engine_share

# torch is imported inside the worker's methods: the driver imports ColocatedWorker (the class it starts) without torch.


SLEEP_LEVEL = 2
"""vLLM's sleep level while the learner trains: 2 discards the engine's weights (vLLM keeps its small buffers on the
host) where level 1 copies them into fresh pinned host buffers at every step (model-sized, ~15 GiB at 7B); the sync
that follows each optimizer step writes every weight anyway."""


class ColocatedWorker(RolloutWorker):
    """A RolloutWorker whose process also holds learner rank ``rank`` of ``world``. The rollout methods keep their
    names; the learner's are exposed under theirs (``learner_probe_logprobs`` for its probe)."""

    def __init__(self, cfg: GRPOTrainConfig, rank: int = 0, world: int = 1):
        check_sleep_mode(cfg)  # the engine is built with sleep mode on
        if _on_gpu(cfg):
            cfg = _with_planned_share(cfg)
        super().__init__(cfg, rank)
        self.learner = GRPOLearner(cfg, rank, world)
        self.sleeping: list[str] = []  # vLLM sleep tags still asleep, in the order they wake
        self.discarded = False  # a level-2 sleep discarded the engine's weights and no sync has rewritten them all

    def ready(self) -> dict:
        return {**self.learner.ready(), **super().ready(), "colocated": True}

    # -- the learner rank ------------------------------------------------------------------------------------
    def address(self) -> str:
        return self.learner.address()

    def join(self, address: str) -> dict:
        return {**self.learner.join(address), **super().ready(), "colocated": True}

    def train_step(self, samples: list[Sample], advantages: list[float]) -> dict:
        self._sleep()  # the engine's memory goes to the learner while it trains
        return self.learner.train_step(samples, advantages)

    def learner_probe_logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        return self.learner.probe_logprobs(prompt_ids, completion_ids)

    def weights(self) -> dict:
        return self.learner.weights()

    def save(self, path: str, meta: dict) -> str:
        return self.learner.save(path, meta)

    def load(self, path: str) -> dict:
        return self.learner.load(path)

    # -- the sync ----------------------------------------------------------------------------------------------
    def sync_local(self, dtype: str) -> dict:
        """The learner's weights into this actor's engine, one chunk (a layer) at a time in the engine's dtype, from
        the learner's device to the engine's without a host copy (``weight_chunk(on_device=True)``); every rank
        gathers every chunk (the collectives run in the same order on all ranks). A sleeping engine wakes its weights
        before and its KV cache after (module docstring)."""
        self._wake("weights")
        t0, nbytes = time.perf_counter(), 0
        for k in range(len(self.learner.chunks)):
            nbytes += self.write_weights(self.learner.weight_chunk(k, dtype, everywhere=True, on_device=True))["bytes"]
        seconds = time.perf_counter() - t0
        self.discarded = False  # every chunk written: no weight is left as the level-2 sleep left it
        self._wake("kv_cache")
        return {"bytes": nbytes, "seconds": seconds}

    # -- the engine's own calls wake it whole ------------------------------------------------------------------
    def generate(self, prompt_indices: list[int], group_size: int, seed: int) -> dict:
        self._wake_all()
        return super().generate(prompt_indices, group_size, seed)

    def evaluate(self, split: str, seed: int) -> dict:
        self._wake_all()
        return super().evaluate(split, seed)

    def probe_logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        self._wake_all()
        return super().probe_logprobs(prompt_ids, completion_ids)

    def probe(self) -> tuple[list[int], list[int]]:
        self._wake_all()
        return super().probe()

    def write_weights(self, weights: dict) -> dict:
        self._wake("weights")
        return super().write_weights(weights)

    def _sleep(self) -> None:
        if not self.sleeping and _on_gpu(self.cfg) and hasattr(self.engine, "sleep"):
            self.engine.sleep(SLEEP_LEVEL)  # weights and KV cache off the device; both come back in _wake
            self.sleeping = ["weights", "kv_cache"]
            self.discarded = SLEEP_LEVEL >= 2

    def _wake_all(self) -> None:
        """Everything awake, for a generate or a probe: refused while the weights are those a level-2 sleep discarded
        (woken, vLLM maps back memory that holds whatever it holds) until a whole sync has rewritten them, e.g. after
        a sync that failed half-way."""
        if getattr(self, "discarded", False):
            raise RuntimeError(
                "the colocated vLLM engine's weights were discarded by its level-2 sleep "
                "(grpo/colocated.py SLEEP_LEVEL) and no complete sync_local has rewritten them since: "
                "generating now would read uninitialised memory; sync the learner's weights first"
            )
        for tag in list(self.sleeping):
            self._wake(tag)

    def _wake(self, tag: str) -> None:
        if tag not in self.sleeping:
            return
        if tag == "weights":
            _release_cached_device_memory()
        self.engine.wake_up([tag])
        self.sleeping.remove(tag)


def _release_cached_device_memory() -> None:
    """The learner's step leaves blocks in torch's caching allocator; vLLM allocates its sleeping memory through
    its own pool, which cannot use them until they are returned to the device."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _on_gpu(cfg: GRPOTrainConfig) -> bool:
    return cfg.cluster.gpus_per_actor > 0 or cfg.engine.device.startswith("cuda")


def check_sleep_mode(cfg: GRPOTrainConfig) -> None:
    """Colocation on GPU: the engine's sleep mode turned on (its memory freed while the learner trains), a build
    without one refused before any model loads, naming the key: the engine's ``sleep_mode`` trait
    (``es_ray.engines.ENGINES``); an engine without the trait keeps its memory."""
    if not _on_gpu(cfg):
        return
    traits = ENGINES.get(cfg.engine.name)
    if traits.sleep_mode:
        traits.enable_sleep_mode()


def _with_planned_share(cfg: GRPOTrainConfig) -> GRPOTrainConfig:
    """``cfg`` with engine.gpu_memory_utilization set, where it is 0, to the share of this GPU that the start-up check
    added up beside the learner (es_ray.memory_plan.engine_share): vLLM fills its share with KV cache and maps all of
    it at every wake-up, so a share sized for a GPU of its own runs the colocated GPU out of memory at the sync."""
    import torch

    dev = torch.cuda.current_device()
    return planned_engine_config(
        cfg, torch.cuda.get_device_properties(dev).total_memory, torch.cuda.get_device_name(dev)
    )


def planned_engine_config(cfg: GRPOTrainConfig, reported: int, device_name: str = "") -> GRPOTrainConfig:
    """``_with_planned_share`` for a GPU reporting ``reported`` bytes named ``device_name``."""
    if cfg.engine.gpu_memory_utilization or not ENGINES.get(cfg.engine.name).memory_share:  # by hand, or no share
        return cfg
    share = colocated_engine_share(cfg, reported, device_name)
    return cfg if share is None else replace(cfg, engine=replace(cfg.engine, gpu_memory_utilization=share))
