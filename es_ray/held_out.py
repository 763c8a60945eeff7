"""The trainers' held-out curve, scored the same way for ES and GRPO (``eval.every``): on the current weights,

* ``eval/reward``: mean reward of greedy completions (comparable across methods and with earlier runs);
* ``eval/pass_at_1``: share of held-out problems a completion sampled at ``eval.temperature`` solves (pass@1;
  no "@" in the name because MLflow refuses it, and every tracker gets the same names);
* ``eval/entropy``: mean token entropy of that sampled distribution (teacher-forced; None where the engine cannot
  score entropy, e.g. vLLM, rather than a second model copy inside a training actor).
"""

from __future__ import annotations

import time

import numpy as np

from es_ray.core.config import HeldOutConfig, SamplingConfig
from es_ray.tasks.base import score


def held_out_scores(engine, task, prompts: list[str], problems: list, cfg: HeldOutConfig, max_new_tokens: int,
                    seed: int) -> dict:
    t0 = time.perf_counter()
    greedy = engine.generate(prompts, SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0), seed)
    rewards, errors = score(task, [c.text for c in greedy], problems)
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=cfg.temperature, top_p=1.0)
    sampled = engine.generate(prompts, sampling, seed + 1)
    grades = task.grade_batch([c.text for c in sampled], problems)
    seconds = time.perf_counter() - t0
    entropy = None
    if engine.can_score_entropy:
        tok = engine.tokenizer
        pairs = [(tok(p, add_special_tokens=False)["input_ids"], list(c.token_ids)) for p, c in zip(prompts, sampled)]
        h = [np.asarray(x, dtype=np.float64).reshape(-1) for x in engine.entropies_batch(pairs, (cfg.temperature,))]
        tokens = sum(x.size for x in h)
        entropy = float(sum(x.sum() for x in h) / tokens) if tokens else None
    n = max(1, len(problems))
    return {"reward": sum(rewards) / n, "pass_at_1": sum(g.correct for g in grades) / n, "entropy": entropy,
            "tokens": sum(c.num_tokens for c in greedy) + sum(c.num_tokens for c in sampled),
            "errors": errors + sum(g.failure is not None for g in grades), "seconds": seconds}
