"""The GRPO loop on the Ray driver. Each step reads as its phases:

    samples = generate(prompts)            rollout actors, groups of grpo.group_size per prompt
    adv     = advantages(rewards)          grpo.loss (pure)
    stats   = learner.train_step(...)      grpo.epochs_per_batch optimizer steps
    sync(learner -> every rollout engine)  layer by layer in the engines' dtype; then verify: probe log-probs
                                           agree within the tolerance set at the first sync
    log; ledger; checkpoint

The driver holds no model; it only moves samples and weight references (Ray's object store, one chunk at a time)
between actors.
Connecting, the run directory, signals, the actor groups (timeouts, replacement) and the ledger are the runtime's
(es_ray.runtime), as for ES.
"""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path

import numpy as np

from es_ray.core.config import ConfigError
from es_ray.held_out import held_out_seed
from es_ray.runtime import actors
from es_ray.runtime import placement as placements
from es_ray.runtime.actors import Actor, ActorLostError
from es_ray.runtime.checkpoint import checkpoints_by_step, read_meta, verify_dir
from es_ray.runtime.loop import Training, prepare
from es_ray.runtime.names import REWARD_MEAN, REWARD_STD
from es_ray.runtime.rundir import keep_metrics, lock_run_dir, releasing_run_dir
from es_ray.runtime.tracking import Timer, Tracker
from es_ray.grpo.colocated import ColocatedWorker
from es_ray.grpo.config import RESUME_FREE, GRPOTrainConfig
from es_ray.grpo.learner import GRPOLearner
from es_ray.grpo.rollout import RolloutWorker, Sample
from es_ray.tasks.base import epoch_prompts

# Ray, torch and the GRPO loss (torch) are imported where a step needs them: the driver checks and prepares a run
# without torch (tests/repo/test_layers.py).


class WeightSyncError(RuntimeError):
    """A rollout engine's log-probs of the probe disagree with the learner's after a weight sync."""


SYNC_FLOOR = 2e-3
"""Smallest calibrated tolerance: the same fp32 weights through other kernels or batch shapes differ by ~1e-5
(transformers) to ~1e-4 (vLLM), and a wrong tensor (1e-3 noise in one layer) moves log-probs by > 1e-2."""
SYNC_MARGIN = 4.0
"""Tolerance = SYNC_MARGIN x the first sync's difference: that difference is the engine's precision against the
learner's on the policy's own tokens (bf16 rounding, kernels); it moves as the weights and the sampled tokens
move, so later syncs get room for a few times it, while a tensor not written moves them by far more."""
FIRST_SYNC_CEILING = 2.0
"""The first sync itself must agree within this (nats per token): larger is a broken engine, not rounding (a bf16
engine against a bf16_mixed learner differed by up to 0.28 on SmolLM2-135M's 32-token probe at T = 0.7)."""


def sync_tolerance(cfg: GRPOTrainConfig, first_diff: float = 0.0) -> float:
    """Largest accepted |log p_engine - log p_learner| per probe token: grpo.sync_tolerance when set, else
    max(SYNC_FLOOR, SYNC_MARGIN x first_diff), first_diff being the largest difference measured at the first sync
    (learner and engine at their own precisions, e.g. an fp32 learner against a bf16 engine)."""
    if cfg.grpo.sync_tolerance:
        return cfg.grpo.sync_tolerance
    return max(SYNC_FLOOR, SYNC_MARGIN * first_diff)


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
                "engine.dtype, or set grpo.sync_tolerance if the engines legitimately differ more"
            )
        worst = max(worst, diff)
    return worst


def prompt_indices(cfg: GRPOTrainConfig, step: int, pool_size: int) -> list[int]:
    """The step's prompts: its slice of the epochs, each a pass over the pool in an order fixed by (run.seed,
    epoch) (``epoch_prompts``, the same as ES's), so a resumed run restarts from the same data position."""
    return epoch_prompts(pool_size, cfg.grpo.prompts_per_step, step, cfg.run.seed)


def sample_seed(cfg: GRPOTrainConfig, step: int) -> int:
    """The step's sampling seed, from (run.seed, step); each completion's own seed derives from it, its prompt's
    index and its sample index (``rollout.completion_seed``), never from the rollout actor that draws it."""
    return random.Random(f"{cfg.run.seed}/{step}/0/grpo-sampling").getrandbits(62)


