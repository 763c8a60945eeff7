"""GRPO on a local Ray with the tiny model: the reward rises on a reward a tiny model can move; a stopped run
resumes to bit-identical final weights; a dead rollout actor is replaced and re-synced; a dead learner stops the
run with a message saying how to resume (with faults.max_replacements=0; otherwise the run restarts from the last
checkpoint and ends as an undisturbed one); 1 and 2 rollout actors draw the same first step."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import grpo_tiny_cfg as tiny_cfg

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def peaked_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with its (tied) embedding scaled up: its next-token distribution is peaked on a few tokens
    per context instead of uniform over 49k, so a reward over the text is a small bandit GRPO can solve; with the
    uniform distribution no token is sampled twice and nothing generalises from one token to another."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(EMBED_SCALE)
    out = tmp_path_factory.mktemp("peaked-llama")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


EMBED_SCALE = 10.0


def rewards(run_dir):
    return [json.loads(x)["reward/mean"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_mean_reward_rises(ray_local, peaked_model_dir, tmp_path):
    from es_ray.grpo.driver import run

    run(tiny_cfg(peaked_model_dir, tmp_path, steps=10, lr=3e-3, eval_every=5))
    r = rewards(tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "eval/reward" in row] == [0, 4, 9]
    held = [row for row in rows if "eval/reward" in row]  # scored as ES scores it: greedy reward, sampled pass@1
    assert all(0 <= r["eval/pass_at_1"] <= 1 and r["eval/entropy"] > 0 and r["eval/tokens"] > 0 for r in held)
    first, last = np.mean(r[:3]), np.mean(r[-3:])
    assert last > first + 0.2, r
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert ledger["tokens_generated"] > 0 and ledger["tokens_backpropagated"] > ledger["tokens_generated"]
    assert set(ledger["actors"]) == {"learner_0", "rollout_0"}
    assert all(m["peak_rss_bytes"] > 1 << 20 for m in ledger["actors"].values())
    assert ledger["phase_seconds"]["train"] > 0 and ledger["phase_seconds"]["sync"] > 0


class Stop(Exception):
    pass


def test_dead_rollout_is_replaced_and_a_stopped_run_resumes_bit_identical(
    ray_local, peaked_model_dir, tmp_path, monkeypatch
):
    import ray
    from safetensors.torch import load_file

    import es_ray.grpo.driver as driver

    full, cut = tmp_path / "full", tmp_path / "cut"
    driver.run(tiny_cfg(peaked_model_dir, full, steps=3, run={"checkpoint_every": 2}))
    real_step = driver.step

    def faulty_step(cfg, workers, t, pool, guard):
        if t == 1:
            ray.kill(workers.rollouts[0])  # dies before generating: replaced, re-synced, asked again
        if t == 2:
            raise Stop  # after the step-2 checkpoint
        return real_step(cfg, workers, t, pool, guard)

    monkeypatch.setattr(driver, "step", faulty_step)
    with pytest.raises(Stop):
        driver.run(tiny_cfg(peaked_model_dir, cut, steps=3, run={"checkpoint_every": 2}))
    assert rewards(cut) == rewards(full)[:2]  # the replacement generated what the original would have
    ledger = json.loads((cut / "ledger.json").read_text())
    assert ledger["replacements"] == 1 and ledger["finished"] is False
    monkeypatch.setattr(driver, "step", real_step)
    summary = driver.run(tiny_cfg(peaked_model_dir, cut, steps=3, run={"checkpoint_every": 2, "resume": True}))
    assert summary["resumed_from"].endswith("step_000002")
    assert rewards(cut) == rewards(full)
    a = load_file(full / "checkpoints/final/model.safetensors")
    b = load_file(cut / "checkpoints/final/model.safetensors")
    assert a.keys() == b.keys() and all(torch_equal(a[k], b[k]) for k in a)


def torch_equal(x, y) -> bool:
    import torch

    return bool(torch.equal(x, y))


def test_dead_learner_stops_the_run_with_resume_advice(ray_local, peaked_model_dir, tmp_path, monkeypatch):
    import ray

    import es_ray.grpo.driver as driver
    from es_ray.runtime.actors import ActorLostError

    real_step = driver.step

    def kill_learner(cfg, workers, t, pool, guard):
        ray.kill(workers.learner[0])
        return real_step(cfg, workers, t, pool, guard)

    monkeypatch.setattr(driver, "step", kill_learner)
    cfg = tiny_cfg(peaked_model_dir, tmp_path, steps=2)
    cfg.faults.max_replacements = 0  # no restart allowed: the run stops (with more, it restarts; the test below)
    with pytest.raises(ActorLostError, match="learner actor 0 was lost.*run.resume=true"):
        driver.run(cfg)
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert ledger["finished"] is False and ledger["actors"]["learner_0"].get("unanswered")


@pytest.mark.slow  # three 3-step runs: ~130 s on a shared 2-core machine
def test_a_lost_learner_restarts_from_the_last_checkpoint_and_ends_as_an_undisturbed_run(
    ray_local, peaked_model_dir, tmp_path, monkeypatch, capsys
):
    """Deliverable 52.1 for GRPO: the learner killed mid-run (its worker process gone, as Ray's memory monitor or a
    crash leaves it) restarts GRPOWorkers in the same call from the last checkpoint, or from step 0 without one, and
    the run ends with the undisturbed run's rewards and final weights, bit for bit."""
    import ray
    from safetensors.torch import load_file

    import es_ray.grpo.driver as driver

    full, ckpt, scratch = tmp_path / "full", tmp_path / "ckpt", tmp_path / "scratch"
    driver.run(tiny_cfg(peaked_model_dir, full, steps=3))
    real_step = driver.step

    def kill_learner_once_at(k):
        killed = []

        def faulty_step(cfg, workers, t, pool, guard):
            if t == k and not killed:
                killed.append(t)
                ray.kill(workers.learner[0])  # a worker gone: the step's learner call finds it lost
            return real_step(cfg, workers, t, pool, guard)

        return faulty_step

    monkeypatch.setattr(driver, "step", kill_learner_once_at(2))
    capsys.readouterr()
    summary = driver.run(tiny_cfg(peaked_model_dir, ckpt, steps=3, run={"checkpoint_every": 1}))
    out = capsys.readouterr().out
    assert "grpo: learner lost after 2 step(s)" in out and "restart 1 of at most faults.max_replacements=8" in out
    assert "step_000002 (step 2)" in out, out
    assert summary["resumed_from"].endswith("step_000002")

    monkeypatch.setattr(driver, "step", kill_learner_once_at(1))
    driver.run(tiny_cfg(peaked_model_dir, scratch, steps=3))  # run.checkpoint_every=0: nothing saved yet
    out = capsys.readouterr().out
    assert "the initial weights (step 0; no checkpoint yet" in out, out

    a = load_file(full / "checkpoints/final/model.safetensors")
    for run_dir in (ckpt, scratch):
        assert rewards(run_dir) == rewards(full)  # each step once in metrics.jsonl, as the undisturbed run drew it
        b = load_file(run_dir / "checkpoints/final/model.safetensors")
        assert a.keys() == b.keys() and all(torch_equal(a[k], b[k]) for k in a)
        ledger = json.loads((run_dir / "ledger.json").read_text())
        assert ledger["finished"] is True and len(ledger["segments"]) == 2, ledger


