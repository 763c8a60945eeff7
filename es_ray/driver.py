"""The ES loop on the Ray driver.

Each iteration reads as its phases: members = ask(); results = evaluate(members); fitness = shape(rewards);
tell(members, fitness) on every actor; verify replica checksums; log; checkpoint. The driver sends only
integers and floats and receives only scalars; every actor applies the same update to its own fp32 master.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from es_ray.config import ClusterConfig, ConfigError, TrainConfig
from es_ray.protocol import EvalRequest, UpdateRequest
from es_ray.recovery import ReplicaMismatchError
from es_ray.strategy import Member, ask, shape_fitness
from es_ray.tracking import Timer, Tracker


def check_address(address: str, timeout: float = 5.0) -> None:
    """Refuse an unreachable cluster.address before any work (ray.init would otherwise wait a long time)."""
    if address in ("", "auto", "local"):
        return
    url = urlparse(address if "://" in address else f"tcp://{address}")
    host, port = url.hostname, url.port or (10001 if url.scheme == "ray" else 6379)
    if not host:
        raise ConfigError(f"cluster.address={address!r} is not host:port or ray://host:port")
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        raise ConfigError(
            f"cluster.address={address!r} is unreachable ({exc}); check the head node's address and port, "
            "or leave cluster.address empty to start a local Ray"
        ) from exc


def connect(cluster: ClusterConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "1"}}
    if os.environ.get("ES_RAY_CACHE"):
        env["env_vars"]["ES_RAY_CACHE"] = os.environ["ES_RAY_CACHE"]
    if cluster.address:
        check_address(cluster.address)
        ray.init(address=cluster.address, runtime_env=env, log_to_driver=True)
    else:
        # A new local Ray, never a session someone else started on this machine (under Ray Jobs, RAY_ADDRESS
        # names the job's cluster and wins)
        local = None if os.environ.get("RAY_ADDRESS") else "local"
        ray.init(address=local, num_cpus=cluster.num_cpus or None, include_dashboard=False, runtime_env=env,
                 configure_logging=False, log_to_driver=True)


def make_run_dir(cfg: TrainConfig, prefix: str = "es") -> Path:
    root = Path(cfg.run.root or Path.cwd() / "runs")
    run_dir = Path(cfg.run.dir or root / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    return run_dir


def assign(members: list[Member], num_actors: int) -> list[list[Member]]:
    """Member i goes to actor i % num_actors."""
    out: list[list[Member]] = [[] for _ in range(num_actors)]
    for m in members:
        out[m.index % num_actors].append(m)
    return out


def prompt_ids(cfg: TrainConfig, iteration: int, pool_size: int) -> tuple[int, ...]:
    """The iteration's training prompts: the whole pool if it fits, else a sample fixed by (seed, iteration)."""
    k = cfg.es.prompts_per_iteration
    if k >= pool_size:
        return tuple(range(pool_size))
    rng = random.Random(f"{cfg.run.seed}/{iteration}/prompts")
    return tuple(sorted(rng.sample(range(pool_size), k)))


def sample_seed(cfg: TrainConfig, iteration: int) -> int:
    return random.Random(f"{cfg.run.seed}/{iteration}/sampling").getrandbits(62)


def start_workers(cfg: TrainConfig) -> tuple[list, list[dict]]:
    """One actor per bundle of the run's placement group (es_ray.placement: fit checked first). The returned
    list is a placement.ActorGroup: `workers.placement.options(rank)` places a replacement actor."""
    import ray

    from es_ray.placement import ActorGroup, place
    from es_ray.worker import ESWorker

    actor_cls = ray.remote(ESWorker)
    placement = place(cfg.cluster, "es")
    workers = ActorGroup([actor_cls.options(max_concurrency=1, **placement.options(rank)).remote(cfg, rank)
                          for rank in range(cfg.cluster.num_actors)], placement)
    infos = ray.get([w.ready.remote() for w in workers])
    return workers, infos


