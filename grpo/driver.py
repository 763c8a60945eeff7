"""The GRPO loop on the Ray driver. Each step reads as its phases:

    samples = generate(prompts)            rollout actors, groups of grpo.group_size per prompt
    adv     = advantages(rewards)          grpo.loss (pure)
    stats   = learner.train_step(...)      grpo.epochs_per_batch optimizer steps
    sync(learner -> every rollout engine)  then verify: probe log-probs agree within tolerance
    log; ledger; checkpoint

The driver holds no model; it only moves samples and one weight reference (Ray's object store) between actors.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np

from es_ray.driver import _sigterm_as_exit, connect, make_run_dir
from es_ray.ledger import Ledger
from es_ray.tracking import Timer, Tracker
from grpo.config import GRPOTrainConfig


class WeightSyncError(RuntimeError):
    """A rollout engine's log-probs of the probe disagree with the learner's after a weight sync."""


class LearnerDiedError(RuntimeError):
    pass


def sync_tolerance(cfg: GRPOTrainConfig) -> float:
    """Largest accepted |log p_engine - log p_learner| per probe token. Both in fp32: the same weights through
    different kernels or batch shapes differ by ~1e-5 (transformers) to ~1e-4 (vLLM), so 2e-3 leaves a margin
    and still catches a wrong tensor (a perturbation of 1e-3 in one layer moves them by >1e-2). In bf16 rounding
    alone moves single-token log-probs by up to ~0.1, so the bar is 0.25."""
    if cfg.grpo.sync_tolerance:
        return cfg.grpo.sync_tolerance
    engine_fp32 = cfg.engine.dtype == "float32" or (cfg.engine.dtype == "auto" and cfg.cluster.gpus_per_actor == 0)
    return 2e-3 if engine_fp32 and cfg.grpo.dtype == "float32" else 0.25


def check_sync(learner_lp: list[float], engine_lps: list[list[float]], tol: float, step: int) -> float:
    """Max |difference| over engines and tokens; raises WeightSyncError past ``tol``."""
    ref = np.asarray(learner_lp)
    worst = 0.0
    for rank, lp in enumerate(engine_lps):
        diff = float(np.max(np.abs(np.asarray(lp) - ref))) if len(lp) == len(ref) else float("inf")
        if not diff <= tol:
            raise WeightSyncError(
                f"step {step}: after writing the learner's weights, rollout engine {rank} gives probe log-probs "
                f"that differ from the learner's by up to {diff:.3g} (tolerance {tol:g}); the engine does not hold "
                "the learner's weights (a tensor not written, a name mapping or dtype problem). Check engine.name / "
                "engine.dtype, or set grpo.sync_tolerance if the engines legitimately differ more")
        worst = max(worst, diff)
    return worst


def prompt_indices(cfg: GRPOTrainConfig, step: int, pool_size: int) -> list[int]:
    """The step's prompts: a sample fixed by (run.seed, step), the data position a resumed run restarts from."""
    k = cfg.grpo.prompts_per_step
    rng = random.Random(f"{cfg.run.seed}/{step}/grpo-prompts")
    if k <= pool_size:
        return sorted(rng.sample(range(pool_size), k))
    return sorted(rng.choices(range(pool_size), k=k))  # more prompts than the pool holds: with repeats


def sample_seed(cfg: GRPOTrainConfig, step: int, part: int = 0) -> int:
    return random.Random(f"{cfg.run.seed}/{step}/{part}/grpo-sampling").getrandbits(62)