class GRPOWorkers:
    """The learner ranks (bundles 0..fsdp_size-1 of the run's placement group; not replaceable: the optimizer state
    lives only there) and the rollout actors (the next bundles; a dead or silent one is replaced and re-synced from
    the learner), each an ActorGroup of the runtime. With grpo.colocate one group of grpo.fsdp_size actors is both:
    each holds a learner rank and a rollout engine (grpo.colocated.ColocatedWorker)."""

    def __init__(self, cfg: GRPOTrainConfig, tracker: Tracker, run_dir: Path, check_interrupt):
        self.cfg, self.tracker, self.tol = cfg, tracker, sync_tolerance(cfg)
        self.probe = None
        f = cfg.grpo.fsdp_size
        check_devices(cfg)
        self.colocated = cfg.grpo.colocate
        self.placement = placements.place(
            cfg.cluster, "grpo", count=f if self.colocated else cfg.cluster.num_actors + f
        )
        advice = (
            f"the run cannot continue without it. Resume from the last checkpoint with run.resume=true "
            f"run.dir={run_dir} (set run.checkpoint_every to keep some)"
        )
        common = dict(log=tracker.message, check_interrupt=check_interrupt)
        if self.colocated:
            role, cls = "learner+rollout", ColocatedWorker
        else:
            role, cls = "learner", GRPOLearner
        # Every actor is asked for before any is waited on: the rollout engines start (their processes, imports and
        # models) while the learner ranks start, not after them. Ranks and bundles are those of one group after
        # the other: learner rank r in bundle r, rollout rank r in bundle f + r.
        self.learner = actors.ActorGroup(
            role,
            cls,
            f,
            lambda rank: (cfg, rank, f),
            self.placement,
            cfg.faults,
            replaceable=False,
            lost_advice=advice,
            **common,
        )
        self.rollouts = None
        try:
            if not self.colocated:
                self.rollouts = actors.ActorGroup(
                    "rollout",
                    RolloutWorker,
                    cfg.cluster.num_actors,
                    lambda rank: (cfg, rank),
                    self.placement,
                    cfg.faults,
                    first_bundle=f,
                    restore=self._resync,
                    lost_advice=f"Resume with run.resume=true run.dir={run_dir}",
                    **common,
                )
            infos = self.learner.each(Actor.ready, slow=True)
            rollout_infos = self.rollouts.each(Actor.ready, slow=True) if self.rollouts is not None else None
            if not infos[0]["built"]:  # sharded: rank 0 picks the rendezvous, every rank joins and builds its shard
                address = self.learner.call(0, GRPOLearner.address)
                joined = self.learner.gather(GRPOLearner.join, {r: (address,) for r in self.learner.ranks}, slow=True)
                infos = [joined[r] for r in self.learner.ranks]
        except BaseException:  # the run's clean-up sees no GRPOWorkers yet: its actors and placement are ended here
            for group in (self.learner, self.rollouts):
                if group is not None:
                    group.kill()
            self.placement.release()
            raise
        self.learner_info = infos[0]
        self.learner_probe = ColocatedWorker.learner_probe_logprobs if self.colocated else GRPOLearner.probe_logprobs
        if self.colocated:
            self.rollouts, self.infos = self.learner, infos
        else:
            self.infos = rollout_infos

    @property
    def groups(self) -> list:
        return [self.learner] if self.colocated else [self.learner, self.rollouts]

    def learn(self, method, *args, slow: bool = False):
        """A learner call on every rank at once (a sharded learner's methods are collectives); rank 0's answer."""
        return self.learner.each(method, *args, slow=slow)[0]

    def sync(self, step: int) -> dict:
        """Write the learner's weights into every rollout engine, then verify with the probe. The first sync also
        draws the probe (a completion the engine samples for the first training prompt) and, unless
        grpo.sync_tolerance is set, sets the tolerance from the difference it measures (``sync_tolerance``)."""
        t0 = time.perf_counter()
        nbytes = self._send_weights(self.rollouts.ranks, self.rollouts)
        t1 = time.perf_counter()
        first = self.probe is None
        if first:
            self.probe = self.rollouts.call(0, RolloutWorker.probe)
        learner_lp = self.learn(self.learner_probe, *self.probe)
        engine_lps = self.rollouts.each(RolloutWorker.probe_logprobs, *self.probe)
        calibrate = first and not self.cfg.grpo.sync_tolerance
        worst = check_sync(learner_lp, engine_lps, FIRST_SYNC_CEILING if calibrate else self.tol, step)
        if calibrate:
            self.tol = sync_tolerance(self.cfg, worst)
        return {
            "sync/max_logprob_diff": worst,
            "sync/tolerance": self.tol,
            "sync/bytes": nbytes,
            "timing_s/sync": time.perf_counter() - t0,
            "timing_s/sync_write": t1 - t0,
            "timing_s/sync_verify": time.perf_counter() - t1,
        }

    def _send_weights(self, ranks: list[int], group) -> int:
        """The learner's weights into the engines of ``ranks``, one chunk (a layer) at a time, cast by the learner to
        the engines' dtype: while the engines write chunk k the learner casts chunk k+1, so Ray's object store holds
        at most two chunks, and each engine process one. Returns the bytes one engine received."""
        import ray

        dtype, n = self.infos[0]["dtype"], self.learner_info["weight_chunks"]
        if self.colocated:  # each actor from its own learner rank into its own engine
            return self.learner.each(ColocatedWorker.sync_local, dtype)[0]["bytes"]
        # every learner rank gathers each tensor of chunk k (full_tensor) with the others; rank 0's copy is sent
        chunk = lambda k: self.learner.send_all(GRPOLearner.weight_chunk, k, dtype)  # noqa: E731
        ahead, nbytes = chunk(0), 0
        for k in range(n):
            refs, ahead = ahead, chunk(k + 1) if k + 1 < n else None
            nbytes += group.gather(RolloutWorker.write_weights, {r: (refs[0],) for r in ranks})[ranks[0]]["bytes"]
            if len(refs) > 1:  # the other ranks' (empty) answers: an error there surfaces here (ray.get of
                ray.get(refs[1:])  # nothing would start a Ray of its own where none is running)
            del refs  # the driver owns the chunk: dropping the last reference frees it in the object store
        return nbytes

    def _resync(self, group, rank: int) -> dict:
        """The rollout group's restore hook: the replacement gets the learner's current weights, verified."""
        self._send_weights([rank], group)
        if self.probe is not None:
            lp = self.learn(GRPOLearner.probe_logprobs, *self.probe)
            check_sync(lp, [group.call(rank, RolloutWorker.probe_logprobs, *self.probe)], self.tol, -1)
        return {"resynced": True}


