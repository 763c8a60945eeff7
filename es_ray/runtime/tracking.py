"""One tracker for the driver: console progress, metrics.jsonl, TensorBoard (each optional), plus a timer."""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path


class Tracker:
    def __init__(self, run_dir: str | Path, total: int, tensorboard: bool = True, progress: bool = True,
                 desc: str = "es"):
        self.run_dir = Path(run_dir)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:  # tensorboard not installed: JSONL still has everything
                self._tb = None
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, dynamic_ncols=True)

    def log(self, step: int, metrics: dict, step_key: str = "iteration") -> None:
        row = {step_key: step, **{k: _clean(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._bar is not None:
            self._bar.update(1)
            shown = {k.split("/")[-1]: f"{v:.3f}" for k, v in metrics.items()
                     if k in ("reward/mean", "eval/reward") and isinstance(v, float)}
            self._bar.set_postfix(shown)

    def message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class Timer:
    """Accumulates seconds per phase: ``with timer("generate"): ...``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0