class Cluster:
    """The learner and the rollout actors, with the weight sync and the replacement of a dead rollout actor."""

    def __init__(self, cfg: GRPOTrainConfig, tracker: Tracker):
        import ray

        from grpo.learner import GRPOLearner
        from grpo.rollout import RolloutWorker

        from es_ray.placement import place

        self.cfg, self.tracker, self.tol = cfg, tracker, sync_tolerance(cfg)
        c = cfg.cluster
        # One placement group for the run (cluster.placement: pack or spread): bundle 0 is the learner's, bundle
        # 1 + r rollout actor r's (a replacement goes back into its predecessor's bundle). Fails early, with the
        # numbers, when the cluster cannot hold them.
        self.placement = place(c, "grpo", count=c.num_actors + 1)
        self._rollout_cls = ray.remote(RolloutWorker)
        self.learner = ray.remote(GRPOLearner).options(**self.placement.options(0)).remote(cfg)
        self.rollouts = [self._rollout_cls.options(**self.placement.options(r + 1)).remote(cfg, r)
                         for r in range(c.num_actors)]
        self.learner_info = self._learner_call(self.learner.ready.remote())
        self.infos = ray.get([w.ready.remote() for w in self.rollouts])
        self.probe = None
        self.replaced = 0

    def _learner_call(self, ref):
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            raise LearnerDiedError(
                f"the GRPO learner actor died ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); the run "
                f"cannot continue without it. Resume from the last periodic checkpoint with run.resume=true "
                f"run.dir={self.cfg.run.dir or '<this run dir>'} (set run.checkpoint_every to keep some)") from exc

    def sync(self, step: int) -> dict:
        """Write the learner's weights into every rollout engine, then verify with the probe."""
        import ray

        t0 = time.perf_counter()
        weights = self.learner.weights.remote()  # stays in the object store; each rollout actor reads it
        write_s = max(self._each(lambda rank, w: w.write_weights.remote(weights), step))
        t1 = time.perf_counter()
        if self.probe is None:
            self.probe = ray.get(self.rollouts[0].probe.remote())
        learner_lp = self._learner_call(self.learner.probe_logprobs.remote(*self.probe))
        engine_lps = self._each(lambda rank, w: w.probe_logprobs.remote(*self.probe), step)
        worst = check_sync(learner_lp, engine_lps, self.tol, step)
        return {"sync/max_logprob_diff": worst, "sync/tolerance": self.tol, "timing_s/sync": time.perf_counter() - t0,
                "timing_s/sync_write": write_s, "timing_s/sync_verify": time.perf_counter() - t1}

    def _each(self, call, step: int) -> list:
        """call(rank, actor) on every rollout actor; a dead one is replaced, re-synced from the learner and asked
        again (its request is a pure function of the step, so the answer is the one it would have given)."""
        import ray

        refs = [call(rank, w) for rank, w in enumerate(self.rollouts)]
        out = []
        for rank, ref in enumerate(refs):
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError as exc:
                self.tracker.message(f"grpo: step {step}: rollout actor {rank} died ({type(exc).__name__}); "
                                     "starting a replacement and re-syncing it from the learner")
                self.rollouts[rank] = self._replace(rank, step)
                out.append(ray.get(call(rank, self.rollouts[rank])))
        return out

    def _replace(self, rank: int, step: int):
        import ray

        w = self._rollout_cls.options(**self.placement.options(rank + 1)).remote(self.cfg, rank)
        ray.get(w.ready.remote())
        ray.get(w.write_weights.remote(self.learner.weights.remote()))
        if self.probe is not None:
            lp = self._learner_call(self.learner.probe_logprobs.remote(*self.probe))
            check_sync(lp, [ray.get(w.probe_logprobs.remote(*self.probe))], self.tol, step)
        self.replaced += 1
        return w

    def kill(self) -> None:
        import ray

        for a in [self.learner, *self.rollouts]:
            ray.kill(a)
        self.placement.release()

    def memory(self) -> dict:
        import ray

        out = {"learner": self._learner_call(self.learner.peak_memory.remote())}
        for rank, m in enumerate(ray.get([w.peak_memory.remote() for w in self.rollouts])):
            out[f"rollout_{rank}"] = m
        return out


def last_checkpoint(run_dir: Path) -> Path | None:
    steps = sorted((run_dir / "checkpoints").glob("step_*"))
    return steps[-1] if steps else None


def _truncate_metrics(run_dir: Path, start: int) -> None:
    """Drop metrics rows of steps the resumed run will redo (they came after the checkpoint)."""
    import json

    path = run_dir / "metrics.jsonl"
    if path.is_file():
        rows = [line for line in path.read_text().splitlines() if line.strip()]
        path.write_text("".join(r + "\n" for r in rows if json.loads(r).get("step", 0) < start))


