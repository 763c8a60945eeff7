"""ONE compute ledger, filled by the same code for every method: what a run cost, measured, not estimated.

Written to run.dir/ledger.json by the driver, after every step and at the end, so a run killed without warning
keeps what it had spent. ONE ledger per run: a resumed run adds a segment per start (run.resume=true) and the
top-level figures are the sums over the segments, so a preempted run's compute is what it really cost. Every
field, for ES and GRPO alike:

    method, finished, start_step          the method; whether the last segment ran to its end; the iteration/step
                                          the run started from (0)
    steps                                 iterations / steps the run holds (the last segment's end)
    steps_computed                        iterations / steps run by all segments (re-done ones counted again)
    wall_s                                driver start (before Ray connects) to the ledger's write, summed
    startup_s                             of which: connecting, placing and starting the actors (model loads)
    phase_seconds                         per phase, summed over steps (the metrics' timing_s/<phase>)
    tokens_generated                      every sampled token (training; held-out scoring counted apart)
    tokens_generated_eval                 held-out scoring during training (eval.every)
    tokens_backpropagated                 prompt + completion tokens through a backward pass (GRPO; ES: 0)
    device_kind, device_seconds           per actor, the devices it holds (gpus_per_actor GPUs, or on a CPU-only
                                          actor its cpus_per_actor cores) times the seconds it was held (from
                                          its creation to the end of the run), summed over actors: GPU-seconds
                                          on GPU, core-seconds on CPU; a replaced actor's time is counted from
                                          its group's start
    device_seconds_training               of which: the training steps, what budgets count and compare
    device_seconds_apart                  of which, apart: start-up (actors held before ``started``), and the
                                          spans the driver marks with ``apart`` (checkpoint writes, held-out
                                          scoring)
    stop_reason                           why the run stopped before its last step ('' if it did not)
    actors                                per actor (of the last segment): role, devices, seconds held, peak RSS
                                          bytes (ru_maxrss) and peak GPU bytes (torch.cuda.max_memory_allocated;
                                          null without CUDA)
    peak_rss_bytes_max, peak_gpu_bytes_max, replacements   (over every segment)
    segments                              per start of the driver: start_step, end_step, started_at / ended_at
                                          (UTC), stop (finished, the budget, the signal, the lost actor, or
                                          "killed" where it ended without a word), its own figures as above, and
                                          per recorded step its tokens and training device-seconds; steps no
                                          ledger recorded (ledger.json lost or torn, a kill between a step's
                                          commit and its ledger write) form a segment marked ``rebuilt``, from
                                          their metrics rows (tokens, no device-seconds), and the resume says so
    redone                                the work done twice: the steps a segment recorded past the point the
                                          next one resumed from (GRPO: past its last checkpoint), with their
                                          tokens and training device-seconds; an uninterrupted run costs the
                                          totals less these (and less the unrecorded part of an interrupted step,
                                          ``unrecorded_device_seconds``: training time no recorded step holds)

Actors report their memory with ``process_peak_memory``.
"""

from __future__ import annotations

import json
import os
import resource
import time
from datetime import datetime, timezone
from pathlib import Path

from es_ray.runtime.tracking import Timer

# torch is imported to read the device's peak memory only: the ledger is written without it.

FIELDS = (
    "method",
    "finished",
    "start_step",
    "steps",
    "steps_computed",
    "wall_s",
    "startup_s",
    "phase_seconds",
    "tokens_generated",
    "tokens_generated_eval",
    "tokens_backpropagated",
    "device_kind",
    "device_seconds",
    "device_seconds_training",
    "device_seconds_apart",
    "stop_reason",
    "actors",
    "peak_rss_bytes_max",
    "peak_gpu_bytes_max",
    "replacements",
    "segments",
    "redone",
)
SUMMED = (
    "wall_s",
    "startup_s",
    "tokens_generated",
    "tokens_generated_eval",
    "tokens_backpropagated",
    "device_seconds",
    "device_seconds_training",
    "replacements",
)
"""The figures a run's total adds up over its segments."""


