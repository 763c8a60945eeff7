"""The trainers' held-out curve, scored the same way for ES and GRPO (``eval.every``): on the current weights,

* ``eval/reward``: mean reward of greedy completions (comparable across methods and with earlier runs);
* ``eval/pass_at_1``: share of held-out problems a completion sampled at ``eval.temperature`` / ``eval.top_p``
  solves (pass@1; no "@" in the name because MLflow refuses it, and every tracker gets the same names);
* ``eval/entropy``: mean token entropy of that sampled distribution (its top_p nucleus renormalised when
  top_p < 1; teacher-forced; None where the engine cannot score entropy, e.g. vLLM, rather than a second model copy
  inside a training actor).

An empty held-out set scores None ("none"), never 0. The curve starts at the base weights: the trainers score
them before the first step and write ``held_out_base.json`` (``write_base_point``).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np

from es_ray.core.config import HeldOutConfig, SamplingConfig
from es_ray.tasks.base import score

BASE_POINT = "held_out_base.json"


def held_out_seed(run_seed: int) -> int:
    """The held-out scoring's sampling seed, the same for ES and GRPO: at the base weights both curves start from
    the same completions."""
    return random.Random(f"{run_seed}/held-out").getrandbits(62)


def held_out_scores(
    engine, task, prompts: list[str], problems: list, cfg: HeldOutConfig, max_new_tokens: int, seed: int
) -> dict:
    if not problems:
        return {"reward": None, "pass_at_1": None, "entropy": None, "tokens": 0, "errors": 0, "seconds": 0.0}
    t0 = time.perf_counter()
    max_new_tokens = cfg.max_new_tokens or max_new_tokens
    greedy = engine.generate(prompts, SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0), seed)
    rewards, errors = score(task, [c.text for c in greedy], problems)
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p)
    sampled = engine.generate(prompts, sampling, seed + 1)
    grades = task.grade_batch([c.text for c in sampled], problems)
    seconds = time.perf_counter() - t0
    entropy = None
    if engine.can_score_entropy:
        tok = engine.tokenizer
        pairs = [(tok(p, add_special_tokens=False)["input_ids"], list(c.token_ids)) for p, c in zip(prompts, sampled)]
        # the distribution sampled: the top_p nucleus renormalised (the last column) when top_p < 1
        h = [
            np.asarray(x, dtype=np.float64).reshape(len(x), -1)[:, -1]
            for x in engine.entropies_batch(pairs, (cfg.temperature,), top_p=cfg.top_p)
        ]
        tokens = sum(x.size for x in h)
        entropy = float(sum(x.sum() for x in h) / tokens) if tokens else None
    n = len(problems)
    return {
        "reward": sum(rewards) / n,
        "pass_at_1": sum(g.correct for g in grades) / n,
        "entropy": entropy,
        "tokens": sum(c.num_tokens for c in greedy) + sum(c.num_tokens for c in sampled),
        "errors": errors + sum(g.failure is not None for g in grades),
        "seconds": seconds,
    }


def write_base_point(run_dir: str | Path, res: dict, ledger) -> None:
    """The held-out scores of the weights before the first step (the curve's first point); its tokens are counted
    with the held-out scoring's, apart from training."""
    ledger.tokens_generated_eval += int(res["tokens"])
    (Path(run_dir) / BASE_POINT).write_text(
        json.dumps({k: res[k] for k in ("reward", "pass_at_1", "entropy", "tokens", "errors", "seconds")}, indent=2)
    )
