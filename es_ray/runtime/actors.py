"""ONE actor group for every role (ES actors, GRPO learner and rollouts, es-eval actors).

Roles differ in what they compute, not in how they are placed, called, timed out and replaced:

* placement: actor i of a group sits in bundle ``first_bundle + i`` of the run's placement group
  (``es_ray.runtime.placement``: the fit is checked before any actor starts);
* ``gather(method, {rank: args})``: calls run in parallel; while waiting, the driver's interrupt check is polled;
  an actor whose process dies (Ray says so at once: ``is_lost_actor``, its memory monitor's kill and a lost node
  included) or that stays silent past ``faults.actor_timeout_s`` is
  killed, replaced in the same bundle, brought back to the group's state by the role's ``restore`` hook, and
  called again (its request is a pure function of the step, so its answer is the one it would have given);
* a call that fails with Ray's ActorUnavailableError (transient) is sent again up to
  ``faults.unavailable_retries`` times (1, 2, 4 ... s apart) before its actor counts as dead; a method marked
  ``@once`` (not safe to run twice: GRPO's optimizer step) is never sent again;
* a replacement that Ray cannot place within ``faults.placement_timeout_s`` (its node lost, no spare capacity)
  raises PlacementTimeoutError: the run stops with a checkpoint from a live actor (``live_ranks``);
* a group that must not be replaced (GRPO's learner) raises ActorLostError with the role's resume advice;
* ``kill()`` ends the actors and frees the placement group.

Ray, torch and numpy are imported inside the methods, so this module imports without them.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import time
from typing import Any, Callable

from es_ray.core.config import FaultPolicy
from es_ray.core.dtypes import dtype_name
from es_ray.runtime.cluster import quiet_third_party
from es_ray.runtime.ledger import process_peak_memory

# Starting an actor and restoring it (loading a checkpoint, replaying a log) may take longer than an ordinary call.
SLOW_CALL_FLOOR_S = 900.0
# How often a waiting driver looks for SIGTERM / Ctrl-C.
POLL_S = 0.5


class ActorLostError(RuntimeError):
    """An actor died and the run cannot replace it (its role forbids it, or faults.max_replacements is spent)."""

    exit_code = 75  # EX_TEMPFAIL: try again later (run.resume=true)


class PlacementTimeoutError(ActorLostError):
    """A replacement actor could not be placed within faults.placement_timeout_s."""


class ActorStartError(RuntimeError):
    """An actor's constructor raised (a model it cannot load, an engine with no memory for its cache): the actor's
    own error, which a replacement would raise again, so it is never retried."""


def is_lost_actor(exc: BaseException) -> bool:
    """Whether a call's error means its actor's process (or its node) is gone, not that the actor's code raised:
    the actor died (RayActorError), Ray's memory monitor killed its worker (OutOfMemoryError), its node died
    (NodeDiedError), its worker crashed (WorkerCrashedError), or the result was lost with its node
    (ObjectLostError). Each is answered the same way: the actor is replaced and the call sent again. An actor
    whose constructor raised (Ray's ActorDiedError with ``actor_init_failed``) is not lost: ``init_failure``."""
    import ray

    e = ray.exceptions
    return isinstance(
        exc, (e.RayActorError, e.OutOfMemoryError, e.NodeDiedError, e.WorkerCrashedError, e.ObjectLostError)
    ) and not init_failure(exc)


def init_failure(exc: BaseException) -> str:
    """The error an actor's constructor raised, on one line ('ValueError: ...', the last line of the traceback Ray
    puts in its ActorDiedError: the exception itself is not kept); '' for any other error."""
    if not getattr(exc, "actor_init_failed", False):
        return ""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(exc).__name__


def memory_advice(tokens_key: str = "sampling.max_new_tokens") -> str:
    """What lowers a memory kill, naming the keys of the command whose actors were killed (``tokens_key``: its
    completion length, e.g. es-eval's eval.max_new_tokens)."""
    return (
        f"lower it with cluster.num_actors= (each actor holds its own model copy) or a shorter {tokens_key}=, "
        "or free memory on that node (Ray kills a worker above RAY_memory_usage_threshold, 0.95 of the node's "
        "memory by default)"
    )


def memory_kill_note(text: str) -> str:
    """What Ray's memory monitor says about a kill, on one line: the node's memory against its threshold, the
    killed worker's pid and use, and the largest users (its "Top 10 memory users" table, first three). Missing
    parts are left out. ``text``: the OutOfMemoryError's message as Ray writes it."""
    flat = " ".join(text.split())
    parts = []
    node = re.search(r"was ([\d.]+\s*[KMGT]?B) / ([\d.]+\s*[KMGT]?B) \(([\d.]+)\)", flat)
    if node:
        parts.append(f"node memory {node[1]} of {node[2]} ({float(node[3]):.0%})")
    limit = re.search(r"threshold of ([\d.]*\d)", flat)
    if limit:
        parts.append(f"threshold {limit[1]}")
    killed = re.search(r"pid=(\d+), memory used=([\d.]+\s*[KMGT]?B)", flat)
    if killed:
        parts.append(f"the killed worker pid {killed[1]} used {killed[2]}")
    table = text.split("Top 10 memory users:", 1)
    if len(table) == 2:
        rows = [r.split("\t") if "\t" in r else r.split(None, 2) for r in table[1].strip().splitlines()[1:4]]
        top = [
            f"pid {r[0].strip()} {r[1].strip()} GB {r[2].strip()[:40]}"
            for r in rows
            if len(r) >= 3 and r[0].strip().isdigit()
        ]
        if top:
            parts.append("largest: " + "; ".join(top))
    return "; ".join(parts)


def lost_reason(exc: BaseException, method: str, tokens_key: str = "sampling.max_new_tokens") -> str:
    """Why an actor counts as lost (``is_lost_actor``), for the replacement's log line and the ledger; a memory kill
    says which process used what and which key lowers it (``memory_advice``)."""
    import ray

    name = type(exc).__name__.replace("RayTaskError(", "").rstrip(")")
    if isinstance(exc, ray.exceptions.OutOfMemoryError):
        note = memory_kill_note(str(getattr(exc, "cause", None) or exc))
        return (
            f"killed by Ray's memory monitor during {method} ({note or 'OutOfMemoryError'}); "
            f"{memory_advice(tokens_key)}"
        )
    return f"{name} during {method}"


def once(method: Callable) -> Callable:
    """Mark an actor method that must not run twice for one request (it is never re-sent after a transient
    ActorUnavailableError, which leaves unknown whether it ran)."""
    method.__es_ray_once__ = True
    return method


def payload_bytes(obj: Any) -> int:
    """Serialized size of what a call sends (Ray pickles arguments the same way)."""
    return len(pickle.dumps(obj, protocol=5))


class Tensors(dict):
    """Named tensors (a dict of them) that Ray moves as NumPy views of their bytes: pickle protocol 5 sends a
    NumPy array's buffer out of band (one copy into the object store, none out of it), where a torch tensor's
    storage is pickled into the stream. A sync of the CPU demo model's 538 MB of fp32 weights between two actors,
    a layer a call, took under half the time this way as pickled torch tensors (the bytes are copied once, not pickled
    into the stream and copied out again; bf16 about the same either way). In-process it is the dict it holds; the
    receiver gets ordinary CPU tensors of its own (writable), bit for bit the sender's, dtype and shape sent beside the
    bytes (bfloat16, which NumPy lacks, included)."""

    def __reduce__(self):
        import torch

        names = list(self)
        tensors = [self[n].detach().to("cpu").resolve_conj().resolve_neg().contiguous() for n in names]
        return _tensors_from_bytes, (
            names,
            [dtype_name(t.dtype) for t in tensors],
            [tuple(t.shape) for t in tensors],
            [t.reshape(-1).view(torch.uint8).numpy() for t in tensors],
        )


def _tensors_from_bytes(names: list, dtypes: list, shapes: list, arrays: list) -> Tensors:
    """Each tensor allocated here and its bytes copied in (an empty one has none: NumPy gives it stride 0, which
    a dtype view refuses)."""
    import numpy as np
    import torch

    out = Tensors()
    for name, dtype, shape, array in zip(names, dtypes, shapes, arrays):
        t = out[name] = torch.empty(shape, dtype=getattr(torch, dtype))
        if t.numel():
            np.copyto(t.view(-1).view(torch.uint8).numpy(), array)
    return out


def actor_threads(engine, cluster) -> int:
    """An actor's torch threads: engine.threads, else its cluster.cpus_per_actor (at least one)."""
    return engine.threads or max(1, int(cluster.cpus_per_actor or 1))


PROGRESS_NAMESPACE = "es_ray_progress"
"""Ray's GCS key-value namespace of ``report_progress``: one key per actor of a driver's job, a few bytes each."""


def _progress_key(rank: int) -> str:
    import ray

    return f"{ray.get_runtime_context().get_job_id()}/{rank}"


def report_progress(rank: int, step: int, done: int) -> None:
    """Inside an actor: ``done`` parts of its call for step ``step`` are finished (ES: members scored), for the
    driver's progress bar (``read_progress``). A few bytes in Ray's GCS key-value store, overwritten in place; never
    a result or a weight. Outside Ray, or where the store cannot be reached, nothing happens (it is only a display)."""
    try:
        import ray

        if not ray.is_initialized():
            return
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(_progress_key(rank), f"{step} {done}", overwrite=True, namespace=PROGRESS_NAMESPACE)
    except Exception:  # noqa: BLE001 - a display: never the reason a call fails
        pass


def read_progress(ranks: list[int], step: int) -> dict[int, int]:
    """On the driver: what each of these actors last reported for step ``step`` (absent: nothing yet)."""
    out: dict[int, int] = {}
    try:
        from ray.experimental.internal_kv import _internal_kv_get

        for rank in ranks:
            raw = _internal_kv_get(_progress_key(rank), namespace=PROGRESS_NAMESPACE)
            if raw:
                at, done = (int(x) for x in raw.decode().split())
                if at == step:
                    out[rank] = done
    except Exception:  # noqa: BLE001 - a display: never the reason a run fails
        pass
    return out


def clear_progress(ranks: list[int]) -> None:
    """Drop the actors' progress keys (their group is ending: a long-lived cluster keeps none)."""
    try:
        from ray.experimental.internal_kv import _internal_kv_del

        for rank in ranks:
            _internal_kv_del(_progress_key(rank), namespace=PROGRESS_NAMESPACE)
    except Exception:  # noqa: BLE001
        pass


def sweep_progress() -> None:
    """On the driver, as a group starts: drop the progress keys of jobs that are over. A driver killed by SIGKILL
    never calls ``clear_progress``, and a long-lived cluster would keep its actors' keys for good.

    Over means marked dead ("IsDead") in the GCS job table (``ray._private.state``'s ``job_table``: no dashboard
    needed), whose "JobID" is the hex ``get_job_id()`` gives; the GCS marks a driver's job dead once the driver is
    gone, however it ended. Another driver's job running on the same cluster is not, and a job the table does not
    list keeps its keys too: only a job Ray says is over loses them. Best-effort, as the other progress helpers: where
    the table cannot be read (a Ray Client driver) the keys stay, and no run fails here."""
    try:
        from ray._private.state import state
        from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_list

        jobs = {key.decode().split("/")[0] for key in _internal_kv_list("", namespace=PROGRESS_NAMESPACE)}
        if not jobs:
            return
        for job in jobs & {j["JobID"] for j in state.job_table() if j["IsDead"]}:
            _internal_kv_del(f"{job}/", del_by_prefix=True, namespace=PROGRESS_NAMESPACE)
    except Exception:  # noqa: BLE001
        pass


class Actor:
    """What every actor class shares: the process set-up (its torch threads; no tokenizers thread pool beside
    them) and the calls the runtime makes on any actor, ``ready`` (the group waits for it after start) and
    ``peak_memory`` (the ledger's). Subclasses add their role's methods and extend ``ready``'s answer."""

    def __init__(self, rank: int, threads: int):
        import torch

        quiet_third_party()  # run.verbose=false: before the role imports vLLM, whose import prints otherwise
        torch.set_num_threads(threads)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.rank = rank

    def ready(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid()}

    def peak_memory(self) -> dict:
        return process_peak_memory()


class ActorGroup:
    """The actors of one role, by rank.

    ``make_args(rank)`` gives a (new) actor's constructor arguments, ``restore(group, rank)`` brings a replacement
    to the group's current state and returns what to log about it (or None); ``lost_advice`` ends the error when an
    actor cannot be replaced; ``tokens_key``: the command's completion-length key, named by a memory kill's advice.
    """

    def __init__(
        self,
        role: str,
        cls: type,
        size: int,
        make_args: Callable[[int], tuple],
        placement,
        policy: FaultPolicy,
        *,
        first_bundle: int = 0,
        log: Callable[[str], None] = print,
        restore: Callable[["ActorGroup", int], dict | None] | None = None,
        replaceable: bool = True,
        lost_advice: str = "",
        check_interrupt: Callable[[], None] = lambda: None,
        tokens_key: str = "sampling.max_new_tokens",
    ):
        import ray

        sweep_progress()  # the keys of drivers that were killed before they could clear theirs
        self.role, self.placement, self.policy, self.log = role, placement, policy, log
        self.first_bundle, self.make_args, self.restore = first_bundle, make_args, restore
        self.replaceable, self.lost_advice, self.tokens_key = replaceable, lost_advice, tokens_key
        self.check_interrupt = check_interrupt
        """Called while waiting on actors; the driver sets it to its InterruptGuard's check."""
        self.replacements = 0
        self.lost: set[int] = set()
        """Ranks whose actor is gone and could not be replaced."""
        self.events: list[dict] = []
        self._inflight: set = set()
        self._once = {name for name in dir(cls) if getattr(getattr(cls, name, None), "__es_ray_once__", False)}
        self.cls = cls
        """The actors' Python class: calls name its methods (``ESWorker.evaluate``), checked against it."""
        self._cls = ray.remote(cls)
        self.created_at = time.perf_counter()
        self.actors = [self._new(rank) for rank in range(size)]

    def _new(self, rank: int):
        opts = self.placement.options(self.first_bundle + rank)
        return self._cls.options(max_concurrency=1, **opts).remote(*self.make_args(rank))

    def __len__(self) -> int:
        return len(self.actors)

    def __getitem__(self, rank: int):
        return self.actors[rank]

    def __iter__(self):
        return iter(self.actors)

    @property
    def ranks(self) -> list[int]:
        return list(range(len(self.actors)))

    @property
    def live_ranks(self) -> list[int]:
        """Ranks whose actor was not given up on (``lost``), in order."""
        return [r for r in self.ranks if r not in self.lost]

    # -- calls ---------------------------------------------------------------------------------------------
    def method_name(self, method: Callable) -> str:
        """The actor method a call names, given as a method reference (``ESWorker.evaluate``, ``Actor.ready``) so a
        renamed method fails where it is referenced; refused here, before anything is sent, when it is a string or
        the actors' class has no method of that name (a learner group's class may be GRPOLearner or the colocated
        worker, which exposes the learner's methods under their names)."""
        name = getattr(method, "__name__", None)
        if isinstance(method, str) or not callable(method) or name is None:
            raise TypeError(
                f"{self.role} actors are called with a method of their class (e.g. "
                f"{self.cls.__name__}.ready), not {method!r}"
            )
        if not callable(getattr(self.cls, name, None)):
            raise TypeError(
                f"{getattr(method, '__qualname__', name)}: the {self.role} actors' class "
                f"{self.cls.__name__} has no method {name}"
            )
        return name

    def gather(
        self,
        method: Callable,
        calls: dict[int, tuple],
        slow: bool = False,
        waiting: Callable[[dict[int, Any]], None] | None = None,
    ) -> dict[int, Any]:
        """Call ``method`` on the actors named by ``calls`` (rank -> args); results by rank. A dead or silent
        actor is replaced, restored and called again (for a slow call the timeout is at least SLOW_CALL_FLOOR_S).
        ``waiting(results so far)`` is called as each result comes and while the driver waits (every POLL_S): a
        progress display's hook."""
        todo, name = dict(calls), self.method_name(method)
        out: dict[int, Any] = {}
        for rank, _, res in self._drive(
            name,
            lambda rank: todo.pop(rank, None),
            list(calls),
            slow,
            (lambda: waiting(out)) if waiting is not None else None,
        ):
            out[rank] = res
            if waiting is not None:
                waiting(out)
        return out

    def map_unordered(self, method: Callable, args_list: list[tuple], slow: bool = False):
        """Spread calls over the actors, each actor taking the next as soon as it is free; yields (args, result)
        in the order they finish. A lost actor's call is sent again to its replacement."""
        queue, name = list(reversed(args_list)), self.method_name(method)
        for _, args, res in self._drive(name, lambda rank: queue.pop() if queue else None, self.ranks, slow):
            yield args, res

    def _drive(
        self,
        method: str,
        take: Callable[[int], tuple | None],
        ranks: list[int],
        slow: bool,
        tick: Callable[[], None] | None = None,
    ):
        """The one wait loop: ``take(rank)`` gives a free actor its next arguments (None: nothing more for it);
        ``tick()`` once a poll while waiting."""
        import ray

        timeout = self.policy.actor_timeout_s or math.inf
        if slow:
            timeout = max(timeout, SLOW_CALL_FLOOR_S)
        pending: dict = {}

        def send(rank: int, args: tuple | None) -> None:
            if args is None:
                return
            ref = getattr(self.actors[rank], method).remote(*args)
            pending[ref] = (rank, args, time.monotonic() + timeout)
            self._inflight.add(ref)

        unavailable: dict[int, int] = {}
        for rank in ranks:
            send(rank, take(rank))
        while pending:
            self.check_interrupt()
            wait = min(min(d for _, _, d in pending.values()) - time.monotonic(), POLL_S)
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, wait))
            if not ready and tick is not None:
                tick()
            if not ready:
                for ref, (rank, args, deadline) in list(pending.items()):
                    if deadline <= time.monotonic():
                        self._drop(pending, ref)
                        self.replace(rank, f"no answer to {method} within {timeout:g} s (faults.actor_timeout_s)")
                        send(rank, args)
                continue
            for ref in ready:
                rank, args, _ = self._drop(pending, ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.ActorUnavailableError as exc:
                    tries = unavailable[rank] = unavailable.get(rank, 0) + 1
                    if tries > self.policy.unavailable_retries or method in self._once:
                        self.replace(
                            rank,
                            f"{type(exc).__name__} during {method}"
                            + (f", {tries - 1} retries" if method not in self._once else " (not safe to send again)"),
                        )
                    else:
                        self.log(
                            f"{self.role}: actor {rank} unavailable during {method}; retry {tries} of "
                            f"{self.policy.unavailable_retries} (faults.unavailable_retries)"
                        )
                        self._sleep(2.0 ** (tries - 1))
                    send(rank, args)
                    continue
                except ray.exceptions.RayError as exc:  # the actor's own error (a RayTaskError) is raised as it is
                    why = init_failure(exc)
                    if why:
                        self._retire(rank)
                        raise ActorStartError(f"the {self.role} actor {rank} raised while starting: {why}") from None
                    if not is_lost_actor(exc):
                        raise
                    self.replace(rank, lost_reason(exc, method, self.tokens_key))
                    send(rank, args)
                    continue
                yield rank, args, result
                send(rank, take(rank))

    def _sleep(self, seconds: float) -> None:
        """Wait, still answering SIGTERM / Ctrl-C."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.check_interrupt()
            time.sleep(min(POLL_S, max(0.0, end - time.monotonic())))

    def call(self, rank: int, method: Callable, *args: Any, slow: bool = False) -> Any:
        return self.gather(method, {rank: args}, slow=slow)[rank]

    def each(self, method: Callable, *args: Any, slow: bool = False) -> list:
        """The same call on every actor; results in rank order."""
        out = self.gather(method, {r: args for r in self.ranks}, slow=slow)
        return [out[r] for r in self.ranks]

    def send_all(self, method: Callable, *args: Any) -> list:
        """``method(*args)`` sent to every actor at once, without waiting: their ObjectRefs, in rank order, for
        pipelined calls whose results another call consumes (the GRPO learner's weight chunks, cast while the
        engines write the previous one). No timeout or replacement here: ``ray.get`` on them raises what failed."""
        name = self.method_name(method)
        return [getattr(a, name).remote(*args) for a in self.actors]

    def ask_all(self, method: Callable, timeout_s: float = 60.0) -> list:
        """``method()`` on every actor, without replacing any: an actor that is gone or silent answers None
        (for reports at the end of a run, which may be ending because an actor was lost)."""
        import ray

        name = self.method_name(method)
        refs = [getattr(a, name).remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref) if ref in ready else None)
            except ray.exceptions.RayError:
                out.append(None)
        return out

    def _drop(self, pending: dict, ref) -> tuple:
        self._inflight.discard(ref)
        return pending.pop(ref)

    def cancel_inflight(self) -> None:
        """Ask running calls to stop early (ES evaluation checks between members); queued ones never run."""
        import ray

        for ref in list(self._inflight):
            try:
                ray.cancel(ref)
            except Exception:  # already finished or its actor gone: nothing to cancel
                pass
        self._inflight.clear()

    # -- replacement -----------------------------------------------------------------------------------------
    def replace(self, rank: int, reason: str) -> None:
        """Kill actor ``rank``, start a new one in its bundle, wait until it is ready, then ``restore`` it."""
        if not self.replaceable:
            self._kill_one(rank)
            self.lost.add(rank)
            raise ActorLostError(f"the {self.role} actor {rank} was lost ({reason}); {self.lost_advice}")
        self.replacements += 1
        if self.replacements > self.policy.max_replacements:
            self.lost.add(rank)
            raise ActorLostError(
                f"{self.role} actor {rank}: {reason}; faults.max_replacements="
                f"{self.policy.max_replacements} actors were already replaced. {self.lost_advice}"
            )
        t0 = time.perf_counter()
        self.log(f"{self.role}: actor {rank} lost ({reason}); starting a replacement")
        self._kill_one(rank)
        self.actors[rank] = self._new(rank)
        self._wait_ready(rank)
        started = time.perf_counter() - t0
        event = {"kind": "replace", "role": self.role, "rank": rank, "reason": reason, "start_seconds": started}
        event.update((self.restore(self, rank) if self.restore is not None else None) or {})
        event["seconds"] = time.perf_counter() - t0
        self.events.append(event)
        self.log(f"{self.role}: actor {rank} replaced in {event['seconds']:.1f} s (start {started:.1f} s)")

    def _wait_ready(self, rank: int) -> None:
        """Until the new actor of ``rank`` answers ready(). While the run's placement group is not whole (Ray
        re-reserving a lost node's bundle elsewhere, if it can) the clock is faults.placement_timeout_s, past which
        the replacement is given up (PlacementTimeoutError); once placed, the actor may load as long as a slow call."""
        import ray

        limit = self.policy.placement_timeout_s or math.inf
        slow = max(self.policy.actor_timeout_s or math.inf, SLOW_CALL_FLOOR_S)
        ref, unplaced, t0 = self.actors[rank].ready.remote(), 0.0, time.monotonic()
        while True:
            self.check_interrupt()
            t = time.monotonic()
            ready, _ = ray.wait([ref], timeout=POLL_S)
            if ready:
                break
            state = self.placement.state()
            unplaced = unplaced + time.monotonic() - t if state not in ("CREATED", "") else 0.0
            if unplaced > limit or time.monotonic() - t0 > slow:
                self._kill_one(rank)
                self.lost.add(rank)
                if unplaced > limit:
                    raise PlacementTimeoutError(
                        f"{self.role} actor {rank}: its replacement could not be placed within "
                        f"faults.placement_timeout_s={limit:g} s (the placement group stays {state}: no node has its "
                        f"resources free). {self.lost_advice}"
                    )
                raise ActorLostError(
                    f"{self.role} actor {rank}: its replacement did not start within {slow:g} s. {self.lost_advice}"
                )
        try:
            ray.get(ref)
        except ray.exceptions.RayError as exc:
            why = init_failure(exc)
            if why:  # the run stops (its steps saved) rather than start the same failure again
                self._retire(rank)
                raise ActorLostError(
                    f"{self.role} actor {rank}: its replacement raised while starting ({why}). {self.lost_advice}"
                ) from None
            if not is_lost_actor(exc):
                raise
            self.replace(rank, lost_reason(exc, "start", self.tokens_key))

    def _retire(self, rank: int) -> None:
        """An actor whose constructor raised: killed and counted lost, never replaced."""
        self._kill_one(rank)
        self.lost.add(rank)

    def _kill_one(self, rank: int) -> None:
        import ray

        try:
            ray.kill(self.actors[rank], no_restart=True)
        except Exception:  # already dead
            pass

    def drain_events(self) -> list[dict]:
        ev, self.events = self.events, []
        return ev

    def kill(self) -> None:
        for rank in self.ranks:
            self._kill_one(rank)
        clear_progress(self.ranks)


def start_group(
    role: str, cls: type, size: int, make_args: Callable[[int], tuple], placement, policy: FaultPolicy, **kw: Any
) -> tuple[ActorGroup, list[dict]]:
    """An ActorGroup whose actors have all answered ``ready()`` (a slow call: they load their models)."""
    group = ActorGroup(role, cls, size, make_args, placement, policy, **kw)
    infos = group.each(Actor.ready, slow=True)
    return group, infos
