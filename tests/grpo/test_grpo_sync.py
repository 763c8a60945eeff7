"""Weight sync between the GRPO learner and a rollout engine, in-process on the tiny model: the probe agrees after
a sync, a deliberately wrong weight (or a missed sync) is caught, the weights travel layer by layer in the engine's
dtype, and the tolerance is set from the difference measured at the first sync."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from es_ray.grpo.config import to_grpo_config
from es_ray.grpo.driver import SYNC_FLOOR, SYNC_MARGIN, WeightSyncError, check_sync, sync_tolerance


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    from es_ray.grpo.learner import GRPOLearner
    from es_ray.grpo.rollout import RolloutWorker

    cfg = to_grpo_config(
        {
            "model": {"path": str(tiny_model_dir)},
            "engine": {"threads": 1},
            "grpo": {"lr": 1e-2, "micro_batch_size": 3},
            "sampling": {"max_new_tokens": 6},
        }
    )
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
    from es_ray.grpo.rollout import RolloutWorker

    cfg, learner, _ = pair
    vcfg = to_grpo_config(
        {
            "model": {"path": str(tiny_model_dir)},
            "sampling": {"max_new_tokens": 6},
            "engine": {"name": "vllm", "threads": 1, "enforce_eager": True},
        }
    )
    rollout = RolloutWorker(vcfg)
    try:
        out = rollout.generate([0], 2, seed=3)
        assert all(s["completion_ids"] for s in out["samples"])
        weights = learner.weights()  # trained in the test above: differs from the checkpoint vLLM loaded
        rollout.write_weights(weights)
        assert verify(learner, rollout, sync_tolerance(vcfg)) <= sync_tolerance(vcfg)
        name = "model.layers.1.mlp.down_proj.weight"
        weights[name] = weights[name] + 0.05 * torch.randn(
            weights[name].shape, generator=torch.Generator().manual_seed(0)
        )
        rollout.write_weights(weights)
        with pytest.raises(WeightSyncError):  # the engine holds a weight the learner does not
            verify(learner, rollout, sync_tolerance(vcfg))
    finally:
        rollout.engine.close()


def test_tolerance_is_the_floor_or_a_margin_over_the_first_difference_unless_set(pair):
    from dataclasses import replace

    cfg = pair[0]
    assert sync_tolerance(cfg, 1e-6) == SYNC_FLOOR == 2e-3  # fp32 both sides: kernel noise, the floor holds
    assert sync_tolerance(cfg, 0.05) == pytest.approx(SYNC_MARGIN * 0.05)  # e.g. a bf16 engine
    fixed = replace(cfg, grpo=replace(cfg.grpo, sync_tolerance=0.3))
    assert sync_tolerance(fixed, 0.05) == 0.3


def test_weight_chunks_are_layers_in_the_engine_dtype(pair):
    _, learner, _ = pair
    weights = learner.weights()
    chunks = [learner.weight_chunk(k, "bfloat16") for k in range(learner.ready()["weight_chunks"])]
    layers = [c for c in chunks if any(".layers." in n for n in c)]
    assert len(layers) == 2 and all(len({n.split(".")[2] for n in c}) == 1 for c in layers)  # one layer each
    assert all(len(c) == 1 for c in chunks if c not in layers)  # embedding, final norm: one tensor each
    got = {n: t for c in chunks for n, t in c.items()}
    assert got.keys() == weights.keys() and all(t.dtype == torch.bfloat16 for t in got.values())
    assert all(torch.equal(got[n], weights[n].to(torch.bfloat16)) for n in got)


class Handle:
    """``actor.method.remote(...)`` answered at once, in-process."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, method):
        return SimpleNamespace(remote=getattr(self.obj, method))


class Local:
    """An in-process stand-in for a runtime ActorGroup (gather / call / each / send_all with method references, and
    ``actors[r]``), so that GRPOWorkers.sync runs without Ray."""

    def __init__(self, *objs):
        self.objs, self.actors, self.ranks = list(objs), [Handle(o) for o in objs], list(range(len(objs)))

    def gather(self, method, calls, slow=False):
        return {r: getattr(self.objs[r], method.__name__)(*args) for r, args in calls.items()}

    def call(self, rank, method, *args, slow=False):
        return self.gather(method, {rank: args})[rank]

    def each(self, method, *args, slow=False):
        return [self.call(r, method, *args) for r in self.ranks]

    def send_all(self, method, *args):
        return [getattr(h, method.__name__).remote(*args) for h in self.actors]


def test_first_sync_to_a_bf16_engine_sets_the_tolerance_and_sends_bf16_layer_by_layer(pair, tiny_model_dir):
    """An fp32 learner and a bf16 engine: the first sync measures their difference on a completion the engine
    samples, sets the tolerance to max(floor, 4x) it, sends half the fp32 bytes; a later sync verifies within it,
    and a wrong tensor is still caught."""
    from es_ray.grpo.driver import GRPOWorkers
    from es_ray.grpo.learner import GRPOLearner
    from es_ray.grpo.rollout import RolloutWorker

    cfg, learner, _ = pair
    bf16 = RolloutWorker(
        to_grpo_config(
            {
                "model": {"path": str(tiny_model_dir)},
                "sampling": {"max_new_tokens": 6},
                "engine": {"threads": 1, "dtype": "bfloat16"},
            }
        )
    )
    workers = GRPOWorkers.__new__(GRPOWorkers)
    workers.cfg, workers.tol, workers.probe = cfg, sync_tolerance(cfg), None
    workers.colocated, workers.learner_probe = False, GRPOLearner.probe_logprobs
    workers.learner, workers.learner_info = Local(learner), learner.ready()
    workers.rollouts, workers.infos = Local(bf16), [bf16.ready()]
    first = workers.sync(-1)
    assert workers.probe[1] and first["sync/max_logprob_diff"] > 0  # bf16 rounding, measured
    assert first["sync/tolerance"] == workers.tol == max(SYNC_FLOOR, SYNC_MARGIN * first["sync/max_logprob_diff"])
    fp32_bytes = sum(t.numel() * 4 for t in learner.weights().values())
    assert first["sync/bytes"] == fp32_bytes // 2 and first["timing_s/sync_write"] > 0
    out = bf16.generate([0, 1], 2, seed=2)
    learner.train_step(out["samples"], [1.0, -1.0, 0.5, -0.5])
    assert workers.sync(0)["sync/max_logprob_diff"] <= workers.tol
    name = "model.layers.1.mlp.down_proj.weight"
    # 0.5, not 0.05: on the tiny random model a 0.05 error moved the probe's log-probs by 0.005, under the bf16
    # tolerance (~0.008), so it was caught only after some training draws; 0.5 moves them by ~0.07
    wrong = learner.weights()[name] + 0.5 * torch.randn(
        learner.named[name].shape, generator=torch.Generator().manual_seed(0)
    )
    bf16.write_weights({name: wrong})
    with pytest.raises(WeightSyncError, match="rollout engine 0"):
        check_sync(learner.probe_logprobs(*workers.probe), [bf16.probe_logprobs(*workers.probe)], workers.tol, 1)
    workers._resync(workers.rollouts, 0)  # a replacement's restore: every chunk again, verified