def check_devices(cfg: GRPOTrainConfig) -> None:
    """grpo.fsdp_size ranks (one device each) must fit the connected cluster's GPUs (or CPUs)."""
    import ray

    key, per = (
        ("GPU", cfg.cluster.gpus_per_actor) if cfg.cluster.gpus_per_actor > 0 else ("CPU", cfg.cluster.cpus_per_actor)
    )
    have = ray.cluster_resources().get(key, 0.0)
    f = cfg.grpo.fsdp_size
    if f > 1 and per > 0 and f * per > have:  # one rank that does not fit: the placement's own message says so
        raise ConfigError(
            f"grpo.fsdp_size={f} learner ranks x {per:g} {key}s each exceed the cluster's {have:g} "
            f"{key}s; set grpo.fsdp_size<={max(1, int(have // per))}"
        )


def last_checkpoint(run_dir: Path) -> Path | None:
    """The published checkpoint of the most steps, ``final`` included (a finished run extended continues from it;
    what a killed save left is cleaned up first)."""
    found = checkpoints_by_step(run_dir / "checkpoints", "grpo", "step")
    return found[-1][1] if found else None


def resume_point(cfg: GRPOTrainConfig, run_dir: Path) -> tuple[int, Path | None, list[dict]]:
    """Where a resume (run.resume=true, or a restart after a lost learner) starts: the steps of the last
    checkpoint (0 without one), that checkpoint, and the metrics rows before it (later rows are cut)."""
    start, ckpt = 0, last_checkpoint(run_dir)  # none yet: a new run, as es-train does
    if ckpt is not None:  # every file checked against its digest here, refused with one line naming it
        verify_dir(ckpt)
        start = read_meta(ckpt, "grpo")["step"]
        if start > cfg.grpo.steps:
            raise ConfigError(
                f"run.resume=true: {ckpt} holds {start} steps, more than grpo.steps="
                f"{cfg.grpo.steps}; raise grpo.steps to at least {start}"
            )
    return start, ckpt, keep_metrics(run_dir / "metrics.jsonl", start, "step")  # also cuts a torn last line