def test_first_step_is_the_same_with_one_and_two_rollout_actors(ray_local, tiny_model_dir, tmp_path, monkeypatch):
    """Deliverable 52.9 across Ray actors: grpo-train with 1 rollout actor and with 2 (each drawing half the
    prompts) trains on the same samples, gets the same rewards and the same gradient norm in its first step: each
    completion's sampling seed comes from (run seed, step, prompt, sample), never from the actor that draws it."""
    import es_ray.grpo.driver as driver
    from es_ray.grpo.learner import GRPOLearner

    batches: dict[int, list] = {}
    real_learn = driver.GRPOWorkers.learn

    def learn(workers, method, *args, slow=False):
        if method is GRPOLearner.train_step:  # the samples the learner trains on, as the driver sends them
            batches.setdefault(len(workers.rollouts), []).append(
                [(s["prompt_index"], list(s["completion_ids"]), s["reward"]) for s in args[0]]
            )
        return real_learn(workers, method, *args, slow=slow)

    monkeypatch.setattr(driver.GRPOWorkers, "learn", learn)
    rows = {}
    for n in (1, 2):
        cfg = tiny_cfg(tiny_model_dir, tmp_path / f"actors{n}", steps=1, run={"seed": 5})
        cfg.cluster.num_actors, cfg.cluster.cpus_per_actor = n, 0.5  # learner + 2 rollouts on ray_local's 2 CPUs
        driver.run(cfg)
        rows[n] = json.loads((tmp_path / f"actors{n}" / "metrics.jsonl").read_text().splitlines()[0])
        assert set(json.loads((tmp_path / f"actors{n}" / "ledger.json").read_text())["actors"]) == {
            "learner_0",
            *(f"rollout_{r}" for r in range(n)),
        }
    assert len(batches[1]) == len(batches[2]) == 1
    assert batches[1] == batches[2]
    assert len({tuple(c) for _, c, _ in batches[1][0]}) > 1, "the completions must differ from each other"
    for key in ("reward/mean", "reward/std", "grpo/grad_norm", "completions/mean_length"):
        assert rows[1][key] == rows[2][key], (key, rows[1][key], rows[2][key])