def evaluate(crew, iteration: int, members: list[Member], cfg: TrainConfig, ids: tuple[int, ...]):
    """Score the members on the actors (member i on actor i % num_actors); a lost actor's members are scored
    again by its replacement."""
    seed = sample_seed(cfg, iteration)
    parts = assign(members, len(crew.workers))
    calls = {r: (EvalRequest(iteration, cfg.es.sigma, tuple(part), ids, seed),) for r, part in enumerate(parts)}
    results = crew.gather("evaluate", calls).values()
    by_index = {mr.index: mr for res in results for mr in res.members}
    timing: dict[str, float] = {}
    for res in results:  # actors run in parallel: report the slowest actor's time per phase
        for k, v in res.timing_s.items():
            timing[k] = max(timing.get(k, 0.0), v)
    return [by_index[m.index] for m in members], timing


def tell(crew, record: dict, members: list[Member], fitness_n: np.ndarray, cfg: TrainConfig):
    """Every actor applies the update; the replicas' checksums are compared (es.checksum_every)."""
    t = record["iteration"]
    every = cfg.es.checksum_every
    want = bool(every) and ((t + 1) % every == 0 or t + 1 == cfg.es.iterations)
    req = UpdateRequest(t, cfg.es.sigma, tuple(members), tuple(float(z) for z in fitness_n), want)
    out = crew.gather("update", {r: (req,) for r in range(len(crew.workers))})
    updates = [out[r] for r in range(len(crew.workers))]
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
        sums = crew.repair(sums, record)
    return updates, sums[0]


def run(cfg: TrainConfig) -> dict:
    import ray

    from es_ray.checkpoint import SeedLog
    from es_ray.recovery import InterruptGuard, Interrupted, Supervisor, resume_point

    if not cfg.cluster.address:  # fail fast on this machine; on a remote cluster the actors check
        from es_ray.models import resolve_model
        from es_ray.tasks import load_task

        resolve_model(cfg.model.path)  # also converts the embedded model once, before actors start
        load_task(cfg.task)
    point = resume_point(cfg)  # reads run.dir before anything is written there
    connect(cfg.cluster)
    run_dir = make_run_dir(cfg)
    tracker = Tracker(run_dir, cfg.es.iterations, cfg.run.tensorboard, cfg.run.progress)
    seed_log = SeedLog(run_dir / "seed_log.jsonl")
    workers: list = []
    crew = None
    summary: dict = {"run_dir": str(run_dir)}
    history = list(point.history)
    with InterruptGuard() as guard:
        try:
            workers, infos = start_workers(cfg)
            crew = Supervisor(cfg, workers, run_dir, tracker, point)
            crew.check_interrupt = guard.check
            pool = infos[0]["train_size"]
            tracker.message(f"es: {len(workers)} actor(s), training pool {pool}, held-out {infos[0]['eval_size']}, "
                            f"run dir {run_dir}")
            if point.note:
                tracker.message(point.note)
            if point.checkpoint or point.records:
                crew.rebuild_all()
            for t in range(point.start, cfg.es.iterations):
                row = iteration(cfg, crew, t, pool, seed_log, guard)
                if cfg.eval.every and ((t + 1) % cfg.eval.every == 0 or t == 0):
                    res = crew.gather("evaluate_center", {0: ("eval", sample_seed(cfg, -1))})[0]
                    row["eval/reward"], row["eval/tokens"] = res["reward"], res["tokens"]
                    row["timing_s/eval"] = res["seconds"]
                row.update(crew.drain_events())
                tracker.log(t, row)
                history.append(row)
                if cfg.run.checkpoint_every and (t + 1) % cfg.run.checkpoint_every == 0 and t + 1 < cfg.es.iterations:
                    crew.save_checkpoint(run_dir / "checkpoints" / f"iter_{t + 1:06d}", t + 1)
            final = crew.save_checkpoint(run_dir / "checkpoints" / "final", cfg.es.iterations)
            from es_ray.ledger import write_es_ledger  # the compute ledger (ledger.json), as grpo-train writes it

            rss = crew.gather("peak_memory_bytes", {r: () for r in range(len(crew.workers))})
            write_es_ledger(run_dir, history, rss, {"resumed_at_iteration": point.start})
            summary.update(final_checkpoint=str(final), iterations=cfg.es.iterations,
                           reward_mean=[h["reward/mean"] for h in history],
                           eval_reward=[h["eval/reward"] for h in history if "eval/reward" in h])
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            tracker.message(f"es: done; final checkpoint {final}")
            return summary
        except Interrupted as stop:
            _stop_cleanly(stop, crew, run_dir, tracker)
        finally:
            seed_log.close()
            tracker.close()
            for w in workers:
                ray.kill(w)
            if hasattr(workers, "release"):  # the placement group's reserved resources
                workers.release()


