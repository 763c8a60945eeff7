"""The sharded GRPO learner (grpo.fsdp_size=2: two Ray actors, gloo, FSDP2 fully_shard) against the one-process
learner on the tiny model: the same weights, gradient norm, loss and probe log-probs after the same steps, for a
per-sequence and a token-mean loss (normalised over the whole batch, not per rank); a sharded checkpoint resumes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from es_ray.grpo.config import to_grpo_config
from es_ray.grpo.learner import GRPOLearner

TOL = 2e-5
"""fp32: the ranks sum the same per-token terms in another order (each rank its share, then the reduce-scatter)."""


def batch(n=4, length=6):
    g = torch.Generator().manual_seed(1)
    samples = [
        {
            "prompt_ids": [1, 2, 3, 4 + i % 2],
            "completion_ids": torch.randint(10, 1000, (length - i % 3,), generator=g).tolist(),
        }
        for i in range(n)
    ]
    return samples, [1.0, -1.0, 0.5, -0.5][:n]


def config(model_dir, fsdp_size=1, **grpo):
    return to_grpo_config(
        {
            "model": {"path": str(model_dir)},
            "engine": {"threads": 1},
            "grpo": {
                "lr": 1e-2,
                "micro_batch_size": 2,
                "prompts_per_step": 2,
                "group_size": 2,
                "fsdp_size": fsdp_size,
                **grpo,
            },
        }
    )


def start_ranks(ray, cfg, world=2):
    actors = [ray.remote(GRPOLearner).options(num_cpus=0).remote(cfg, rank, world) for rank in range(world)]
    address = ray.get(actors[0].address.remote())
    infos = ray.get([a.join.remote(address) for a in actors])
    assert [i["rank"] for i in infos] == list(range(world)) and infos[0]["trainable"] > 0
    return actors


def each(ray, actors, method, *args):
    return ray.get([getattr(a, method).remote(*args) for a in actors])


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_two_ranks_equal_one_process(tiny_model_dir, ray_local, loss_type):
    samples, adv = batch()
    one = GRPOLearner(config(tiny_model_dir, loss_type=loss_type))
    actors = start_ranks(ray_local, config(tiny_model_dir, 2, loss_type=loss_type))
    try:
        for _ in range(2):
            a = one.train_step(samples, adv)
            b = each(ray_local, actors, "train_step", samples, adv)
            assert b[0]["grpo/loss"] == b[1]["grpo/loss"]  # every rank reports the reduced statistics
            for key in ("grpo/loss", "grpo/grad_norm", "grpo/entropy", "grpo/ratio_mean"):
                assert b[0][key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
            assert b[0]["tokens_backpropagated"] == a["tokens_backpropagated"]
        w1, w2 = one.weights(), each(ray_local, actors, "weights")[0]
        assert set(w1) == set(w2)
        worst = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
        assert worst < TOL, worst
        fresh = GRPOLearner(config(tiny_model_dir)).weights()
        moved = max(float((w1[k] - fresh[k]).abs().max()) for k in ["model.norm.weight"])
        assert moved > 100 * TOL  # the steps moved the weights far more than the tolerance
        probe = (samples[0]["prompt_ids"], samples[0]["completion_ids"])
        lp1, lp2 = one.probe_logprobs(*probe), each(ray_local, actors, "probe_logprobs", *probe)[0]
        assert max(abs(x - y) for x, y in zip(lp1, lp2)) < 1e-4
        chunk = each(ray_local, actors, "weight_chunk", 1, "bfloat16")
        assert chunk[1] == {} and all(t.dtype == torch.bfloat16 for t in chunk[0].values())
        assert torch.equal(
            chunk[0]["model.layers.0.mlp.up_proj.weight"], w2["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16)
        )
    finally:
        for a in actors:
            ray_local.kill(a)


def test_sharded_checkpoint_resumes_exactly(tiny_model_dir, ray_local, tmp_path):
    samples, adv = batch()
    cfg = config(tiny_model_dir, 2)
    actors = start_ranks(ray_local, cfg)
    try:
        each(ray_local, actors, "train_step", samples, adv)
        each(ray_local, actors, "save", str(tmp_path / "step_1"), {"step": 1})
        after = each(ray_local, actors, "train_step", samples, adv)[0]
        weights = each(ray_local, actors, "weights")[0]
    finally:
        for a in actors:
            ray_local.kill(a)
    actors = start_ranks(ray_local, cfg)
    try:
        manifest = __import__("json").loads((tmp_path / "step_1" / "manifest.json").read_text())["files"]
        assert any(f.startswith("shards/") for f in manifest)  # each rank's shards, under the manifest's digests
        meta = each(ray_local, actors, "load", str(tmp_path / "step_1"))[0]
        assert meta["step"] == 1 and meta["fsdp_size"] == 2
        again = each(ray_local, actors, "train_step", samples, adv)[0]
        resumed = each(ray_local, actors, "weights")[0]
        assert again["grpo/loss"] == after["grpo/loss"]
        assert all(torch.equal(weights[k], resumed[k]) for k in weights)
    finally:
        for a in actors:
            ray_local.kill(a)
    from es_ray.core.config import ConfigError

    with pytest.raises(ConfigError, match="grpo.fsdp_size=2"):
        GRPOLearner(config(tiny_model_dir)).load(str(tmp_path / "step_1"))


def run_cfg(model_dir, run_dir, **grpo):
    """A two-step GRPO run on the tiny model (one rollout actor, fp32 engine); ``grpo`` overrides its section."""
    return to_grpo_config(
        {
            "model": {"path": str(model_dir)},
            "task": {"name": "arithmetic", "train_size": 4},
            "grpo": {"steps": 2, "lr": 1e-3, "group_size": 2, "prompts_per_step": 2, "micro_batch_size": 4, **grpo},
            "sampling": {"max_new_tokens": 4, "temperature": 1.0},
            "engine": {"threads": 1, "dtype": "float32"},
            "cluster": {"num_actors": 1, "cpus_per_actor": 0.5},
            "eval": {"every": 0},
            "run": {"dir": str(run_dir), "progress": False, "trackers": []},
        }
    )


@pytest.fixture(scope="module")
def separate_run(tiny_model_dir, ray_local, tmp_path_factory) -> dict:
    """The reference both variants below are held against: one learner rank and one rollout actor, each its own
    actor (grpo.fsdp_size=1, grpo.colocate=false, the defaults). Run once for the module; the tests only read it."""
    from es_ray.grpo.driver import run

    return run(run_cfg(tiny_model_dir, tmp_path_factory.mktemp("grpo-fsdp") / "separate"))


def test_grpo_run_with_two_learner_ranks_ends_where_one_rank_does(tiny_model_dir, ray_local, tmp_path, separate_run):
    """The whole loop (rollouts, sharded learner, sync layer by layer from the shards, the probe, the final
    checkpoint): two steps with grpo.fsdp_size=2 against grpo.fsdp_size=1, the same seeds."""
    from es_ray.models import load_hf_weights
    from es_ray.grpo.driver import run

    one, two = separate_run, run(run_cfg(tiny_model_dir, tmp_path / "two", fsdp_size=2))
    assert one["reward_mean"] == two["reward_mean"]  # the same samples: the weights agreed at every sync
    w1, w2 = load_hf_weights(one["final_checkpoint"]), load_hf_weights(two["final_checkpoint"])
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < TOL
    metrics = [__import__("json").loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["sync/max_logprob_diff"] < 1e-4 and m["sync/bytes"] > 0 for m in metrics)


def test_colocated_run_ends_where_the_separate_one_does(tiny_model_dir, ray_local, tmp_path, separate_run):
    """grpo.colocate=true: one actor holds the learner and the rollout engine; the same steps give the same weights
    (fp32), and the ledger counts one actor's devices instead of two."""
    from es_ray.models import load_hf_weights
    from es_ray.grpo.driver import run

    apart, together = separate_run, run(run_cfg(tiny_model_dir, tmp_path / "together", colocate=True))
    assert apart["reward_mean"] == together["reward_mean"]
    w1, w2 = load_hf_weights(apart["final_checkpoint"]), load_hf_weights(together["final_checkpoint"])
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < TOL
    ledgers = [
        __import__("json").loads((Path(d) / "ledger.json").read_text())
        for d in (apart["run_dir"], tmp_path / "together")
    ]
    roles = [sorted(a["role"] for a in led["actors"].values()) for led in ledgers]
    assert roles == [["learner", "rollout"], ["learner+rollout"]]