def test_learner_and_rollouts_that_do_not_fit_fail_early_with_the_numbers(ray_local, tiny_model_dir, tmp_path):
    """The learner plus the rollout actors go in one placement group; asking for more GPUs than the cluster has
    stops before any actor starts, saying how many it needs (learner included) and how many there are."""
    from es_ray.core.config import ConfigError
    from es_ray.grpo.driver import run

    cfg = tiny_cfg(tiny_model_dir, tmp_path)
    cfg.cluster.gpus_per_actor = 1.0
    with pytest.raises(ConfigError, match=r"needs 2 GPUs.*has 0") as err:
        run(cfg)
    assert not (tmp_path / "checkpoints").exists(), err.value


def test_a_finished_run_extended_continues_from_final(ray_local, peaked_model_dir, tmp_path):
    """run.resume=true with more grpo.steps after a finished run: from its `final` (verified), never from step 0;
    metrics.jsonl keeps step 0, the ledger lists both segments, and each finished segment ends with a held-out
    evaluation in summary.json."""
    from es_ray.grpo.driver import run

    run(tiny_cfg(peaked_model_dir, tmp_path, steps=1, eval_every=1))
    first = rewards(tmp_path)
    summary = run(tiny_cfg(peaked_model_dir, tmp_path, steps=2, eval_every=1, run={"resume": True}))
    assert summary["resumed_from"].endswith("final") and summary["held_out_final"]["after"] == 2
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and rewards(tmp_path)[:1] == first
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert [(s["start_step"], s["end_step"], s["stop"]) for s in ledger["segments"]] == [
        (0, 1, "finished"),
        (1, 2, "finished"),
    ]
    assert ledger["steps"] == 2 and ledger["redone"]["steps"] == 0
    assert ledger["tokens_generated"] == sum(r["perf/tokens"] for r in rows)
    # the earlier final is kept (run.keep_checkpoints), as a checkpoint of its own step; the new final is step 2
    from es_ray.runtime.checkpoint import read_meta, verify_dir

    kept = tmp_path / "checkpoints" / "step_000001"
    verify_dir(kept)
    assert read_meta(kept, "grpo")["step"] == 1 and read_meta(tmp_path / "checkpoints" / "final", "grpo")["step"] == 2
    assert ledger["state"] == "finished" and ledger["actors"]["learner_0"]["peak_rss_bytes"] > 0
