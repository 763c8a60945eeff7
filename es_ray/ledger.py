"""The compute ledger shared by both trainers: what a run cost, measured, not estimated.

Tokens generated and tokens back-propagated, wall seconds per phase, and the peak memory of every actor process
(its peak resident set, from the kernel's ru_maxrss) and of its GPU where it has one (torch's peak allocation),
written to run.dir/ledger.json. Actors report their own memory with ``process_peak_memory``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


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


class Ledger:
    def __init__(self, method: str):
        self.method = method
        self.tokens_generated = 0
        self.tokens_backpropagated = 0
        self.phase_seconds: dict[str, float] = {}
        self.memory: dict[str, dict] = {}
        self.steps = 0
        self._t0 = time.perf_counter()

    def add_step(self, row: dict, generated: int, backpropagated: int = 0) -> None:
        """One step's (iteration's) metrics row: its ``timing_s/<phase>`` entries are summed per phase."""
        self.steps += 1
        self.tokens_generated += int(generated)
        self.tokens_backpropagated += int(backpropagated)
        for key, value in row.items():
            if key.startswith("timing_s/") and isinstance(value, (int, float)):
                phase = key.removeprefix("timing_s/")
                self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + float(value)

    def add_memory(self, role: str, report: dict) -> None:
        """``report`` from ``process_peak_memory`` in that actor; a role seen twice keeps the larger peaks."""
        old = self.memory.get(role)
        if old is not None:
            report = {**report, "peak_rss_bytes": max(old["peak_rss_bytes"], report["peak_rss_bytes"]),
                      "peak_gpu_bytes": max(old.get("peak_gpu_bytes") or 0, report.get("peak_gpu_bytes") or 0) or None}
        self.memory[role] = report

    def to_dict(self, extra: dict | None = None) -> dict:
        gpus = [m["peak_gpu_bytes"] for m in self.memory.values() if m.get("peak_gpu_bytes")]
        return {
            "method": self.method, "steps": self.steps, "wall_s": time.perf_counter() - self._t0,
            "tokens_generated": self.tokens_generated, "tokens_backpropagated": self.tokens_backpropagated,
            "phase_seconds": dict(sorted(self.phase_seconds.items())),
            "peak_memory": self.memory,
            "peak_rss_bytes_max": max((m["peak_rss_bytes"] for m in self.memory.values()), default=0),
            "peak_gpu_bytes_max": max(gpus) if gpus else None,
            **(extra or {}),
        }

    def write(self, run_dir: str | Path, extra: dict | None = None) -> Path:
        path = Path(run_dir) / "ledger.json"
        path.write_text(json.dumps(self.to_dict(extra), indent=2))
        return path


def write_es_ledger(run_dir: str | Path, history: list[dict], peak_rss_by_rank: dict[int, int],
                    extra: dict | None = None) -> Path:
    """The ES run's ledger from its metrics rows (``perf/tokens``, ``timing_s/*``) and each actor's peak RSS.
    ES back-propagates nothing: tokens_backpropagated stays 0."""
    ledger = Ledger("es")
    for row in history:
        ledger.add_step(row, row.get("perf/tokens", 0))
    for rank, rss in sorted(peak_rss_by_rank.items()):
        ledger.add_memory(f"actor_{rank}", {"peak_rss_bytes": int(rss), "peak_gpu_bytes": None})
    # the ledger is built after the run: its wall time is the iterations' own
    wall = sum(row.get("timing_s/iteration", 0.0) for row in history)
    return ledger.write(run_dir, {"wall_s": wall, **(extra or {})})
