"""grpo.colocate=true: one actor per device holding a rollout engine and a learner rank (verl's and OpenRLHF's
"hybrid engine"). GRPO's phases alternate (generate, train, sync), so two actors on separate devices each idle while
the other works; here each device runs both phases in turn.

On CPU the two share the actor's cores. On GPU the engine sleeps while the learner trains (vLLM sleep mode, level 1:
its weights offloaded to the host, its KV cache dropped) and wakes for the sync that follows the optimizer step,
then generates; a vLLM without sleep mode is refused before any model loads. The weight sync is local: each actor
gathers every tensor from the learner's shards (full_tensor, all ranks together, one layer at a time), casts it to
the engine's dtype and writes it into its own engine.
"""

from __future__ import annotations

import time

from es_ray.grpo.config import GRPOTrainConfig
from es_ray.grpo.learner import GRPOLearner
from es_ray.grpo.rollout import RolloutWorker


class ColocatedWorker(RolloutWorker):
    """A RolloutWorker whose process also holds learner rank ``rank`` of ``world``. The rollout methods keep their
    names; the learner's are exposed under theirs (``learner_probe_logprobs`` for its probe)."""

    def __init__(self, cfg: GRPOTrainConfig, rank: int = 0, world: int = 1):
        check_sleep_mode(cfg)
        if _on_gpu(cfg):
            import os

            from es_ray.engines.vllm import SLEEP_MODE_ENV

            os.environ[SLEEP_MODE_ENV] = "1"  # the engine is built with sleep mode on
        super().__init__(cfg, rank)
        self.learner = GRPOLearner(cfg, rank, world)
        self.asleep = False

    def ready(self) -> dict:
        return {**self.learner.ready(), **super().ready(), "colocated": True}

    # -- the learner rank ------------------------------------------------------------------------------------
    def address(self) -> str:
        return self.learner.address()

    def join(self, address: str) -> dict:
        return {**self.learner.join(address), **super().ready(), "colocated": True}

    def train_step(self, samples: list[dict], advantages: list[float]) -> dict:
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
        """The learner's weights into this actor's engine, one chunk (a layer) at a time in the engine's dtype;
        every rank gathers every chunk (the collectives run in the same order on all ranks)."""
        self._wake()
        t0, nbytes = time.perf_counter(), 0
        for k in range(len(self.learner.chunks)):
            nbytes += self.write_weights(self.learner.weight_chunk(k, dtype, everywhere=True))["bytes"]
        return {"bytes": nbytes, "seconds": time.perf_counter() - t0}

    def _sleep(self) -> None:
        sleep = getattr(getattr(self.engine, "llm", None), "sleep", None)
        if sleep is not None and not self.asleep and _on_gpu(self.cfg):
            sleep(level=1)  # weights to the host, KV cache dropped: both come back at wake_up
            self.asleep = True

    def _wake(self) -> None:
        if self.asleep:
            self.engine.llm.wake_up()
            self.asleep = False


def _on_gpu(cfg: GRPOTrainConfig) -> bool:
    return cfg.cluster.gpus_per_actor > 0 or cfg.engine.device.startswith("cuda")


def check_sleep_mode(cfg: GRPOTrainConfig) -> None:
    """Colocation on GPU needs vLLM's sleep mode (the engine's memory freed while the learner trains); a vLLM build
    without it is refused before any model loads, naming the key."""
    if cfg.engine.name != "vllm" or not _on_gpu(cfg):
        return
    from es_ray.core.config import ConfigError

    try:
        from vllm import LLM
    except ImportError:
        return  # the engine itself refuses a missing vLLM, naming engine.name
    if not (hasattr(LLM, "sleep") and hasattr(LLM, "wake_up")):
        raise ConfigError("grpo.colocate=true on GPU needs vLLM's sleep mode (LLM.sleep / LLM.wake_up), which this "
                          "vLLM build lacks: set grpo.colocate=false, or install the vLLM version scripts/setup.sh "
                          "pins")
