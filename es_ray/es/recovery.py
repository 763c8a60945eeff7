"""Nothing lost, ES's side: exact resume, dead or odd actors rebuilt from the seed log.

The run is a pure function of (initial weights, config, seed log): the weights after iteration t are the last
checkpoint before t plus the logged updates since it, replayed in order. So

* resume (`run.resume=true`) starts every actor from the last checkpoint and replays the log since it;
* a dead actor (its process killed, its node lost, or silent past `faults.actor_timeout_s`) is replaced by the
  runtime's actor group (``es_ray.runtime.actors``); ``Replicas.restore`` then has the new actor read the same
  checkpoint from disk and replay the same records: only the records (integers and floats) cross the network,
  never a weight tensor; its checksum is checked against the log before its lost work is sent again;
* a replica whose checksum disagrees is stopped on (`es.on_mismatch=stop`) or rebuilt the same way (`rebuild`).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from es_ray.es.protocol import SeedRecord
from es_ray.es.state import SeedLog, list_checkpoints, replay_request
from es_ray.es.config import ESTrainConfig
from es_ray.es.worker import ESWorker
from es_ray.runtime.actors import ActorLostError, payload_bytes
from es_ray.runtime.checkpoint import CheckpointError
from es_ray.core.config import ConfigError
from es_ray.runtime.names import ES_ZERO_UPDATE, REWARD_MEAN, REWARD_STD
from es_ray.runtime.rundir import keep_metrics, write_metrics

# Settings that may change between a run and its resume besides the runtime's (es_ray.runtime.rundir.RESUME_FREE):
# none of them changes the weights.
RESUME_FREE = frozenset({"es.iterations", "es.checksum_every", "es.on_mismatch", "cluster.num_actors"})


class ReplicaMismatchError(RuntimeError):
    pass


@dataclass
class ResumePoint:
    """Where a run (re)starts: the checkpoint ('' = initial weights), the log records since it, and the rest."""

    start: int = 0
    checkpoint: str = ""
    checkpoint_iteration: int = 0
    records: list[dict] = field(default_factory=list)
    """Full seed-log records of iterations checkpoint_iteration .. start - 1."""
    history: list[dict] = field(default_factory=list)
    """metrics.jsonl rows of iterations < start."""
    checksum: str = ""
    """Master checksum after iteration start - 1 ('' when not logged)."""
    note: str = ""
    rebuilt: list[dict] = field(default_factory=list)
    """Rows of ``history`` that metrics.jsonl lacked, rebuilt from their seed-log lines (``rebuild_rows``)."""


def resume_point(cfg: ESTrainConfig, run_dir: Path) -> ResumePoint:
    """Read run.dir (its config.json already checked by ``open_run_dir``): the seed log (a torn last line is cut),
    the newest checkpoint it covers, the metrics."""
    log_path = run_dir / "seed_log.jsonl"
    if not cfg.run.resume:
        return ResumePoint()
    if not log_path.is_file():
        if list_checkpoints(run_dir):  # never start again from the initial weights past a checkpoint
            raise ConfigError(
                f"run.resume=true: {run_dir} holds checkpoints but no seed_log.jsonl, which names the "
                "iterations they hold; restore seed_log.jsonl, or start a new run.dir"
            )
        return ResumePoint(note=f"run.resume=true: nothing to resume in {run_dir}; starting a new run")
    try:
        records = SeedLog.recover(log_path)
    except ValueError as exc:
        raise ConfigError(f"run.resume=true: {exc}") from None
    start = len(records)
    if start > cfg.es.iterations:
        raise ConfigError(
            f"run.resume=true: {run_dir} already holds {start} iterations, more than "
            f"es.iterations={cfg.es.iterations}; raise es.iterations to at least {start}"
        )
    point = ResumePoint(start=start, checksum=records[-1].get("checksum", "") if records else "")
    for it, path, meta in list_checkpoints(run_dir):
        if it > start:
            continue
        logged = records[it - 1].get("checksum") if it else ""
        if logged and meta.get("checksum") and meta["checksum"] != logged:
            raise ConfigError(
                f"run.resume=true: checkpoint {path} (checksum {meta['checksum']}) does not match the "
                f"seed log at iteration {it - 1} ({logged}); it is not from this run"
            )
        point.checkpoint, point.checkpoint_iteration = str(path), it
        if it == start and not point.checksum:
            point.checksum = meta.get("checksum", "")
    point.records = records[point.checkpoint_iteration :]
    point.history, point.rebuilt = rebuild_rows(
        records, keep_metrics(run_dir / "metrics.jsonl", start, "iteration"), run_dir
    )
    if point.rebuilt:
        write_metrics(run_dir / "metrics.jsonl", point.history)
    src = point.checkpoint or "the initial weights"
    point.note = (
        f"es: resuming at iteration {start} of {cfg.es.iterations} from {src} (iteration "
        f"{point.checkpoint_iteration}) plus {len(point.records)} logged update(s) replayed"
    )
    return point


def seed_log_row(rewards_n, fitness_n, checksum: str) -> dict:
    """The entries of an iteration's metrics row its seed-log line determines (rewards, shaped fitness, checksum):
    what a resume rebuilds a lost row from."""
    rewards_n, fitness_n = np.asarray(rewards_n, dtype=np.float64), np.asarray(fitness_n, dtype=np.float64)
    return {
        REWARD_MEAN: float(rewards_n.mean()),
        REWARD_STD: float(rewards_n.std()),
        "reward/max": float(rewards_n.max()),
        "reward/min": float(rewards_n.min()),
        ES_ZERO_UPDATE: bool(not np.any(fitness_n)),
        "es/checksums_verified": bool(checksum),
    }


def rebuild_rows(records: list[dict], rows: list[dict], run_dir: Path) -> tuple[list[dict], list[dict]]:
    """metrics.jsonl's rows of the logged iterations, checked against the seed log: a row the log has and the metrics
    lack is rebuilt from its line (``seed_log_row``, marked resume/rebuilt, without tokens and timings, which only
    the lost row held); a row whose reward/mean is not its line's, or two rows for one iteration, is refused with
    the iterations named (the files are not of one run). Returns (every row in order, the rebuilt ones)."""
    by_it: dict[int, list[dict]] = {}
    for row in rows:
        by_it.setdefault(row.get("iteration"), []).append(row)
    twice = sorted(t for t, rs in by_it.items() if len(rs) > 1)
    differ = [
        t
        for t, rs in sorted(by_it.items())
        if t not in twice
        and REWARD_MEAN in rs[0]
        and t < len(records)
        and not math.isclose(rs[0][REWARD_MEAN], float(np.mean(records[t]["rewards"])), rel_tol=1e-9, abs_tol=1e-12)
    ]
    if twice or differ:
        why = "; ".join(
            x
            for x in (
                f"iterations {_shown(twice)} have two rows" if twice else "",
                f"iterations {_shown(differ)} give a reward/mean their seed-log lines do not "
                "(the mean of the logged rewards)"
                if differ
                else "",
            )
            if x
        )
        raise ConfigError(
            f"run.resume=true: {run_dir / 'metrics.jsonl'} disagrees with seed_log.jsonl: {why}; the "
            "files are not of one run. Restore the run's own metrics.jsonl, or move it aside (the "
            "resume then rebuilds every row the seed log holds)"
        )
    out, rebuilt = [], []
    for t, rec in enumerate(records):
        if t in by_it:
            out.append(by_it[t][0])
        else:
            row = {
                "iteration": t,
                **seed_log_row(rec["rewards"], rec["fitness"], rec.get("checksum", "")),
                "resume/rebuilt": True,
            }
            out.append(row)
            rebuilt.append(row)
    return out, rebuilt


def _shown(its: list[int]) -> str:
    return ", ".join(map(str, its[:8])) + (f" (and {len(its) - 8} more)" if len(its) > 8 else "")


# -- the replicas --------------------------------------------------------------------------------------------


class Replicas:
    """Knows the state every replica must be in, and brings actors back to it.

    That state is the base checkpoint plus the committed log records since it (and the master checksum there,
    when logged). ``restore`` is the actor group's hook for a replacement actor.
    """

    def __init__(self, run_dir: Path, tracker, point: ResumePoint):
        self.run_dir, self.tracker = Path(run_dir), tracker
        self.group = None
        self.base_checkpoint, self.base_iteration = point.checkpoint, point.checkpoint_iteration
        self.records = [replay_request(r) for r in point.records]
        self.checksum = point.checksum
        self.events: list[dict] = []

    @property
    def committed(self) -> int:
        """Iterations whose update every replica holds."""
        return self.base_iteration + len(self.records)

    def commit(self, record: SeedRecord) -> None:
        """Every replica has applied this seed-log record."""
        self.records.append(record.update_request())
        self.checksum = record.checksum or ""

    def save_checkpoint(self, path: Path, iteration: int) -> Path:
        if iteration != self.committed:
            raise RuntimeError(f"checkpoint of iteration {iteration} requested at iteration {self.committed}")
        ranks = self.group.live_ranks
        for rank in ranks:  # the first live actor writes it (at a stop, one whose node is lost is skipped)
            try:
                out = self.group.call(rank, ESWorker.save_checkpoint, str(path), {"iteration": iteration})
                if isinstance(out, dict):  # it applied an update the run did not commit: back to the committed state
                    self.rebuild([rank])
                    self.group.call(rank, ESWorker.save_checkpoint, str(path), {"iteration": iteration})
                break
            except ActorLostError:
                if rank == ranks[-1]:
                    raise
        self.base_checkpoint, self.base_iteration, self.records = str(path), iteration, []
        return path

    def rebuild(self, ranks: list[int], extra: list[SeedRecord] = ()) -> tuple[dict[int, dict], dict[int, int]]:
        """Rebuild these actors to the committed state plus ``extra`` records: results and bytes sent per rank."""
        checkpoint = self.base_checkpoint
        records = self.records + [r.update_request() for r in extra]
        calls = {r: (checkpoint, records) for r in ranks}
        sent = {r: payload_bytes(calls[r]) for r in ranks}
        out = self.group.gather(ESWorker.rebuild, calls, slow=True)
        refused = [res["refused"] for res in out.values() if "refused" in res]
        if refused:  # a checkpoint file failed its digest: stop, naming it (es_ray.runtime.checkpoint)
            raise CheckpointError(refused[0])
        unreadable = [r for r, res in out.items() if "unreadable" in res]
        if unreadable:  # that node cannot read run.dir: replay the whole log from the initial weights
            earlier = [replay_request(r) for r in SeedLog.read(self.run_dir / "seed_log.jsonl")[: self.base_iteration]]
            full = {r: ("", earlier + records) for r in unreadable}
            out.update(self.group.gather(ESWorker.rebuild, full, slow=True))
            for r in unreadable:
                sent[r] += payload_bytes(full[r])
        return out, sent

    def rebuild_all(self) -> None:
        """At resume: every fresh actor loads the base checkpoint and replays the records since it."""
        t0 = time.perf_counter()
        out, _ = self.rebuild(self.group.ranks)
        sums = {res["checksum"] for res in out.values()}
        if len(sums) > 1 or (self.checksum and sums != {self.checksum}):
            raise ReplicaMismatchError(
                f"resume: the replayed replicas' checksums {sorted(sums)} differ from each other or from the seed "
                f"log's ({self.checksum}), though {self.base_checkpoint or 'the initial weights'} and the seed log "
                "passed their digest checks: the replay itself differs; resume on the hardware type that wrote the log"
            )
        self.tracker.message(
            f"es: {len(out)} actor(s) rebuilt by replaying {len(self.records)} update(s) in "
            f"{time.perf_counter() - t0:.1f} s; checksum {sums.pop()} "
            f"{'matches the seed log' if self.checksum else '(not logged; checked next iteration)'}"
        )

    def restore(self, group, rank: int) -> dict:
        """The actor group's hook: a replacement actor rebuilt to the committed state, its checksum checked."""
        out, sent = self.rebuild([rank])
        res = out[rank]
        if self.checksum and res["checksum"] != self.checksum:
            raise ReplicaMismatchError(
                f"actor {rank}: the replacement rebuilt from the log has checksum {res['checksum']}, the replicas "
                f"have {self.checksum}, though the files it read passed their digest checks: replay is exact only "
                "on one hardware type"
            )
        self.tracker.message(
            f"es: actor {rank} rebuilt in {res['seconds']:.1f} s replaying {res['replayed']} update(s); "
            f"{sent[rank]} bytes sent against a {res['model_bytes']} byte model; checksum "
            f"{'verified' if self.checksum else 'checked at the next comparison'}"
        )
        return {
            "rebuild_seconds": res["seconds"],
            "replayed": res["replayed"],
            "bytes_sent": payload_bytes(group.make_args(rank)) + sent[rank],
            "model_bytes": res["model_bytes"],
            "checksum_verified": bool(self.checksum),
            "iteration": self.committed,
        }

    def repair(self, checksums: list[str], pending: SeedRecord) -> list[str]:
        """es.on_mismatch=rebuild: rebuild the actors outside the majority (without one, actor 0 first and then
        whoever disagrees with it) from the log, ``pending`` (this iteration's record) included."""
        t0 = time.perf_counter()
        sums = list(checksums)
        top, count = Counter(sums).most_common(1)[0]
        order = [r for r, c in enumerate(sums) if c != top] if count * 2 > len(sums) else list(range(len(sums)))
        truth = top if count * 2 > len(sums) else None
        rebuilt = []
        for rank in order:
            if truth is not None and sums[rank] == truth:
                continue
            out, _ = self.rebuild([rank], [pending])
            sums[rank] = out[rank]["checksum"]
            rebuilt.append(rank)
            truth = truth or sums[rank]
        if len(set(sums)) > 1:
            raise ReplicaMismatchError(
                f"iteration {pending.iteration}: replicas rebuilt from the log still "
                f"disagree ({sums}); the hardware is not deterministic"
            )
        event = {
            "kind": "rebuild",
            "ranks": rebuilt,
            "before": list(checksums),
            "after": sums[0],
            "seconds": time.perf_counter() - t0,
            "iteration": pending.iteration,
        }
        self.events.append(event)
        self.tracker.message(
            f"es: iteration {pending.iteration}: replica checksums differed {list(checksums)}; "
            f"rebuilt actor(s) {rebuilt} from the log in {event['seconds']:.1f} s (es.on_mismatch="
            f"rebuild); all now {sums[0]}"
        )
        return sums

    def drain_events(self) -> dict[str, Any]:
        """Metrics of this iteration's recoveries (recovery/*), and clears them."""
        ev = self.events + self.group.drain_events()
        self.events = []
        if not ev:
            return {}
        replaced = [e for e in ev if e["kind"] == "replace"]
        row: dict[str, Any] = {
            "recovery/replacements": len(replaced),
            "recovery/rebuilds": sum(len(e["ranks"]) for e in ev if e["kind"] == "rebuild"),
            "recovery/seconds": sum(e["seconds"] for e in ev),
        }
        if replaced:
            row["recovery/bytes_sent"] = sum(e["bytes_sent"] for e in replaced)
            row["recovery/model_bytes"] = replaced[0]["model_bytes"]
            row["recovery/replayed"] = sum(e["replayed"] for e in replaced)
        return row