def run(cfg: GRPOTrainConfig) -> dict:
    """grpo-train: the runtime's run skeleton (``es_ray.runtime.loop``) around the GRPO step. A lost learner rank
    (its process killed by Ray's memory monitor, crashed, its node gone) holds the optimizer state no other actor
    has, so it is not replaced alone: every worker is rebuilt from the last committed checkpoint (what
    run.resume=true loads; the initial weights at step 0 without one) and the steps since it run again, in this
    process, up to faults.max_replacements times. The steps redone are the same steps (each completion's sampling
    seed comes from the run seed, step, prompt and sample), so the run ends where an undisturbed one ends."""
    run_dir = prepare(cfg, "grpo", RESUME_FREE)
    restarts = 0
    with releasing_run_dir(run_dir):  # released however the run ends, a failure before its first step included
        start, ckpt, history = resume_point(cfg, run_dir) if cfg.run.resume else (0, None, [])
        while True:
            training = GRPORun(cfg, run_dir, start, history, ckpt)
            try:
                return training.run()
            except ActorLostError as lost:
                if not training.learner_lost or restarts >= cfg.faults.max_replacements:
                    raise
                restarts += 1
                lock_run_dir(run_dir, "grpo")  # the run's clean-up gave it back; this process goes on with it
                # the rest is a resume: the ledger keeps the lost attempt's segment, metrics.jsonl is cut back
                cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=True))
                start, ckpt, history = resume_point(cfg, run_dir)
                where = (
                    f"its last checkpoint {ckpt} (step {start})"
                    if ckpt is not None
                    else "the initial weights (step 0; no checkpoint yet: set run.checkpoint_every to keep some)"
                )
                print(
                    f"grpo: learner lost after {training.done} step(s) ({one_reason(lost)}); restart "
                    f"{restarts} of at most faults.max_replacements={cfg.faults.max_replacements}: rebuilding the "
                    f"learner and rollouts from {where} and redoing the steps since",
                    flush=True,
                )


def one_reason(lost: BaseException) -> str:
    """The lost actor's error up to its advice (which names a resume this restart does itself)."""
    return str(lost).split("; the run cannot continue")[0]


class GRPORun(Training):
    """GRPO on the run skeleton: the actors are the GRPOWorkers (learner ranks and rollout engines), a step is one
    ``step`` (generate, advantages, optimizer step, weight sync), checkpoints come from the learner."""

    method, unit, checkpoint_prefix = "grpo", "step", "step"
    checkpoint_copies = 3  # the fp32 weights and AdamW's two moments

    def __init__(self, cfg: GRPOTrainConfig, run_dir: Path, start: int, history: list[dict], ckpt: Path | None):
        super().__init__(cfg, run_dir, cfg.grpo.steps, start, history)
        self.ckpt, self.workers, self.pool = ckpt, None, 0
        self.learner_lost = False  # the run stopped because a learner rank was lost (``run`` restarts it)

    def start_actors(self, guard) -> None:
        """The learner loads the checkpoint to resume from, the rollouts get its weights (verified)."""
        tracker = self.tracker
        self.workers = workers = GRPOWorkers(self.cfg, tracker, self.run_dir, guard.check)
        if self.ckpt is not None:
            workers.learn(GRPOLearner.load, str(self.ckpt), slow=True)
            tracker.message(f"grpo: resumed from {self.ckpt} at step {self.start}")
        self.pool = workers.infos[0]["train_size"]
        tracker.message(
            f"grpo: learner + {len(workers.rollouts)} rollout actor(s), "
            f"{workers.learner_info['trainable']} trainable parameters, training pool {self.pool}, "
            f"run dir {self.run_dir}"
        )
        for line in workers.infos[0].get("skipped_lines", ()):
            tracker.message(line)
        first = workers.sync(self.start - 1)
        tracker.message(
            f"grpo: initial weight sync verified (max |dlogp| {first['sync/max_logprob_diff']:.2e}, "
            f"tolerance {workers.tol:g})"
        )

    def step(self, t: int, guard) -> dict:
        return step(self.cfg, self.workers, t, self.pool, guard)

    def evaluate_held_out(self) -> dict:
        """The current weights on the held-out set, greedy."""
        return self.workers.rollouts.call(0, RolloutWorker.evaluate, "eval", held_out_seed(self.cfg.run.seed))

    def save(self, path: Path, done: int) -> str:
        return str(self.workers.learn(GRPOLearner.save, str(path), {"step": done}))

    def save_at_stop(self, stop: BaseException, done: int) -> str:
        """Checkpoint the completed steps (an optimizer step and its sync are never split by a signal) after
        stopping the rollouts. A lost learner's error is raised as it is (nothing left to checkpoint from; ``run``
        restarts from the last checkpoint while faults.max_replacements allows)."""
        workers = self.workers
        if workers is not None and workers.learner.lost:  # its error says how to resume (``run`` may restart first)
            self.learner_lost = True
            raise stop
        if workers is None or done <= self.start:
            return ""
        workers.rollouts.replaceable = False  # stopping: a rollout failing now is not waited for
        workers.rollouts.cancel_inflight()
        return self.save(self._checkpoint_dir(done), done)

    def events(self) -> dict:
        """Rollout actors replaced during the step."""
        events = [e for g in self.workers.groups for e in g.drain_events()]
        if not events:
            return {}
        return {"recovery/replacements": len(events), "recovery/seconds": sum(e["seconds"] for e in events)}

    @property
    def groups(self) -> list:
        return self.workers.groups if self.workers is not None else []

    def summary(self) -> dict:
        return {"steps": self.done, "resumed_from": str(self.ckpt) if self.ckpt else None}

    def close(self) -> None:
        if self.workers is not None:
            self.workers.placement.release()


