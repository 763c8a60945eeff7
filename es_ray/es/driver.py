"""The ES loop on the Ray driver.

Each iteration reads as its phases: members = ask(); results = evaluate(members); fitness = shape(rewards);
tell(members, fitness) on every actor; verify replica checksums; log; checkpoint. The driver sends only
integers and floats and receives only scalars; every actor applies the same update to its own fp32 master.
Connecting, the run directory, signals, the actor group and the ledger are the runtime's (es_ray.runtime).
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from pathlib import Path
from typing import Callable

import numpy as np

from es_ray.core.config import ConfigError
from es_ray.es.config import ESTrainConfig, replica_spec
from es_ray.es.protocol import EvalRequest, SeedRecord
from es_ray.es.recovery import RESUME_FREE, Replicas, ReplicaMismatchError, resume_point, seed_log_row
from es_ray.es.state import SeedLog
from es_ray.es.worker import ESWorker
from es_ray.held_out import held_out_seed
from es_ray.metrics.coverage import member_fitness
from es_ray.models import safetensors_index
from es_ray.noise_kinds import PORTABLE_KINDS
from es_ray.perturbation import PERTURBATIONS
from es_ray.runtime import actors
from es_ray.runtime import placement as placements
from es_ray.runtime.actors import POLL_S, ActorLostError, read_progress
from es_ray.runtime.loop import Training, prepare
from es_ray.runtime.rundir import releasing_run_dir
from es_ray.runtime.signals import interrupt_soon
from es_ray.runtime.tracking import Timer
from es_ray.strategy import Member, ask, shape_fitness
from es_ray.tasks.base import epoch_prompts


def assign(members: list[Member], num_actors: int) -> list[list[Member]]:
    """Member i goes to actor i % num_actors."""
    out: list[list[Member]] = [[] for _ in range(num_actors)]
    for m in members:
        out[m.index % num_actors].append(m)
    return out


def prompt_ids(cfg: ESTrainConfig, iteration: int, pool_size: int) -> tuple[int, ...]:
    """The iteration's training prompts: the whole pool if it fits, else the iteration's slice of the epochs, each
    a pass over the pool in a seeded order (``epoch_prompts``, the same as GRPO's)."""
    k = cfg.es.prompts_per_iteration
    if k >= pool_size:
        return tuple(range(pool_size))
    return tuple(epoch_prompts(pool_size, k, iteration, cfg.run.seed))


def sample_seed(cfg: ESTrainConfig, iteration: int) -> int:
    return random.Random(f"{cfg.run.seed}/{iteration}/sampling").getrandbits(62)


def start_workers(cfg: ESTrainConfig, replicas, log=print, placement=None):
    """One ES actor per bundle of the run's placement group (the fit checked first); a replacement is rebuilt by
    ``replicas.restore``. Returns the actor group and the actors' ready() answers."""

    # a replacement started during iteration t is immune to the injected faults of iterations up to t
    def make_args(rank: int) -> tuple:
        return (cfg, rank, replicas.committed if replicas.group is not None else -1)

    placement = placement or placements.place(cfg.cluster, "es")
    advice = (
        f"The seed log holds every committed iteration: continue later with run.resume=true run.dir={replicas.run_dir}"
    )
    group, infos = actors.start_group(
        "es",
        ESWorker,
        cfg.cluster.num_actors,
        make_args,
        placement,
        cfg.faults,
        log=log,
        restore=replicas.restore,
        lost_advice=advice,
    )
    replicas.group = group
    return group, infos


def evaluate(
    group,
    iteration: int,
    members: list[Member],
    cfg: ESTrainConfig,
    ids: tuple[int, ...],
    show: Callable[[int, int], None] | None = None,
):
    """Score the members on the actors (member i on actor i % num_actors); a lost actor's members are scored
    again by its replacement. ``show(done, total)`` (a progress bar's) is told the members scored so far, as the
    actors report them (``report_progress``) and as their answers come."""
    seed = sample_seed(cfg, iteration)
    parts = assign(members, len(group))
    calls = {
        r: (EvalRequest(iteration, cfg.es.sigma, tuple(part), ids, seed, show is not None),)
        for r, part in enumerate(parts)
    }
    waiting = None
    if show is not None:
        shown, told, read_at = [-1], {}, [-math.inf]

        def waiting(answered: dict) -> None:
            # the counts are read at most once a poll (one GCS call per actor still scoring), not again at each
            # answer: actors answering together would cost N^2 / 2 calls; an answer counts its members whole
            left = [r for r in calls if r not in answered]
            if left and time.monotonic() - read_at[0] >= POLL_S:
                told.clear()
                told.update(read_progress(left, iteration))
                read_at[0] = time.monotonic()
            done = sum(len(parts[r]) if r in answered else min(told.get(r, 0), len(parts[r])) for r in calls)
            if done != shown[0]:
                shown[0] = done
                show(done, len(members))

        waiting({})
    results = group.gather(ESWorker.evaluate, calls, waiting=waiting).values()
    by_index = {mr.index: mr for res in results for mr in res.members}
    timing: dict[str, float] = {}
    for res in results:  # actors run in parallel: report the slowest actor's time per phase
        for k, v in res.timing_s.items():
            timing[k] = max(timing.get(k, 0.0), v)
    return [by_index[m.index] for m in members], timing


def tell(replicas, record: SeedRecord, cfg: ESTrainConfig):
    """Every actor applies the update; the replicas' checksums are compared (es.checksum_every)."""
    t = record.iteration
    every = cfg.es.checksum_every
    want = bool(every) and ((t + 1) % every == 0 or t + 1 == cfg.es.iterations)
    req = record.update_request(want)
    updates = replicas.group.each(ESWorker.update, req)
    sums = [u.checksum for u in updates]
    if want and len(set(sums)) > 1:
        if cfg.es.on_mismatch != "rebuild":
            shown = ", ".join(f"actor {r} {c}" for r, c in enumerate(sums))
            raise ReplicaMismatchError(
                f"iteration {t}: replica checksums differ ({shown}): the replicas are no longer identical (mixed "
                "hardware, a non-deterministic kernel or a memory fault). Iterations before this one are in the seed "
                "log: continue with run.resume=true (fresh actors replay it), or set es.on_mismatch=rebuild to "
                "rebuild the odd actors from the log and go on"
            )
        sums = replicas.repair(sums, record)
    return updates, sums[0]


def run(cfg: ESTrainConfig) -> dict:
    """es-train: the runtime's run skeleton (``es_ray.runtime.loop``) around the ES iteration."""
    run_dir = prepare(cfg, "es", RESUME_FREE, lambda model_dir: preflight_perturbation(cfg, model_dir))
    with releasing_run_dir(run_dir):  # released however the run ends, a failure before its first iteration included
        return ESRun(cfg, run_dir, resume_point(cfg, run_dir)).run()


class ESRun(Training):
    """ES on the run skeleton: the actors are the replicas (``Replicas`` knows the state they must be in), a
    step is one ``iteration``, and every committed update is in the seed log before the next begins."""

    method, unit, checkpoint_prefix = "es", "iteration", "iter"

    def __init__(self, cfg: ESTrainConfig, run_dir: Path, point):
        super().__init__(cfg, run_dir, cfg.es.iterations, point.start, point.history)
        self.rebuilt = point.rebuilt
        # a checkpoint: the fp32 master, Adam's two moments, theta_0 for anchored decay
        self.checkpoint_copies = 1 + 2 * (cfg.es.optimizer == "adam") + (cfg.es.anchor_decay > 0)
        self.point, self.replicas, self.seed_log, self.placement, self.pool = point, None, None, None, 0

    def start_actors(self, guard) -> None:
        """Start the actors (models loaded), rebuild them to the resume point."""
        cfg, point, tracker = self.cfg, self.point, self.tracker
        self.seed_log = SeedLog(self.run_dir / "seed_log.jsonl")
        self.replicas = Replicas(self.run_dir, tracker, point)
        self.placement = placements.place(cfg.cluster, "es")
        group, infos = start_workers(cfg, self.replicas, tracker.message, self.placement)
        group.check_interrupt = guard.check
        check_noise_devices(cfg, infos)
        self.pool = infos[0]["train_size"]
        tracker.message(
            f"es: {len(group)} actor(s), training pool {self.pool}, held-out {infos[0]['eval_size']}, "
            f"run dir {self.run_dir}"
        )
        for line in infos[0].get("skipped_lines", ()):
            tracker.message(line)
        if point.note:
            tracker.message(point.note)
        if point.checkpoint or point.records:
            self.replicas.rebuild_all()

    def step(self, t: int, guard) -> dict:
        show = (lambda done, total: self.tracker.position(done, total, "members")) if self.tracker.bar else None
        return iteration(self.cfg, self.replicas, t, self.pool, self.seed_log, guard, self.record, show)

    def evaluate_held_out(self) -> dict:
        return self.replicas.group.call(0, ESWorker.evaluate_center, "eval", held_out_seed(self.cfg.run.seed))

    def save(self, path: Path, done: int) -> str:
        return str(self.replicas.save_checkpoint(path, done))

    def save_at_stop(self, stop: BaseException, done: int) -> str:
        """Stop the actors' work and checkpoint the committed iterations from a live actor. The seed log is already
        complete up to the last committed iteration (an update and its log line are never split by a signal), so
        resuming is exact even if a second signal cuts this checkpoint short."""
        replicas = self.replicas
        if (
            replicas is None
            or replicas.group is None
            or done <= replicas.base_iteration
            or not replicas.group.live_ranks
        ):
            return ""
        replicas.group.replaceable = False  # stopping: an actor failing now is skipped, never waited for
        replicas.group.cancel_inflight()
        try:
            return self.save(self._checkpoint_dir(done), done)
        except ActorLostError as exc:
            self.tracker.message(f"es: no live actor could write a checkpoint ({exc})")
            return ""

    def stop_note(self) -> str:
        return f"; seed log {self.run_dir / 'seed_log.jsonl'} (every committed iteration)"

    def events(self) -> dict:
        return self.replicas.drain_events()

    @property
    def groups(self) -> list:
        return [self.replicas.group] if self.replicas is not None and self.replicas.group is not None else []

    @property
    def done(self) -> int:
        return self.replicas.committed if self.replicas is not None else self.start

    def summary(self) -> dict:
        return {"iterations": self.replicas.committed}

    def close(self) -> None:
        if self.seed_log is not None:
            self.seed_log.close()
        if self.placement is not None:
            self.placement.release()


def preflight_perturbation(cfg: ESTrainConfig, model_dir) -> None:
    """What the es.perturbation mode checks against the model (low rank: es.rank against min(out, in) of the
    trainable linear layers), read from the checkpoint's headers, before any actor starts (each replica checks it
    again)."""
    spec = replica_spec(cfg)
    spec.kind.check_model(
        cfg.es.rank, lambda: {n: shape for n, (_, shape) in safetensors_index(model_dir).items() if spec.selects(n)}
    )


def check_noise_devices(cfg: ESTrainConfig, infos: list[dict]) -> None:
    """Refuse noise that depends on the device (per_tensor, table) on a mixed set of devices: CUDA's generator
    sizes its launch grid from the SM count, so an A100, an H100 or a MIG slice draw other numbers for one seed and
    the replicas would differ from iteration 0. counter is the same everywhere. es.perturbation=lowrank is refused on
    a mixed set whatever the noise: its update is one matmul of the factors (``lowrank.gradient``), whose rounding
    depends on the device's GEMM kernels, so the replicas would differ after the first update."""
    kinds = sorted({i.get("noise", cfg.es.noise) for i in infos})
    devices = sorted({(i.get("device", "cpu"), i.get("sm_count", 0)) for i in infos})
    lowrank = PERTURBATIONS.get(cfg.es.perturbation).factored
    if (set(kinds) <= PORTABLE_KINDS and not lowrank) or len(devices) < 2 or not any(sm for _, sm in devices):
        return
    shown = " and ".join(f"{name} ({sm} SMs)" if sm else name for name, sm in devices[:2])
    if set(kinds) <= PORTABLE_KINDS:
        raise ConfigError(
            f"es.perturbation={cfg.es.perturbation} applies its update with one matmul of the factors, "
            f"whose rounding depends on the device, and the actors run on {shown}"
            f"{' and more' if len(devices) > 2 else ''}: their replicas would differ after the first "
            "update; run every actor on one GPU model, or set es.perturbation=full with es.noise=counter"
        )
    raise ConfigError(
        f"es.noise={cfg.es.noise} draws {'/'.join(kinds)} noise, whose numbers depend on the device, but "
        f"the actors run on {shown}{' and more' if len(devices) > 2 else ''}: their replicas would "
        "differ from the first iteration; set es.noise=counter (the same noise on every device)"
        + (" and es.perturbation=full (low rank's update depends on the device too)" if lowrank else "")
    )


def iteration(cfg: ESTrainConfig, replicas, t: int, pool: int, seed_log, guard, record=None, show=None) -> dict:
    """One ES iteration; ``record(t, row)`` (the run skeleton's: held-out scoring, trackers, ledger) is called with
    its metrics row after the update and before the seed-log line that commits it, so every logged iteration has
    its row (a crash between the two leaves a row the resume drops and computes again); ``show(done, total)``: the
    members scored so far (``evaluate``)."""
    timer = Timer()
    t_start = time.perf_counter()
    members = ask(cfg.es.population, cfg.es.estimator)
    ids = prompt_ids(cfg, t, pool)
    if cfg.faults.interrupt_at_iteration == t:
        interrupt_soon()
    with timer("evaluate"):
        results, actor_timing = evaluate(replicas.group, t, members, cfg, ids, show)
    rewards_n = np.array([r.reward for r in results], dtype=np.float64)
    fitness_n = shape_fitness(raw_fitness(results, cfg.es.fitness_baseline), cfg.es.shaping)
    seed_record = SeedRecord(
        t, cfg.es.sigma, cfg.es.lr, tuple(members), tuple(rewards_n.tolist()), tuple(fitness_n.tolist())
    )
    with guard.critical():  # a signal waits until the update is applied, recorded and logged
        with timer("update"):
            updates, checksum = tell(replicas, seed_record, cfg)
        seed_record = dataclasses.replace(seed_record, checksum=checksum)
        row = iteration_row(
            results,
            rewards_n,
            fitness_n,
            updates,
            checksum,
            len(ids) * cfg.es.samples_per_prompt,
            timer,
            actor_timing,
            time.perf_counter() - t_start,
        )
        # every replica holds it (a replacement during held-out scoring is rebuilt with it)
        replicas.commit(seed_record)
        if record is not None:
            record(t, row)
        seed_log.append(seed_record.to_json())
    return row


def raw_fitness(results, baseline: str) -> np.ndarray:
    """[N] fitness before shaping: each member's objective over its prompts (``MemberResult.fitness``), or with a
    per-prompt baseline the mean over prompts of its values after the baseline (es_ray.metrics.coverage)."""
    if baseline == "none":
        return np.array([r.reward if r.fitness is None else r.fitness for r in results], dtype=np.float64)
    return member_fitness(np.array([r.prompt_values for r in results], dtype=np.float64), baseline)


def iteration_row(
    results,
    rewards_n: np.ndarray,
    fitness_n: np.ndarray,
    updates,
    checksum: str,
    prompts: int,
    timer: Timer,
    actor_timing: dict,
    wall: float,
) -> dict:
    """An iteration's metrics row; ``prompts``: the completions each member generated (prompts x samples)."""
    tokens = sum(r.tokens for r in results)
    row = {
        **seed_log_row(rewards_n, fitness_n, checksum),
        "reward/errors": int(sum(r.reward_errors for r in results)),
        "es/update_norm": updates[0].update_norm,
        "es/realised_cos": updates[0].realised_cos,
        "es/realised_norm": updates[0].realised_norm,
        "perf/tokens": tokens,
        "perf/tokens_per_s": tokens / max(timer.seconds["evaluate"], 1e-9),
        "completions/mean_length": tokens / max(1, len(results) * prompts),
        "perf/completions": len(results) * prompts,
        "timing_s/iteration": wall,
        "timing_s/update_actor": max(u.seconds for u in updates),
    }
    row.update({f"timing_s/{k}": v for k, v in timer.seconds.items()})
    row.update({f"timing_s/{k}": v for k, v in actor_timing.items()})
    return row
