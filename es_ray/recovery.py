"""Nothing lost: exact resume, dead or odd actors rebuilt from the log, clean interrupts (the ES driver's side).

The run is a pure function of (initial weights, config, seed log): the weights after iteration t are the last
checkpoint before t plus the logged updates since it, replayed in order. So

* resume (`run.resume=true`) starts every actor from the last checkpoint and replays the log since it;
* a dead actor (its process killed, its node lost, or silent past `faults.actor_timeout_s`) is replaced by a new
  actor that reads the same checkpoint from disk and replays the same records: only the records (integers and
  floats) cross the network, never a weight tensor; its checksum is checked against the log, then its lost
  work is sent again;
* a replica whose checksum disagrees is stopped on (`es.on_mismatch=stop`) or rebuilt the same way (`rebuild`);
* SIGTERM / Ctrl-C interrupt the driver between phases, never between an update and its log line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import signal
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from es_ray.checkpoint import SeedLog, list_checkpoints, replay_record
from es_ray.config import ConfigError, TrainConfig

# Starting an actor and rebuilding it (loading a checkpoint, replaying) may take longer than an ordinary call.
SLOW_CALL_FLOOR_S = 900.0
# How often a waiting driver looks for SIGTERM / Ctrl-C.
POLL_S = 0.5

# Settings that may change between a run and its resume: none of them changes the weights.
RESUME_FREE = {"es.iterations", "es.checksum_every", "es.on_mismatch", "run.resume", "run.dir", "run.root",
               "run.checkpoint_every", "run.tensorboard", "run.progress", "cluster.address", "cluster.num_actors",
               "cluster.num_cpus", "cluster.placement", "cluster.wait_for_resources_s", "eval.every"}


class ReplicaMismatchError(RuntimeError):
    pass


class ActorLostError(RuntimeError):
    pass


class Interrupted(BaseException):
    """SIGTERM or SIGINT reached the driver (a BaseException, like KeyboardInterrupt, so nothing swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class InterruptGuard:
    """SIGTERM and SIGINT become Interrupted in the main thread at the next ``check()`` outside ``critical()``.

    The handler only records the signal: an exception raised inside Ray's blocking wait comes out as a
    SystemError, so the supervisor's wait loop polls ``check()`` instead. `ray job stop` sends SIGTERM (then
    SIGKILL after RAY_JOB_STOP_WAIT_TIME_S, 3 s by default).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self._depth, self._pending, self._previous = 0, 0, {}

    def __enter__(self) -> "InterruptGuard":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame) -> None:
        self._pending = signum

    def check(self) -> None:
        """Raise Interrupted if a signal came (and we are not inside ``critical()``)."""
        if self._pending and not self._depth:
            signum, self._pending = self._pending, 0
            raise Interrupted(signum)

    @contextmanager
    def critical(self):
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        self.check()


# -- resume ------------------------------------------------------------------------------------------------


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


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and not (prefix == "" and k == "hydra"):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_same_run(old: dict, new: TrainConfig) -> None:
    """Refuse a resume whose settings would change the weights (the keys both configs know)."""
    a, b = _flat(old), _flat(dataclasses.asdict(new))
    diff = [k for k in sorted(a.keys() & b.keys())
            if a[k] != b[k] and k not in RESUME_FREE and not k.startswith("faults.")]
    if diff:
        shown = "; ".join(f"{k}={b[k]!r} (the run used {a[k]!r})" for k in diff[:6])
        raise ConfigError(f"run.resume=true: these settings differ from the stopped run's config.json and would "
                          f"change its result: {shown}. Set them back, or start a new run.dir")


def resume_point(cfg: TrainConfig) -> ResumePoint:
    """Read run.dir: the seed log (a torn last line is cut), the newest checkpoint it covers, the metrics."""
    run_dir = Path(cfg.run.dir)
    log_path = run_dir / "seed_log.jsonl"
    if not cfg.run.resume:
        return ResumePoint()
    if not (run_dir / "config.json").is_file() or not log_path.is_file():
        return ResumePoint(note=f"run.resume=true: nothing to resume in {run_dir}; starting a new run")
    check_same_run(json.loads((run_dir / "config.json").read_text()), cfg)
    try:
        records = SeedLog.recover(log_path)
    except ValueError as exc:
        raise ConfigError(f"run.resume=true: {exc}") from None
    start = len(records)
    if start > cfg.es.iterations:
        raise ConfigError(f"run.resume=true: {run_dir} already holds {start} iterations, more than "
                          f"es.iterations={cfg.es.iterations}; raise es.iterations to at least {start}")
    point = ResumePoint(start=start, checksum=records[-1].get("checksum", "") if records else "")
    for it, path, meta in list_checkpoints(run_dir):
        if it > start:
            continue
        logged = records[it - 1].get("checksum") if it else ""
        if logged and meta.get("checksum") and meta["checksum"] != logged:
            raise ConfigError(f"run.resume=true: checkpoint {path} (checksum {meta['checksum']}) does not match the "
                              f"seed log at iteration {it - 1} ({logged}); it is not from this run")
        point.checkpoint, point.checkpoint_iteration = str(path), it
        if it == start and not point.checksum:
            point.checksum = meta.get("checksum", "")
    point.records = records[point.checkpoint_iteration:]
    point.history = _keep_metrics(run_dir / "metrics.jsonl", start)
    src = point.checkpoint or "the initial weights"
    point.note = (f"es: resuming at iteration {start} of {cfg.es.iterations} from {src} (iteration "
                  f"{point.checkpoint_iteration}) plus {len(point.records)} logged update(s) replayed")
    return point


def _keep_metrics(path: Path, start: int) -> list[dict]:
    """Drop metric rows of iterations that will run again; return the kept ones."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a torn last line
            continue
        if row.get("iteration", math.inf) < start:
            rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


# -- the supervisor ----------------------------------------------------------------------------------------


def payload_bytes(obj: Any) -> int:
    """Serialized size of what a call sends (Ray pickles arguments the same way)."""
    return len(pickle.dumps(obj, protocol=5))


class Supervisor:
    """Calls the ES actors and keeps them alive and equal.

    It knows the state every replica must be in: the base checkpoint plus the committed log records since it
    (and the master checksum there, when logged). ``workers`` is the driver's list; replacements go into it.
    """

    def __init__(self, cfg: TrainConfig, workers: list, run_dir: Path, tracker, point: ResumePoint):
        self.cfg, self.workers, self.run_dir, self.tracker = cfg, workers, Path(run_dir), tracker
        self.base = (point.checkpoint, point.checkpoint_iteration)
        self.records = [replay_record(r) for r in point.records]
        self.checksum = point.checksum
        self.replacements = 0
        self.events: list[dict] = []
        self._inflight: set = set()
        self.check_interrupt = lambda: None
        """Called while waiting on actors; the driver sets it to its InterruptGuard's check."""

    @property
    def committed(self) -> int:
        """Iterations whose update every replica holds."""
        return self.base[1] + len(self.records)

    # -- calls ---------------------------------------------------------------------------------------------
    def gather(self, method: str, calls: dict[int, tuple], slow: bool = False) -> dict[int, Any]:
        """Call ``method`` on the actors named by ``calls`` (rank -> args). An actor that dies, or stays silent
        past faults.actor_timeout_s (for a slow call, at least SLOW_CALL_FLOOR_S), is replaced, rebuilt to the
        committed state, and called again."""
        import ray

        timeout = self.cfg.faults.actor_timeout_s or math.inf
        if slow:
            timeout = max(timeout, SLOW_CALL_FLOOR_S)
        pending: dict = {}

        def send(rank: int) -> None:
            ref = getattr(self.workers[rank], method).remote(*calls[rank])
            pending[ref] = (rank, time.monotonic() + timeout)
            self._inflight.add(ref)

        for rank in calls:
            send(rank)
        out: dict[int, Any] = {}
        while pending:
            self.check_interrupt()
            wait = min(min(d for _, d in pending.values()) - time.monotonic(), POLL_S)
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, wait))
            if not ready:
                for ref, (rank, deadline) in list(pending.items()):
                    if deadline <= time.monotonic():
                        self._drop(pending, ref)
                        self._replace(rank, f"no answer to {method} within {timeout:g} s (faults.actor_timeout_s)")
                        send(rank)
                continue
            for ref in ready:
                rank, _ = self._drop(pending, ref)
                try:
                    out[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    self._replace(rank, f"{type(exc).__name__} during {method}")
                    send(rank)
        return out

    def _drop(self, pending: dict, ref) -> tuple:
        self._inflight.discard(ref)
        return pending.pop(ref)

    def cancel_inflight(self) -> None:
        """Ask running actor calls to stop early (evaluate checks between members); queued ones never run."""
        import ray

        for ref in list(self._inflight):
            try:
                ray.cancel(ref)
            except Exception:  # already finished or its actor gone: nothing to cancel
                pass
        self._inflight.clear()

    # -- state ---------------------------------------------------------------------------------------------
    def commit(self, record: dict) -> None:
        """Every replica has applied this seed-log record."""
        self.records.append(replay_record(record))
        self.checksum = record.get("checksum") or ""

    def save_checkpoint(self, path: Path, iteration: int) -> Path:
        if iteration != self.committed:
            raise RuntimeError(f"checkpoint of iteration {iteration} requested at iteration {self.committed}")
        self.gather("save_checkpoint", {0: (str(path), {"iteration": iteration})})
        self.base, self.records = (str(path), iteration), []
        return path

    def rebuild(self, ranks: list[int], extra: list[dict] = ()) -> tuple[dict[int, dict], dict[int, int]]:
        """Rebuild these actors to the committed state plus ``extra`` records: results and bytes sent per rank."""
        checkpoint = self.base[0]
        records = self.records + [replay_record(r) for r in extra]
        calls = {r: (checkpoint, records) for r in ranks}
        sent = {r: payload_bytes(calls[r]) for r in ranks}
        out = self.gather("rebuild", calls, slow=True)
        unreadable = [r for r, res in out.items() if "unreadable" in res]
        if unreadable:  # that node cannot read run.dir: replay the whole log from the initial weights
            earlier = [replay_record(r) for r in SeedLog.read(self.run_dir / "seed_log.jsonl")[: self.base[1]]]
            full = {r: ("", earlier + records) for r in unreadable}
            out.update(self.gather("rebuild", full, slow=True))
            for r in unreadable:
                sent[r] += payload_bytes(full[r])
        return out, sent

    def rebuild_all(self) -> None:
        """At resume: every fresh actor loads the base checkpoint and replays the records since it."""
        t0 = time.perf_counter()
        out, _ = self.rebuild(list(range(len(self.workers))))
        sums = {res["checksum"] for res in out.values()}
        if len(sums) > 1 or (self.checksum and sums != {self.checksum}):
            raise ReplicaMismatchError(
                f"resume: the replayed replicas' checksums {sorted(sums)} differ from each other or from the seed "
                f"log's ({self.checksum}); replay is exact only on the hardware type that wrote the log")
        self.tracker.message(f"es: {len(out)} actor(s) rebuilt by replaying {len(self.records)} update(s) in "
                             f"{time.perf_counter() - t0:.1f} s; checksum {sums.pop()} "
                             f"{'matches the seed log' if self.checksum else '(not logged; checked next iteration)'}")

    def _replace(self, rank: int, reason: str) -> None:
        import ray

        from es_ray.worker import ESWorker

        self.replacements += 1
        if self.replacements > self.cfg.faults.max_replacements:
            raise ActorLostError(
                f"actor {rank}: {reason}; faults.max_replacements={self.cfg.faults.max_replacements} actors were "
                f"already replaced. The seed log holds iterations 0..{self.committed - 1}: continue later with "
                f"run.resume=true run.dir={self.run_dir}")
        t0 = time.perf_counter()
        self.tracker.message(f"es: actor {rank} lost ({reason}); starting a replacement")
        try:
            ray.kill(self.workers[rank], no_restart=True)
        except Exception:  # already dead
            pass
        placement = getattr(self.workers, "placement", None)
        options = placement.options(rank) if placement is not None else {
            "num_cpus": self.cfg.cluster.cpus_per_actor, "num_gpus": self.cfg.cluster.gpus_per_actor}
        args = (self.cfg, rank, self.committed)  # immune to the injected faults of the iteration in progress
        self.workers[rank] = ray.remote(ESWorker).options(max_concurrency=1, **options).remote(*args)
        self.gather("ready", {rank: ()}, slow=True)
        started = time.perf_counter() - t0
        out, sent = self.rebuild([rank])
        res = out[rank]
        if self.checksum and res["checksum"] != self.checksum:
            raise ReplicaMismatchError(
                f"actor {rank}: the replacement rebuilt from the log has checksum {res['checksum']}, the replicas "
                f"have {self.checksum}; replay is exact only on one hardware type")
        event = {"kind": "replace", "rank": rank, "reason": reason, "seconds": time.perf_counter() - t0,
                 "start_seconds": started, "rebuild_seconds": res["seconds"], "replayed": res["replayed"],
                 "bytes_sent": payload_bytes(args) + sent[rank], "model_bytes": res["model_bytes"],
                 "checksum_verified": bool(self.checksum), "iteration": self.committed}
        self.events.append(event)
        self.tracker.message(
            f"es: actor {rank} replaced in {event['seconds']:.1f} s (start {started:.1f} s, rebuild "
            f"{res['seconds']:.1f} s replaying {res['replayed']} update(s)); {event['bytes_sent']} bytes sent against "
            f"a {res['model_bytes']} byte model; checksum "
            f"{'verified' if self.checksum else 'checked at the next comparison'}")

    def repair(self, checksums: list[str], pending: dict) -> list[str]:
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
            raise ReplicaMismatchError(f"iteration {pending['iteration']}: replicas rebuilt from the log still "
                                       f"disagree ({sums}); the hardware is not deterministic")
        event = {"kind": "rebuild", "ranks": rebuilt, "before": list(checksums), "after": sums[0],
                 "seconds": time.perf_counter() - t0, "iteration": pending["iteration"]}
        self.events.append(event)
        self.tracker.message(f"es: iteration {pending['iteration']}: replica checksums differed {list(checksums)}; "
                             f"rebuilt actor(s) {rebuilt} from the log in {event['seconds']:.1f} s (es.on_mismatch="
                             f"rebuild); all now {sums[0]}")
        return sums

    def drain_events(self) -> dict[str, Any]:
        """Metrics of this iteration's recoveries (recovery/*), and clears them."""
        if not self.events:
            return {}
        ev, self.events = self.events, []
        replaced = [e for e in ev if e["kind"] == "replace"]
        row: dict[str, Any] = {"recovery/replacements": len(replaced),
                               "recovery/rebuilds": sum(len(e["ranks"]) for e in ev if e["kind"] == "rebuild"),
                               "recovery/seconds": sum(e["seconds"] for e in ev)}
        if replaced:
            row["recovery/bytes_sent"] = sum(e["bytes_sent"] for e in replaced)
            row["recovery/model_bytes"] = replaced[0]["model_bytes"]
            row["recovery/replayed"] = sum(e["replayed"] for e in replaced)
        return row