def step(cfg: GRPOTrainConfig, workers: GRPOWorkers, t: int, pool: int, guard) -> dict:
    import torch

    from es_ray.grpo.loss import objective_advantages

    g, timer, t0 = cfg.grpo, Timer(), time.perf_counter()
    ids = prompt_indices(cfg, t, pool)
    parts = [list(map(int, p)) for p in np.array_split(ids, len(workers.rollouts))]
    with timer("generate"):
        out = workers.rollouts.gather(
            RolloutWorker.generate, {r: (parts[r], g.group_size, sample_seed(cfg, t)) for r in workers.rollouts.ranks}
        )
    results = [out[r] for r in workers.rollouts.ranks]
    # prompt-major: P groups of G, in ids order
    samples: list[Sample] = [s for res in results for s in res["samples"]]
    rewards_pg = np.array([s["reward"] for s in samples], dtype=np.float64).reshape(len(ids), g.group_size)
    adv_b = (
        objective_advantages(
            torch.from_numpy(rewards_pg), cfg.task.objective, cfg.task.objective_k, g.adv_scale, g.adv_eps
        )
        .flatten()
        .tolist()
    )
    with guard.critical():  # an optimizer step and the sync that follows it are never split by a signal
        with timer("train"):
            stats = workers.learn(GRPOLearner.train_step, samples, adv_b)
        sync = workers.sync(t)
    lengths = [len(s["completion_ids"]) for s in samples]
    tokens = sum(res["tokens"] for res in results)
    row = {
        REWARD_MEAN: float(rewards_pg.mean()),
        REWARD_STD: float(rewards_pg.std()),
        "reward/max": float(rewards_pg.max()),
        "reward/min": float(rewards_pg.min()),
        "reward/errors": int(sum(res["reward_errors"] for res in results)),
        "reward/zero_std_groups": float(np.mean(rewards_pg.std(axis=1) == 0)),
        **{k: v for k, v in stats.items() if k.startswith("grpo/")},
        "completions/mean_length": float(np.mean(lengths)),
        "completions/max_length": int(max(lengths)),
        "perf/tokens": tokens,
        "perf/tokens_backpropagated": stats["tokens_backpropagated"],
        "perf/tokens_per_s": tokens / max(timer.seconds["generate"], 1e-9),
        **sync,
        "timing_s/generate_actor": max(res["generate_s"] for res in results),
        "timing_s/reward": max(res["reward_s"] for res in results),
        "timing_s/train_actor": stats["seconds"],
    }
    row.update({f"timing_s/{k}": v for k, v in timer.seconds.items()})
    row["timing_s/step"] = time.perf_counter() - t0
    return row
