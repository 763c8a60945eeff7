"""The GRPO rollout Ray actor: one es_ray engine (transformers or vLLM) and the task, as an ES actor holds.

It samples groups of completions from the current policy and scores them with the task's reward, takes the
learner's weights through the engine interface (``Engine.write_weights``, one chunk at a time, already in the
engine's dtype), and reports the engine's own log-probabilities of a probe sequence at the sampling temperature so
the driver can verify a sync.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from typing import TypedDict

from es_ray.core.dtypes import dtype_name
from es_ray.held_out import held_out_scores
from es_ray.models import resolve_model
from es_ray.runtime.actors import Actor, actor_threads
from es_ray.tasks import load_task
from es_ray.tasks.base import score, templated_prompts
from es_ray.grpo.config import GRPOTrainConfig

# The engine (torch) is imported inside the actor: the driver imports RolloutWorker without torch.

PROBE_TOKENS = 32
"""Longest sync probe completion (vLLM returns the whole vocabulary's log-probs per position at T != 1)."""
PROBE_SEED = 0


class Sample(TypedDict):
    """One sampled completion, as ``RolloutWorker.generate`` returns it and the learner trains on it."""

    prompt_index: int
    """Index of its prompt in the task's training split."""
    prompt_ids: list[int]
    """The templated prompt's token ids."""
    completion_ids: list[int]
    """The completion's token ids (the positions the loss scores)."""
    reward: float
    """The task's reward of the completion (0 where the reward raised)."""


def completion_seed(step_seed: int, prompt_index: int, sample_index: int) -> int:
    """The sampling seed of completion ``sample_index`` of training prompt ``prompt_index`` in the step whose seed
    is ``step_seed`` (itself from the run seed and the step): a hash, as ES's noise seeds are."""
    digest = hashlib.blake2b(f"{step_seed}/{prompt_index}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


class RolloutWorker(Actor):
    """Plain class; the driver wraps it with ``ray.remote``. Tests also use it in-process."""

    def __init__(self, cfg: GRPOTrainConfig, rank: int = 0):
        super().__init__(rank, actor_threads(cfg.engine, cfg.cluster))
        from es_ray.engines.base import make_engine

        self.cfg = cfg
        self.engine = make_engine(str(resolve_model(cfg.model.path)), cfg.engine)
        self.task = load_task(cfg.task)
        self._prompts = templated_prompts(self.engine, self.task)

    def ready(self) -> dict:
        return {
            **super().ready(),
            "train_size": len(self.task.train),
            "eval_size": len(self.task.eval),
            "dtype": dtype_name(self.engine.dtype),
            "skipped_lines": self.task.skipped_lines(),
        }

    def _tokens(self, text: str) -> list[int]:
        return list(self.engine.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _ids(self, completion) -> list[int]:
        """The sampled ids (both engines return them); re-tokenising the text is the fallback."""
        return list(completion.token_ids) if completion.token_ids else self._tokens(completion.text)

    def generate(self, prompt_indices: list[int], group_size: int, seed: int) -> dict:
        """group_size completions of each training prompt -> per completion its prompt index, prompt and completion
        token ids, and reward (a reward that raises scores 0, counted). Completion j of prompt i is sampled with
        its own seed from (the step's ``seed``, i, j) (``completion_seed``), so it is the same however the step's
        prompts are split over rollout actors."""
        problems = [self.task.train[i] for i in prompt_indices for _ in range(group_size)]
        index = [i for i in prompt_indices for _ in range(group_size)]
        prompts = [self._prompts["train"][i] for i in index]
        seeds = [completion_seed(seed, i, j) for i in prompt_indices for j in range(group_size)]
        t0 = time.perf_counter()
        completions = self.engine.generate(prompts, self.cfg.sampling, seeds)
        t1 = time.perf_counter()
        prompt_ids = {i: self._tokens(self._prompts["train"][i]) for i in set(index)}
        rewards, errors = score(self.task, [c.text for c in completions], problems)
        samples: list[Sample] = []
        for i, c, reward in zip(index, completions, rewards):
            samples.append(
                {"prompt_index": i, "prompt_ids": prompt_ids[i], "completion_ids": self._ids(c), "reward": reward}
            )
        return {
            "samples": samples,
            "reward_errors": errors,
            "generate_s": t1 - t0,
            "reward_s": time.perf_counter() - t1,
            "tokens": sum(c.num_tokens for c in completions),
        }

    def evaluate(self, split: str, seed: int) -> dict:
        """The current weights on a whole split (the held-out curve, scored as ES scores it: es_ray.held_out)."""
        problems = self.task.eval if split == "eval" else self.task.train
        return held_out_scores(
            self.engine,
            self.task,
            self._prompts[split],
            problems,
            self.cfg.eval,
            self.cfg.sampling.max_new_tokens,
            seed,
        )

    def write_weights(self, weights: dict) -> dict:
        """Copy (HF name -> tensor) weights, the whole model or one chunk of it, into the engine; returns the bytes
        received and the seconds the write took."""
        t0 = time.perf_counter()
        self.engine.write_weights(weights.items())
        return {
            "bytes": sum(t.numel() * t.element_size() for t in weights.values()),
            "seconds": time.perf_counter() - t0,
        }

    def probe_logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        return self.engine.token_logprobs(prompt_ids, completion_ids, self.cfg.sampling.temperature)

    def probe(self) -> tuple[list[int], list[int]]:
        """The sync probe: the first training prompt and a completion this engine samples for it (at the sampling
        temperature, a fixed seed, up to PROBE_TOKENS tokens). Sampled rather than greedy or fixed text: its tokens
        have the probabilities the policy's own samples have, where a wrong weight shows, not only near-certain
        ones whose log-probs sit at ~0 whatever the weights."""
        sampling = replace(self.cfg.sampling, max_new_tokens=min(PROBE_TOKENS, self.cfg.sampling.max_new_tokens))
        c = self.engine.generate([self._prompts["train"][0]], sampling, PROBE_SEED)[0]
        return self._tokens(self._prompts["train"][0]), self._ids(c)