def test_colocation_needs_one_engine_per_learner_rank():
    from es_ray.core.config import ConfigError

    with pytest.raises(ConfigError, match="cluster.num_actors=2"):
        to_grpo_config({"grpo": {"colocate": True, "fsdp_size": 2}, "cluster": {"num_actors": 1}})


def test_es_compare_colocates_grpo_when_the_cluster_has_no_spare_device():
    from es_ray.launch.compare.methods import grpo_placement, grpo_placement_text
    from es_ray.launch.compare.run import CompareConfig, stage_plan
    from pathlib import Path

    cfg = CompareConfig()  # 2 devices: 1 learner rank + 1 rollout actor fit apart
    assert grpo_placement(cfg) == (False, 1) and "separate devices" in grpo_placement_text(cfg)
    cfg.cluster.num_actors = 1  # one device: the learner and the engine share it
    assert grpo_placement(cfg) == (True, 1) and "colocated" in grpo_placement_text(cfg)
    grpo_stage = [s for s in stage_plan(cfg, "grpo", Path("/tmp/x"), pool=16) if s.kind == "train_grpo"][0]
    stage = grpo_stage.config()
    assert stage.grpo.colocate and stage.cluster.num_actors == stage.grpo.fsdp_size == 1


def test_offloaded_learners_take_the_same_steps(tiny_model_dir, ray_local):
    """grpo.offload=optimizer (AdamW on fp32 host copies) in-process, and grpo.offload=all (FSDP2's
    CPUOffloadPolicy over one rank, through join) against no offload."""
    samples, adv = batch()
    plain, host = GRPOLearner(config(tiny_model_dir)), GRPOLearner(config(tiny_model_dir, offload="optimizer"))
    assert host.host_params is not None
    for _ in range(2):
        a, b = plain.train_step(samples, adv), host.train_step(samples, adv)
        assert a["grpo/grad_norm"] == pytest.approx(b["grpo/grad_norm"], rel=1e-6)
    w1, w2 = plain.weights(), host.weights()
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-6
    actors = start_ranks(ray_local, config(tiny_model_dir, offload="all"), world=1)
    try:
        for _ in range(2):
            each(ray_local, actors, "train_step", samples, adv)
        w3 = each(ray_local, actors, "weights")[0]
        assert max(float((w1[k] - w3[k]).abs().max()) for k in w1) < TOL
    finally:
        ray_local.kill(actors[0])


def test_more_learner_ranks_than_devices_are_refused_naming_the_key(tiny_model_dir, ray_local, tmp_path):
    from es_ray.core.config import ConfigError
    from es_ray.grpo.driver import run

    cfg = to_grpo_config(
        {
            "model": {"path": str(tiny_model_dir)},
            "grpo": {"fsdp_size": 2},
            "cluster": {"num_actors": 1, "gpus_per_actor": 1},
            "run": {"dir": str(tmp_path / "run"), "progress": False, "trackers": []},
        }
    )
    with pytest.raises(ConfigError, match=r"grpo.fsdp_size=2 learner ranks x 1 GPUs each exceed the cluster's 0"):
        run(cfg)