def run(cfg: GRPOTrainConfig) -> dict:
    import json

    import ray

    g = cfg.grpo
    if not cfg.cluster.address:  # fail fast on this machine; on a remote cluster the actors check
        from es_ray.models import resolve_model
        from es_ray.tasks import load_task

        resolve_model(cfg.model.path)
        load_task(cfg.task)
    run_dir = make_run_dir(cfg, prefix="grpo")
    start, ckpt = 0, None
    if getattr(cfg.run, "resume", False):
        ckpt = last_checkpoint(run_dir)  # none yet: a new run, as es-train does
        if ckpt is not None:
            start = json.loads((ckpt / "es_meta.json").read_text())["step"]
        _truncate_metrics(run_dir, start)
    connect(cfg.cluster)
    _sigterm_as_exit()
    tracker = Tracker(run_dir, g.steps - start, cfg.run.tensorboard, cfg.run.progress, desc="grpo")
    ledger = Ledger("grpo")
    cluster = None
    summary: dict = {"run_dir": str(run_dir), "resumed_from": str(ckpt) if ckpt else None}
    try:
        cluster = Cluster(cfg, tracker)
        if ckpt is not None:
            cluster._learner_call(cluster.learner.load.remote(str(ckpt)))
            tracker.message(f"grpo: resumed from {ckpt} at step {start}")
        pool = cluster.infos[0]["train_size"]
        tracker.message(f"grpo: learner + {len(cluster.rollouts)} rollout actor(s), {cluster.learner_info['trainable']}"
                        f" trainable parameters, training pool {pool}, run dir {run_dir}")
        first_sync = cluster.sync(start - 1)
        tracker.message(f"grpo: initial weight sync verified (max |dlogp| {first_sync['sync/max_logprob_diff']:.2e}, "
                        f"tolerance {cluster.tol:g})")
        history = []
        for t in range(start, g.steps):
            row = step(cfg, cluster, t, pool)
            if cfg.eval.every and ((t + 1) % cfg.eval.every == 0 or t == 0):
                res = ray.get(cluster.rollouts[0].evaluate.remote("eval", sample_seed(cfg, -1)))
                row["eval/reward"], row["timing_s/eval"] = res["reward"], res["seconds"]
            tracker.log(t, row, step_key="step")
            ledger.add_step(row, row["perf/tokens"], row["perf/tokens_backpropagated"])
            history.append(row)
            if cfg.run.checkpoint_every and (t + 1) % cfg.run.checkpoint_every == 0 and t + 1 < g.steps:
                path = run_dir / "checkpoints" / f"step_{t + 1:06d}"
                cluster._learner_call(cluster.learner.save.remote(str(path), {"step": t + 1}))
        final = run_dir / "checkpoints" / "final"
        cluster._learner_call(cluster.learner.save.remote(str(final), {"step": g.steps}))
        write_ledger(ledger, cluster, run_dir, start, finished=True)
        summary.update(final_checkpoint=str(final), steps=g.steps, reward_mean=[h["reward/mean"] for h in history],
                       eval_reward=[h["eval/reward"] for h in history if "eval/reward" in h])
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        tracker.message(f"grpo: done; final checkpoint {final}")
        return summary
    except BaseException:
        if cluster is not None:  # what the run cost until it stopped (best effort: an actor may be gone)
            try:
                write_ledger(ledger, cluster, run_dir, start, finished=False)
            except Exception:
                ledger.write(run_dir, {"start_step": start, "finished": False})
        raise
    finally:
        tracker.close()
        if cluster is not None:
            cluster.kill()


def write_ledger(ledger: Ledger, cluster: Cluster, run_dir: Path, start: int, finished: bool) -> None:
    for role, report in cluster.memory().items():
        ledger.add_memory(role, report)
    ledger.write(run_dir, {"rollout_actors_replaced": cluster.replaced, "start_step": start, "finished": finished})


def step(cfg: GRPOTrainConfig, cluster: Cluster, t: int, pool: int) -> dict:
    import torch

    from grpo.loss import group_advantages

    g, timer, t0 = cfg.grpo, Timer(), time.perf_counter()
    ids = prompt_indices(cfg, t, pool)
    parts = [list(map(int, p)) for p in np.array_split(ids, len(cluster.rollouts))]
    with timer("generate"):
        results = cluster._each(lambda rank, w: w.generate.remote(parts[rank], g.group_size,
                                                                  sample_seed(cfg, t, rank)), t)
    samples = [s for res in results for s in res["samples"]]  # prompt-major: P groups of G, in ids order
    rewards_pg = np.array([s["reward"] for s in samples], dtype=np.float64).reshape(len(ids), g.group_size)
    adv_b = group_advantages(torch.from_numpy(rewards_pg), g.adv_scale, g.adv_eps).flatten().tolist()
    with timer("train"):
        stats = cluster._learner_call(cluster.learner.train_step.remote(samples, adv_b))
    sync = cluster.sync(t)
    lengths = [len(s["completion_ids"]) for s in samples]
    tokens = sum(res["tokens"] for res in results)
    row = {
        "reward/mean": float(rewards_pg.mean()), "reward/std": float(rewards_pg.std()),
        "reward/max": float(rewards_pg.max()), "reward/min": float(rewards_pg.min()),
        "reward/errors": int(sum(res["reward_errors"] for res in results)),
        "reward/zero_std_groups": float(np.mean(rewards_pg.std(axis=1) == 0)),
        **{k: v for k, v in stats.items() if k.startswith("grpo/")},
        "completions/mean_length": float(np.mean(lengths)), "completions/max_length": int(max(lengths)),
        "perf/tokens": tokens, "perf/tokens_backpropagated": stats["tokens_backpropagated"],
        "perf/tokens_per_s": tokens / max(timer.seconds["generate"], 1e-9),
        **sync,
        "timing_s/generate_actor": max(res["generate_s"] for res in results),
        "timing_s/reward": max(res["reward_s"] for res in results),
        "timing_s/train_actor": stats["seconds"],
    }
    row.update({f"timing_s/{k}": v for k, v in timer.seconds.items()})
    row["timing_s/step"] = time.perf_counter() - t0
    return row
