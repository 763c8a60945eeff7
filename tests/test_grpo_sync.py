"""Weight sync between the GRPO learner and a rollout engine, in-process on the tiny model: the probe agrees after
a sync, and a deliberately wrong weight (or a missed sync) is caught."""

from __future__ import annotations

import pytest
import torch

from grpo.config import to_grpo_config
from grpo.driver import WeightSyncError, check_sync, sync_tolerance


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    from grpo.learner import GRPOLearner
    from grpo.rollout import RolloutWorker

    cfg = to_grpo_config({"model": {"path": str(tiny_model_dir)}, "engine": {"threads": 1},
                          "grpo": {"lr": 1e-2, "micro_batch_size": 3}, "sampling": {"max_new_tokens": 6}})
    return cfg, GRPOLearner(cfg), RolloutWorker(cfg)


def verify(learner, rollout, tol, step=0):
    probe = rollout.probe()
    return check_sync(learner.probe_logprobs(*probe), [rollout.probe_logprobs(*probe)], tol, step)


def test_sync_after_a_training_step_verifies_and_a_missed_sync_is_caught(pair):
    cfg, learner, rollout = pair
    tol = sync_tolerance(cfg)
    assert tol == 2e-3  # both sides fp32 on CPU
    rollout.write_weights(learner.weights())
    assert verify(learner, rollout, tol) <= tol
    out = rollout.generate([0, 1], 3, seed=1)
    adv = [1.0, -1.0, 0.5, -0.5, 0.0, 0.0]
    stats = learner.train_step(out["samples"], adv)
    assert stats["grpo/grad_norm"] > 0 and stats["tokens_backpropagated"] > 0
    with pytest.raises(WeightSyncError, match="rollout engine 0"):  # the engine still has the old weights
        verify(learner, rollout, tol, step=1)
    rollout.write_weights(learner.weights())
    assert verify(learner, rollout, tol, step=1) <= tol


def test_a_wrong_weight_in_the_engine_is_caught(pair):
    cfg, learner, rollout = pair
    weights = learner.weights()
    name = "model.layers.1.mlp.down_proj.weight"
    wrong = dict(weights)
    wrong[name] = weights[name] + 0.05 * torch.randn(weights[name].shape, generator=torch.Generator().manual_seed(0))
    rollout.write_weights(wrong)
    with pytest.raises(WeightSyncError, match="tolerance"):
        verify(learner, rollout, sync_tolerance(cfg), step=3)
    rollout.write_weights(weights)
    assert verify(learner, rollout, sync_tolerance(cfg)) <= sync_tolerance(cfg)


def test_probe_length_mismatch_is_a_failed_sync():
    with pytest.raises(WeightSyncError):
        check_sync([0.0, -1.0], [[0.0]], 1.0, 0)


def test_vllm_engine_takes_the_learner_weights_and_verifies(pair, tiny_model_dir):
    pytest.importorskip("vllm")
    from grpo.rollout import RolloutWorker

    cfg, learner, _ = pair
    vcfg = to_grpo_config({"model": {"path": str(tiny_model_dir)}, "sampling": {"max_new_tokens": 6},
                           "engine": {"name": "vllm", "threads": 1, "enforce_eager": True}})
    rollout = RolloutWorker(vcfg)
    try:
        out = rollout.generate([0], 2, seed=3)
        assert all(s["completion_ids"] for s in out["samples"])
        weights = learner.weights()  # trained in the test above: differs from the checkpoint vLLM loaded
        rollout.write_weights(weights)
        assert verify(learner, rollout, sync_tolerance(vcfg)) <= sync_tolerance(vcfg)
        name = "model.layers.1.mlp.down_proj.weight"
        weights[name] = weights[name] + 0.05 * torch.randn(weights[name].shape,
                                                           generator=torch.Generator().manual_seed(0))
        rollout.write_weights(weights)
        with pytest.raises(WeightSyncError):  # the engine holds a weight the learner does not
            verify(learner, rollout, sync_tolerance(vcfg))
    finally:
        rollout.engine.close()
