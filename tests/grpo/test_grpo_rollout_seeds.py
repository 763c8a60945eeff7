"""GRPO's samples do not depend on how many rollout actors draw them: each completion is sampled with its own seed
from (step seed, prompt index, sample index), on the transformers engine (a per-row generator) and on vLLM (a
per-request seed)."""

from __future__ import annotations

import pytest

from es_ray.grpo.config import to_grpo_config


def _worker(tiny_model_dir, engine: dict):
    from es_ray.grpo.rollout import RolloutWorker

    cfg = to_grpo_config(
        {
            "model": {"path": str(tiny_model_dir)},
            "engine": {"threads": 1, **engine},
            "sampling": {"max_new_tokens": 8, "temperature": 1.0},
        }
    )
    return RolloutWorker(cfg)


def _completions(out: dict) -> list[tuple[int, list[int]]]:
    return [(s["prompt_index"], s["completion_ids"]) for s in out["samples"]]


def _one_and_two_actors(worker, seed: int):
    """The step's samples as one actor draws them, and as two actors each drawing half the prompts."""
    ids = [0, 1, 2, 3]
    one = _completions(worker.generate(ids, 3, seed))
    two = _completions(worker.generate(ids[:2], 3, seed)) + _completions(worker.generate(ids[2:], 3, seed))
    return one, two


@pytest.mark.parametrize("batch_size", [64, 5])
def test_hf_samples_are_the_same_for_one_and_two_rollout_actors(tiny_model_dir, batch_size):
    worker = _worker(tiny_model_dir, {"batch_size": batch_size})
    one, two = _one_and_two_actors(worker, seed=11)
    assert one == two
    groups = [tuple(c) for _, c in one[:3]]
    assert len(set(groups)) > 1, "the samples of one prompt must differ from each other"
    other, _ = _one_and_two_actors(worker, seed=12)
    assert other != one, "another step's seed must give other samples"


@pytest.mark.slow
def test_vllm_samples_are_the_same_for_one_and_two_rollout_actors(tiny_model_dir):
    pytest.importorskip("vllm")
    worker = _worker(tiny_model_dir, {"name": "vllm", "enforce_eager": True})
    one, two = _one_and_two_actors(worker, seed=11)
    assert one == two
    assert len({tuple(c) for _, c in one[:3]}) > 1


def test_completion_seeds_depend_on_step_prompt_and_sample_only():
    from es_ray.grpo.rollout import completion_seed

    seeds = {completion_seed(s, i, j) for s in (1, 2) for i in range(5) for j in range(4)}
    assert len(seeds) == 40 and all(0 <= x < 1 << 62 for x in seeds)
    assert completion_seed(1, 3, 2) == completion_seed(1, 3, 2)


def test_the_driver_gives_every_rollout_actor_the_step_seed():
    from es_ray.grpo.driver import sample_seed

    cfg = to_grpo_config({"run": {"seed": 5}})
    assert sample_seed(cfg, 3) == sample_seed(cfg, 3) != sample_seed(cfg, 4)