def process_peak_memory() -> dict:
    """Peak memory of the calling process: resident set (bytes) and, with CUDA, peak GPU allocation (bytes)."""
    out: dict = {
        "pid": os.getpid(),
        "peak_rss_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024,
        "peak_gpu_bytes": None,
    }
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["peak_gpu_bytes"] = int(torch.cuda.max_memory_allocated())
            out["gpu_name"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return out


def actor_devices(cluster) -> tuple[str, float]:
    """('gpu', gpus_per_actor) for a GPU actor, else ('cpu', cpus_per_actor)."""
    if cluster.gpus_per_actor:
        return "gpu", float(cluster.gpus_per_actor)
    return "cpu", float(cluster.cpus_per_actor)


def _utc() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def earlier_segments(
    run_dir: str | Path, start: int = 0, rows: list[dict] = (), step_key: str = "step"
) -> tuple[list[dict], str]:
    """The segments of the run in run_dir before this start (a ledger written before segments were kept is one
    segment); a segment that never recorded its stop ended without a word (SIGKILL, a lost head node). Steps
    before ``start`` (the resume point) that no segment holds (ledger.json lost or torn, or a kill between a step's
    commit and its ledger write) are taken from their metrics ``rows`` (tokens and phase times; their
    device-seconds are unknown) as a segment marked ``rebuilt``. Returns (segments, a note saying what was
    rebuilt and why; '' when nothing was)."""
    path = Path(run_dir) / "ledger.json"
    old, why = None, ""
    try:
        old = json.loads(path.read_text())
    except FileNotFoundError:
        why = f"{path} is missing"
    except (OSError, ValueError) as exc:  # torn or garbled: never read as "no earlier cost" without a word
        why = f"{path} is unreadable ({type(exc).__name__}: {str(exc)[:80]})"
    if old is not None and not isinstance(old, dict):
        old, why = None, f"{path} holds no ledger"
    segments = (
        []
        if old is None
        else old.get("segments")
        or [
            {
                k: old.get(k)
                for k in (
                    *SUMMED,
                    "start_step",
                    "steps",
                    "stop_reason",
                    "finished",
                    "phase_seconds",
                    "peak_rss_bytes_max",
                    "peak_gpu_bytes_max",
                    "device_seconds_apart",
                )
            }
            | {
                "end_step": (old.get("start_step") or 0) + (old.get("steps") or 0),
                "stop": "finished" if old.get("finished") else (old.get("stop_reason") or "stopped"),
            }
        ]
    )
    for seg in segments:
        if seg.get("stop") == "running":
            seg["stop"] = "killed (the driver ended without recording its stop)"
    end = segments[-1].get("end_step") or 0 if segments else 0
    if start <= end:
        return segments, ""
    why = why or f"its last segment ends at step {end}, the run resumes at {start} (killed before its ledger write)"
    seg = rebuilt_segment(end, start, [r for r in rows if end <= r.get(step_key, -1) < start], why)
    blind = f", {seg['steps_without_tokens']} step(s) without a token count" if seg["steps_without_tokens"] else ""
    return [*segments, seg], (
        f"{why}: steps {end}-{start - 1} are in the ledger from their metrics rows "
        f"({seg['tokens_generated']} tokens{blind}; device-seconds unknown)"
    )


def rebuilt_segment(first: int, end: int, rows: list[dict], why: str) -> dict:
    """A segment for steps first..end-1 that no ledger recorded, from their metrics rows: tokens and phase times
    only (a row a resume rebuilt from the seed log has no tokens; a missing row counts nothing)."""
    tokens = [int(r.get("perf/tokens") or 0) for r in rows]
    phases: dict[str, float] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("timing_s/") and isinstance(v, (int, float)):
                phases[k.removeprefix("timing_s/")] = phases.get(k.removeprefix("timing_s/"), 0.0) + float(v)
    return {
        "start_step": first,
        "end_step": end,
        "steps": len(rows),
        "stop": "unknown",
        "rebuilt": f"from metrics.jsonl: {why}",
        "steps_without_tokens": (end - first) - sum(1 for r in rows if r.get("perf/tokens") is not None),
        "tokens_generated": sum(tokens),
        "tokens_generated_eval": sum(int(r.get("eval/tokens") or 0) for r in rows),
        "tokens_backpropagated": sum(int(r.get("perf/tokens_backpropagated") or 0) for r in rows),
        "phase_seconds": dict(sorted(phases.items())),
        "step_tokens": tokens,
    }


class Ledger:
    def __init__(self, method: str, start_step: int = 0, earlier: list[dict] | None = None):
        self.method, self.start_step = method, start_step
        self.earlier = list(earlier or [])  # the run's segments before this one (``earlier_segments``)
        self.started_utc = _utc()
        self.stop = "running"
        self.step_tokens: list[int] = []
        self.step_device_s: list[float] = []
        self._used_training = 0.0
        self.t0 = time.perf_counter()
        self.startup_s: float | None = None
        self.steps = 0
        self.tokens_generated = self.tokens_generated_eval = self.tokens_backpropagated = 0
        self.phase_seconds: dict[str, float] = {}
        self.actors: dict[str, dict] = {}
        self.replaced: dict[str, int] = {}  # replacements per actor group (role)
        self.started_at: float | None = None
        # ``with ledger.apart("checkpoint"):`` a span whose device time is not training (checkpoint writes,
        # held-out scoring): counted apart, per kind
        self.apart = Timer()
        self.apart_s = self.apart.seconds
        self.stopped = ""
        self._last_step = {"tokens": 0, "device_s": None}

    def started(self) -> None:
        """The actors are up (placed, models loaded): what came before is start-up."""
        self.started_at = time.perf_counter()
        self.startup_s = self.started_at - self.t0

    def _held(self, created_at: float, now: float) -> dict[str, float]:
        """One actor's seconds held, split: start-up (before ``started``), the marked spans, and training."""
        total = now - created_at
        startup = min(total, max(0.0, (self.started_at or now) - created_at))
        apart = {k: min(v, total - startup) for k, v in self.apart_s.items()}
        return {
            "total": total,
            "startup": startup,
            **apart,
            "training": max(0.0, total - startup - sum(apart.values())),
        }

    def training_used(self, groups: list, cluster) -> float:
        """Training device-seconds the actors of ``groups`` have held so far in this segment."""
        _, devices = actor_devices(cluster)
        now = time.perf_counter()
        return sum(len(g) * devices * self._held(g.created_at, now)["training"] for g in groups)

    def add_step(
        self,
        row: dict,
        generated: int,
        backpropagated: int = 0,
        generated_eval: int = 0,
        groups: list = (),
        cluster=None,
    ) -> None:
        """One step's (iteration's) metrics row: its ``timing_s/<phase>`` entries are summed per phase; with the
        actor ``groups``, the training device-seconds the step took are kept beside its tokens."""
        used = self.training_used(groups, cluster) if groups else self._used_training
        self.step_tokens.append(int(generated))
        self.step_device_s.append(used - self._used_training)
        self._used_training = used
        self.steps += 1
        self._last_step["tokens"] = int(generated)
        self.tokens_generated += int(generated)
        self.tokens_generated_eval += int(generated_eval)
        self.tokens_backpropagated += int(backpropagated)
        for key, value in row.items():
            if key.startswith("timing_s/") and isinstance(value, (int, float)):
                phase = key.removeprefix("timing_s/")
                self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + float(value)

    def add_group(self, group, cluster, ask: bool = True, timeout_s: float = 60.0) -> None:
        """Every actor of an ActorGroup: its devices, the seconds it was held, and its peak memory (``ask=False``:
        not asked, the time held only, as the record of each step keeps it). A peak is the largest read so far: an
        actor that cannot answer now (busy in a step a signal stopped, gone in a run that failed) keeps the one read
        earlier (the skeleton reads them after every step), marked ``unanswered``; null only if none was read."""
        kind, devices = actor_devices(cluster)
        held = self._held(group.created_at, time.perf_counter())
        blank = {"peak_rss_bytes": None, "peak_gpu_bytes": None}
        reports = (
            [r or {**blank, "unanswered": True} for r in group.ask_all(group.cls.peak_memory, timeout_s)]
            if ask
            else [blank] * len(group.ranks)
        )  # every actor class has it (runtime.actors.Actor)
        for rank, report in zip(group.ranks, reports):
            key = f"{group.role}_{rank}"
            report = dict(report)
            for field in blank:  # the largest read so far (a rank's replacement keeps the larger)
                seen = [v for v in (report.get(field), (self.actors.get(key) or {}).get(field)) if v is not None]
                report[field] = max(seen) if seen else None
            self.actors[key] = {
                "role": group.role,
                "device_kind": kind,
                "devices": devices,
                "seconds_held": held["total"],
                "seconds_split": held,
                **report,
            }
        self.replaced[group.role] = group.replacements

    def stop_reason(self, run, groups: list, cluster, tokens_so_far: int) -> str:
        """Why the run stops after this step under run.stop_at_tokens / run.stop_at_device_seconds ('' to go on).

        The run stops at the step that lands closest to the budget: after this step when the next one, expected
        to cost what this one did, would end farther past it than this one ends short of it (used + next / 2 >=
        budget). Device-seconds count the training only, as ``device_seconds_training`` does."""
        step_tokens = self._last_step["tokens"]
        reason = ""
        if run.stop_at_tokens and tokens_so_far + step_tokens / 2 >= run.stop_at_tokens:
            reason = (
                f"run.stop_at_tokens={run.stop_at_tokens}: {tokens_so_far} tokens generated, the next step "
                f"(~{step_tokens}) would land farther from it"
            )
        if run.stop_at_device_seconds:  # the earlier segments' training time counts too
            used = self.training_used(groups, cluster) + sum(
                s.get("device_seconds_training") or 0.0 for s in self.earlier
            )
            step_s = used - (self._last_step["device_s"] or 0.0)
            self._last_step["device_s"] = used
            if not reason and used + step_s / 2 >= run.stop_at_device_seconds:
                reason = (
                    f"run.stop_at_device_seconds={run.stop_at_device_seconds:g}: {used:.1f} training "
                    f"device-s used, the next step (~{step_s:.1f}) would land farther from it"
                )
        self.stopped = reason or self.stopped
        return reason

    def segment(self, finished: bool, end_step: int | None = None) -> dict:
        """This start's own figures (the fields above), with its span, its stop and its per-step costs."""
        out = self._own(finished)
        out.pop("actors")
        out.update(
            end_step=self.start_step + self.steps if end_step is None else end_step,
            started_at=self.started_utc,
            ended_at=_utc(),
            stop=self.stop,
            step_tokens=self.step_tokens,
            step_device_s=[round(x, 3) for x in self.step_device_s],
        )
        return out

    def to_dict(self, finished: bool, extra: dict | None = None, end_step: int | None = None) -> dict:
        """The run's ledger: every segment, and the totals over them (``redone``: what was done twice)."""
        own = self._own(finished)
        segments = [*self.earlier, self.segment(finished, end_step)]
        out = dict(own)
        for key in SUMMED:
            out[key] = sum(s.get(key) or 0 for s in segments)
        out["phase_seconds"], out["device_seconds_apart"] = {}, {}
        for s in segments:
            for field in ("phase_seconds", "device_seconds_apart"):
                for k, v in (s.get(field) or {}).items():
                    out[field][k] = out[field].get(k, 0.0) + v
        out["phase_seconds"] = dict(sorted(out["phase_seconds"].items()))
        for key in ("peak_rss_bytes_max", "peak_gpu_bytes_max"):
            seen = [s[key] for s in segments if s.get(key)]
            out[key] = max(seen) if seen else None
        out["start_step"] = segments[0].get("start_step") or 0
        out["steps"] = segments[-1]["end_step"] - out["start_step"]
        out["steps_computed"] = sum(s.get("steps") or 0 for s in segments)
        out["segments"], out["redone"] = segments, redone(segments)
        out["state"] = run_state(finished, self.stop)
        out.update(extra or {})
        return out

    def _own(self, finished: bool) -> dict:
        rss = [a["peak_rss_bytes"] for a in self.actors.values() if a.get("peak_rss_bytes")]
        gpu = [a["peak_gpu_bytes"] for a in self.actors.values() if a.get("peak_gpu_bytes")]
        kinds = {a["device_kind"] for a in self.actors.values()}
        out = {
            "method": self.method,
            "finished": finished,
            "start_step": self.start_step,
            "steps": self.steps,
            "wall_s": time.perf_counter() - self.t0,
            "startup_s": self.startup_s,
            "phase_seconds": dict(sorted(self.phase_seconds.items())),
            "tokens_generated": self.tokens_generated,
            "tokens_generated_eval": self.tokens_generated_eval,
            "tokens_backpropagated": self.tokens_backpropagated,
            "device_kind": "gpu" if "gpu" in kinds else "cpu",
            "device_seconds": sum(a["devices"] * a["seconds_held"] for a in self.actors.values()),
            "device_seconds_training": sum(
                a["devices"] * a["seconds_split"]["training"] for a in self.actors.values() if "seconds_split" in a
            ),
            "device_seconds_apart": {
                k: sum(
                    a["devices"] * a["seconds_split"].get(k, 0.0) for a in self.actors.values() if "seconds_split" in a
                )
                for k in ("startup", *sorted(self.apart_s))
            },
            "stop_reason": self.stopped,
            "actors": self.actors,
            "peak_rss_bytes_max": max(rss) if rss else None,
            "peak_gpu_bytes_max": max(gpu) if gpu else None,
            "replacements": sum(self.replaced.values()),
        }
        return out

    def write(
        self, run_dir: str | Path, finished: bool, extra: dict | None = None, end_step: int | None = None
    ) -> Path:
        """ledger.json, replaced whole (written to a sibling first: a kill mid-write leaves the previous one)."""
        path = Path(run_dir) / "ledger.json"
        tmp = path.with_name(".ledger.json.tmp")
        tmp.write_text(json.dumps(self.to_dict(finished, extra, end_step), indent=2))
        tmp.replace(path)
        return path


def run_state(finished: bool, stop: str) -> str:
    """The ledger's one-word state: finished, running (a step may still come: a live driver, or one killed without
    warning), stopped (a signal or a lost actor; resumable) or failed (an error)."""
    if finished:
        return "finished"
    if stop == "running":
        return "running"
    return "failed" if stop.startswith("error") else "stopped"


def redone(segments: list[dict]) -> dict:
    """The work the run did twice: for each segment, the steps it recorded at or past the step the next segment
    started from, with their tokens and training device-seconds (from the segment's per-step lists); and the
    training device-seconds no recorded step holds (a step interrupted before it was recorded)."""
    steps, tokens, device_s, unrecorded = 0, 0, 0.0, 0.0
    for seg, nxt in zip(segments, segments[1:]):
        first = seg.get("start_step") or 0
        cut = max(0, (nxt.get("start_step") or 0) - first)
        step_tokens, step_s = seg.get("step_tokens") or [], seg.get("step_device_s") or []
        steps += max(0, len(step_tokens) - cut)
        tokens += sum(step_tokens[cut:])
        device_s += sum(step_s[cut:])
    for seg in segments:
        if seg.get("step_device_s") is not None and seg.get("device_seconds_training") is not None:
            unrecorded += max(0.0, seg["device_seconds_training"] - sum(seg["step_device_s"]))
    return {
        "steps": steps,
        "tokens_generated": tokens,
        "device_seconds_training": round(device_s, 3),
        "unrecorded_device_seconds": round(unrecorded, 3),
    }
