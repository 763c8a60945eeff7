"""One tracker for the driver: console progress, metrics.jsonl (always) and the backends named in run.trackers
(TensorBoard, Weights & Biases, MLflow), plus a timer.

Every backend gets the same metric names and steps, and the run's resolved config (flattened to dotted keys) as its
parameters (TensorBoard: hparams of the same run as the scalars). Each follows its own conventions: W&B honours
WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY and runs online when an API key is configured (WANDB_API_KEY or `wandb
login`), else offline under ``<run.dir>/wandb`` (`wandb sync` uploads it later); MLflow logs to MLFLOW_TRACKING_URI
(experiment MLFLOW_EXPERIMENT_NAME), else to a file store ``<run.dir>/mlruns``. A backend's package is imported only
when a run uses it.

Why not accelerate.tracking (a dependency already): its TensorBoard tracker writes the hyperparameters to a second,
timestamped run beside the scalars (and refuses list values), its MLflow tracker drives MLflow's process-global active
run with the default tracking URI (./mlruns in the working directory) and drops parameters longer than 500
characters, and its W&B tracker names the project after the run; adapting those costs as many lines as these.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from es_ray.core.config import flatten
from es_ray.core.registry import Registry
from es_ray.runtime.names import HELD_OUT_PASS1, REWARD_MEAN

TRACKERS = Registry("run.trackers")
"""Metric backends by name; metrics.jsonl is always written besides them."""


def _scalars(metrics: dict) -> dict[str, float]:
    """The finite numbers of a metrics row (bools as 0/1): what the backends can plot."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, numbers.Real) and math.isfinite(v)}


class JsonlBackend:
    def __init__(self, run_dir: Path):
        self._f = open(run_dir / "metrics.jsonl", "a", buffering=1)

    def log(self, step: int, metrics: dict, step_key: str) -> None:
        self._f.write(json.dumps({step_key: step, **{k: _clean(v) for k, v in metrics.items()}}) + "\n")

    def close(self) -> None:
        self._f.close()


@TRACKERS.register("tensorboard")
class TensorBoardBackend:
    module = "tensorboard"
    install = "pip install es-ray (tensorboard is one of its dependencies)"

    def __init__(self, run_dir: Path, params: dict[str, Any], job: str):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self._w = SummaryWriter(str(run_dir / "tensorboard"))
        # the config as hparams of this run (HPARAMS tab); lists and None as text, which TensorBoard takes
        values = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in params.items()}
        for summary in hparams(values, {}):
            self._w.file_writer.add_summary(summary)

    def log(self, step: int, metrics: dict, step_key: str) -> None:
        for k, v in _scalars(metrics).items():
            self._w.add_scalar(k, v, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


@TRACKERS.register("wandb")
class WandbBackend:
    module = "wandb"
    install = "pip install 'es-ray[wandb]' (in a checkout: pip install -e '.[wandb]')"

    def __init__(self, run_dir: Path, params: dict[str, Any], job: str):
        import wandb

        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "es-ray"), name=run_dir.name, job_type=job,
                               dir=str(run_dir), config=params, mode=self.mode(),
                               reinit="create_new")  # es-compare's stages are runs of their own

    @staticmethod
    def mode() -> str | None:
        """WANDB_MODE when set; else W&B's own default (online) when an API key is configured, else offline."""
        if os.environ.get("WANDB_MODE"):
            return os.environ["WANDB_MODE"]
        if os.environ.get("WANDB_API_KEY"):
            return None
        import netrc
        from urllib.parse import urlparse

        host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
        try:
            return None if netrc.netrc().authenticators(host) else "offline"
        except (OSError, netrc.NetrcParseError):  # no ~/.netrc: `wandb login` never ran
            return "offline"

    def log(self, step: int, metrics: dict, step_key: str) -> None:
        self._run.log(_scalars(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


@TRACKERS.register("mlflow")
class MlflowBackend:
    module = "mlflow"
    install = "pip install 'es-ray[mlflow]' (in a checkout: pip install -e '.[mlflow]')"
    _BAD_KEY = re.compile(r"[^/\w.\- :]")  # the characters MLflow refuses in metric and parameter names
    _MAX_VALUE = 500  # the parameter value limit of older MLflow servers (newer ones take 6000)

    def __init__(self, run_dir: Path, params: dict[str, Any], job: str):
        from urllib.parse import urlparse

        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").as_uri()
        if urlparse(uri).scheme in ("", "file"):  # MLflow 3 refuses its file store unless this is set
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.tracking_uri = uri
        self._client = MlflowClient(uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "es-ray")
        exp = self._client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self._client.create_experiment(name)
        self.run_id = self._client.create_run(exp_id, run_name=run_dir.name,
                                              tags={"job_type": job, "run_dir": str(run_dir)}).info.run_id
        items = [Param(self._key(k), str(v)[:self._MAX_VALUE]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters per call
            self._client.log_batch(self.run_id, params=items[i:i + 100])

    def _key(self, key: str) -> str:
        return self._BAD_KEY.sub("_", key)

    def log(self, step: int, metrics: dict, step_key: str) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(self._key(k), v, now, step)
                                                     for k, v in _scalars(metrics).items()])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


class Tracker:
    """``log(step, metrics)`` writes one row to metrics.jsonl and to every backend in ``trackers``; ``config`` (a
    dataclass) is logged once as the run's parameters."""

    # progress-bar postfix: what each shown number is (the training reward of the step's samples, the held-out
    # pass@1 of the last evaluation)
    SHOWN = {REWARD_MEAN: "train_reward", HELD_OUT_PASS1: "heldout_pass@1"}

    def __init__(self, run_dir: str | Path, total: int, config: Any, trackers: list[str], progress: bool = True,
                 desc: str = "es", start: int = 0):
        self.run_dir = Path(run_dir)
        params = flatten(dataclasses.asdict(config))
        self._backends = [JsonlBackend(self.run_dir)]
        self._backends += [TRACKERS.get(name)(self.run_dir, params, desc) for name in dict.fromkeys(trackers)]
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, desc=desc, dynamic_ncols=True)  # a resumed run: from start
        self._shown: dict[str, str] = {}

    def log(self, step: int, metrics: dict, step_key: str = "iteration") -> None:
        for backend in self._backends:
            backend.log(step, metrics, step_key)
        if self._bar is not None:
            self._bar.update(1)
            self._shown.update({name: f"{metrics[k]:.3f}" for k, name in self.SHOWN.items()
                                if isinstance(metrics.get(k), numbers.Real) and math.isfinite(metrics[k])})
            self._bar.set_postfix(self._shown)

    def message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        for backend in self._backends:
            backend.close()
        if self._bar is not None:
            self._bar.close()


def log_summary(run_dir: str | Path, config: Any, metrics: dict, desc: str) -> None:
    """One-off jobs (es-eval, es-compare): their summary numbers as step 0 of every tracker in run.trackers."""
    if not config.run.trackers:
        return
    tracker = Tracker(run_dir, 1, config, config.run.trackers, progress=False, desc=desc)
    try:
        tracker.log(0, metrics, step_key="step")
    finally:
        tracker.close()


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
