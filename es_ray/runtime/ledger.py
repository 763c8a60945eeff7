"""ONE compute ledger, filled by the same code for every method: what a run cost, measured, not estimated.

Written to run.dir/ledger.json by the driver. Every field, for ES and GRPO alike:

    method, finished, start_step          the method; whether it ran to its end; the iteration/step it started
                                          from (0, or where a resume began)
    steps                                 iterations / steps run by this driver
    wall_s                                driver start (before Ray connects) to the ledger's write
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
    actors                                per actor: role, devices, seconds held, peak RSS bytes (ru_maxrss) and
                                          peak GPU bytes (torch.cuda.max_memory_allocated; null without CUDA)
    peak_rss_bytes_max, peak_gpu_bytes_max, replacements

Actors report their memory with ``process_peak_memory``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from es_ray.runtime.tracking import Timer

FIELDS = ("method", "finished", "start_step", "steps", "wall_s", "startup_s", "phase_seconds", "tokens_generated",
          "tokens_generated_eval", "tokens_backpropagated", "device_kind", "device_seconds",
          "device_seconds_training", "device_seconds_apart", "stop_reason", "actors", "peak_rss_bytes_max",
          "peak_gpu_bytes_max", "replacements")


def process_peak_memory() -> dict:
    """Peak memory of the calling process: resident set (bytes) and, with CUDA, peak GPU allocation (bytes)."""
    import os
    import resource

    out: dict = {"pid": os.getpid(), "peak_rss_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024,
                 "peak_gpu_bytes": None}
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


class Ledger:
    def __init__(self, method: str, start_step: int = 0):
        self.method, self.start_step = method, start_step
        self.t0 = time.perf_counter()
        self.startup_s: float | None = None
        self.steps = 0
        self.tokens_generated = self.tokens_generated_eval = self.tokens_backpropagated = 0
        self.phase_seconds: dict[str, float] = {}
        self.actors: dict[str, dict] = {}
        self.replacements = 0
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
        return {"total": total, "startup": startup, **apart,
                "training": max(0.0, total - startup - sum(apart.values()))}

    def add_step(self, row: dict, generated: int, backpropagated: int = 0, generated_eval: int = 0) -> None:
        """One step's (iteration's) metrics row: its ``timing_s/<phase>`` entries are summed per phase."""
        self.steps += 1
        self._last_step["tokens"] = int(generated)
        self.tokens_generated += int(generated)
        self.tokens_generated_eval += int(generated_eval)
        self.tokens_backpropagated += int(backpropagated)
        for key, value in row.items():
            if key.startswith("timing_s/") and isinstance(value, (int, float)):
                phase = key.removeprefix("timing_s/")
                self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + float(value)

    def add_group(self, group, cluster) -> None:
        """Every actor of an ActorGroup: its devices, the seconds it was held, and its peak memory (an actor that
        cannot answer, in a run that failed, is recorded with null memory)."""
        kind, devices = actor_devices(cluster)
        held = self._held(group.created_at, time.perf_counter())
        reports = [r or {"peak_rss_bytes": None, "peak_gpu_bytes": None, "unanswered": True}
                   for r in group.ask_all(group.cls.peak_memory)]  # every actor class has it (runtime.actors.Actor)
        for rank, report in zip(group.ranks, reports):
            self.actors[f"{group.role}_{rank}"] = {"role": group.role, "device_kind": kind, "devices": devices,
                                                   "seconds_held": held["total"], "seconds_split": held, **report}
        self.replacements += group.replacements

    def stop_reason(self, run, groups: list, cluster, tokens_so_far: int) -> str:
        """Why the run stops after this step under run.stop_at_tokens / run.stop_at_device_seconds ('' to go on).

        The run stops at the step that lands closest to the budget: after this step when the next one, expected
        to cost what this one did, would end farther past it than this one ends short of it (used + next / 2 >=
        budget). Device-seconds count the training only, as ``device_seconds_training`` does."""
        now = time.perf_counter()
        step_tokens = self._last_step["tokens"]
        reason = ""
        if run.stop_at_tokens and tokens_so_far + step_tokens / 2 >= run.stop_at_tokens:
            reason = (f"run.stop_at_tokens={run.stop_at_tokens}: {tokens_so_far} tokens generated, the next step "
                      f"(~{step_tokens}) would land farther from it")
        if run.stop_at_device_seconds:
            _, devices = actor_devices(cluster)
            used = sum(len(g) * devices * self._held(g.created_at, now)["training"] for g in groups)
            step_s = used - (self._last_step["device_s"] or 0.0)
            self._last_step["device_s"] = used
            if not reason and used + step_s / 2 >= run.stop_at_device_seconds:
                reason = (f"run.stop_at_device_seconds={run.stop_at_device_seconds:g}: {used:.1f} training "
                          f"device-s used, the next step (~{step_s:.1f}) would land farther from it")
        self.stopped = reason or self.stopped
        return reason

    def to_dict(self, finished: bool, extra: dict | None = None) -> dict:
        rss = [a["peak_rss_bytes"] for a in self.actors.values() if a.get("peak_rss_bytes")]
        gpu = [a["peak_gpu_bytes"] for a in self.actors.values() if a.get("peak_gpu_bytes")]
        kinds = {a["device_kind"] for a in self.actors.values()}
        out = {
            "method": self.method, "finished": finished, "start_step": self.start_step, "steps": self.steps,
            "wall_s": time.perf_counter() - self.t0, "startup_s": self.startup_s,
            "phase_seconds": dict(sorted(self.phase_seconds.items())),
            "tokens_generated": self.tokens_generated, "tokens_generated_eval": self.tokens_generated_eval,
            "tokens_backpropagated": self.tokens_backpropagated,
            "device_kind": "gpu" if "gpu" in kinds else "cpu",
            "device_seconds": sum(a["devices"] * a["seconds_held"] for a in self.actors.values()),
            "device_seconds_training": sum(a["devices"] * a["seconds_split"]["training"]
                                           for a in self.actors.values() if "seconds_split" in a),
            "device_seconds_apart": {k: sum(a["devices"] * a["seconds_split"].get(k, 0.0)
                                            for a in self.actors.values() if "seconds_split" in a)
                                     for k in ("startup", *sorted(self.apart_s))},
            "stop_reason": self.stopped,
            "actors": self.actors,
            "peak_rss_bytes_max": max(rss) if rss else None, "peak_gpu_bytes_max": max(gpu) if gpu else None,
            "replacements": self.replacements,
        }
        out.update(extra or {})
        return out

    def write(self, run_dir: str | Path, finished: bool, extra: dict | None = None) -> Path:
        path = Path(run_dir) / "ledger.json"
        path.write_text(json.dumps(self.to_dict(finished, extra), indent=2))
        return path