def _stop_cleanly(stop, crew, run_dir: Path, tracker) -> None:
    """After SIGTERM / Ctrl-C: stop the actors' work, checkpoint the committed iterations, exit non-zero.

    The seed log is already complete up to the last committed iteration (an update and its log line are never
    split by a signal), so resuming is exact even if a second signal cuts this checkpoint short.
    """
    name = signal.Signals(stop.signum).name
    done = crew.committed if crew is not None else 0
    saved = ""
    if crew is not None and done > crew.base[1]:
        crew.cancel_inflight()
        saved = str(crew.save_checkpoint(run_dir / "checkpoints" / f"iter_{done:06d}", done))
    tracker.message(f"es: stopped by {name} after {done} iteration(s); "
                    f"{'checkpoint ' + saved if saved else 'no new checkpoint needed'}; seed log "
                    f"{run_dir / 'seed_log.jsonl'}. Continue with: es-train run.resume=true run.dir={run_dir}")
    raise SystemExit(128 + stop.signum)


def _sigterm_as_exit() -> None:
    """`ray job stop` sends SIGTERM: turn it into SystemExit so the finally blocks close logs and kill actors."""
    import signal
    import threading

    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit)


def iteration(cfg: TrainConfig, crew, t: int, pool: int, seed_log, guard) -> dict:
    timer = Timer()
    t_start = time.perf_counter()
    members = ask(cfg.es.population, cfg.es.estimator)
    ids = prompt_ids(cfg, t, pool)
    if cfg.faults.interrupt_at_iteration == t:
        _interrupt_soon()
    with timer("evaluate"):
        results, actor_timing = evaluate(crew, t, members, cfg, ids)
    rewards_n = np.array([r.reward for r in results], dtype=np.float64)
    fitness_n = shape_fitness(rewards_n, cfg.es.shaping)
    record = {"iteration": t, "sigma": cfg.es.sigma, "lr": cfg.es.lr,
              "members": [[m.index, m.noise_id, m.sign] for m in members],
              "rewards": rewards_n.tolist(), "fitness": fitness_n.tolist()}
    with guard.critical():  # a signal waits until the update is applied and logged (replay needs both or none)
        with timer("update"):
            updates, checksum = tell(crew, record, members, fitness_n, cfg)
        record["checksum"] = checksum
        seed_log.append(record)
        crew.commit(record)
    tokens = sum(r.tokens for r in results)
    wall = time.perf_counter() - t_start
    row = {
        "reward/mean": float(rewards_n.mean()), "reward/std": float(rewards_n.std()),
        "reward/max": float(rewards_n.max()), "reward/min": float(rewards_n.min()),
        "reward/errors": int(sum(r.reward_errors for r in results)),
        "es/update_norm": updates[0].update_norm, "es/realised_cos": updates[0].realised_cos,
        "es/realised_norm": updates[0].realised_norm, "es/zero_update": bool(not np.any(fitness_n)),
        "es/checksums_verified": bool(checksum),
        "perf/tokens": tokens, "perf/tokens_per_s": tokens / max(timer.seconds["evaluate"], 1e-9),
        "completions/mean_length": tokens / max(1, len(results) * len(ids)),
        "timing_s/iteration": wall, "timing_s/update_actor": max(u.seconds for u in updates),
    }
    row.update({f"timing_s/{k}": v for k, v in timer.seconds.items()})
    row.update({f"timing_s/{k}": v for k, v in actor_timing.items()})
    return row


def _interrupt_soon(delay_s: float = 0.2) -> None:
    """faults.interrupt_at_iteration: SIGTERM to this process while the actors evaluate (as `ray job stop`)."""
    from es_ray.recovery import Interrupted

    if threading.current_thread() is not threading.main_thread():  # no handler here: interrupt directly
        raise Interrupted(signal.SIGTERM)
    threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGTERM)).start()
