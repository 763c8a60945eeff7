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
import netrc
import numbers
import os
import re
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from es_ray.core.config import flatten
from es_ray.core.registry import Registry
from es_ray.runtime.names import HELD_OUT_ENTROPY, HELD_OUT_PASS1, HELD_OUT_REWARD, REWARD_MEAN

# The tracker backends (wandb, mlflow, tensorboard) are optional and heavy, and tqdm and the tasks are needed only by
# the bars and the held-out rows: each is imported where it is used.


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


def ranked_metrics(params: dict[str, Any], job: str) -> list[str]:
    """The metrics a run is ranked by (TensorBoard's HPARAMS tab): a trainer's final training reward and held-out
    reward and pass@1; es-eval's pass@k and mean reward per task; es-compare's average pass@k per method. Names as
    the jobs log them (es_ray.runtime.names, es_eval.tracker_metrics, compare.run.tracker_metrics)."""
    ks = params.get("eval.k") or []
    if job == "es-eval":
        return [
            f"eval/{t}/{what}"
            for t in params.get("eval.tasks") or []
            for what in [*(f"pass_at_{k}" for k in ks), "mean_reward"]
        ]
    if job == "es-compare":
        return [f"compare/{m}/pass_at_{k}" for m in params.get("methods") or [] for k in ks]
    return [REWARD_MEAN, HELD_OUT_REWARD, HELD_OUT_PASS1]


class TensorBoardBackend:
    module = "tensorboard"
    install = "pip install es-ray (tensorboard is one of its dependencies)"

    def __init__(self, run_dir: Path, params: dict[str, Any], job: str):
        # torch.utils.tensorboard imports torch (its compiled libraries loaded and operators registered: the largest
        # import of a start, benchmarks/startup.py), which an ES driver needs for nothing else: the
        # writer is opened in a thread while the run starts its actors, and waited for by the first row. Not a
        # daemon: an interpreter exiting mid-import could otherwise block on the import lock it holds.
        self._w = None
        self._error: BaseException | None = None
        self._opening = threading.Thread(target=self._open, args=(run_dir, params, job), name="tensorboard-open")
        self._opening.start()

    def _open(self, run_dir: Path, params: dict[str, Any], job: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams

            w = SummaryWriter(str(run_dir / "tensorboard"))
            # the config as hparams of this run (HPARAMS tab); lists and None as text, which TensorBoard takes. The
            # metrics declared are scalar tags of this same run: the tab shows their last value and ranks runs by
            # them
            values = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in params.items()}
            for summary in hparams(values, dict.fromkeys(ranked_metrics(params, job), 0.0)):
                w.file_writer.add_summary(summary)
            self._w = w
        except BaseException as exc:  # raised where the writer is first needed
            self._error = exc

    def _writer(self):
        self._opening.join()
        if self._error is not None:
            raise self._error
        return self._w

    def log(self, step: int, metrics: dict, step_key: str) -> None:
        w = self._writer()
        for k, v in _scalars(metrics).items():
            w.add_scalar(k, v, step)
        w.flush()

    def close(self) -> None:  # a writer that failed to open said so at the first row; closing never raises it
        self._opening.join()
        if self._w is not None:
            self._w.close()


class WandbBackend:
    module = "wandb"
    install = "pip install 'es-ray[wandb]' (in a checkout: pip install -e '.[wandb]')"

    def __init__(self, run_dir: Path, params: dict[str, Any], job: str):
        import wandb

        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "es-ray"),
            name=run_dir.name,
            job_type=job,
            dir=str(run_dir),
            config=params,
            mode=self.mode(),
            reinit="create_new",
        )  # es-compare's stages are runs of their own

    @staticmethod
    def mode() -> str | None:
        """WANDB_MODE when set; else W&B's own default (online) when an API key is configured, else offline."""
        if os.environ.get("WANDB_MODE"):
            return os.environ["WANDB_MODE"]
        if os.environ.get("WANDB_API_KEY"):
            return None
        host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
        try:
            return None if netrc.netrc().authenticators(host) else "offline"
        except (OSError, netrc.NetrcParseError):  # no ~/.netrc: `wandb login` never ran
            return "offline"

    def log(self, step: int, metrics: dict, step_key: str) -> None:
        self._run.log(_scalars(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowBackend:
    module = "mlflow"
    install = "pip install 'es-ray[mlflow]' (in a checkout: pip install -e '.[mlflow]')"
    _BAD_KEY = re.compile(r"[^/\w.\- :]")  # the characters MLflow refuses in metric and parameter names
    _MAX_VALUE = 500  # the parameter value limit of older MLflow servers (newer ones take 6000)

    def __init__(self, run_dir: Path, params: dict[str, Any], job: str):
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
        self.run_id = self._client.create_run(
            exp_id, run_name=run_dir.name, tags={"job_type": job, "run_dir": str(run_dir)}
        ).info.run_id
        items = [Param(self._key(k), str(v)[: self._MAX_VALUE]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters per call
            self._client.log_batch(self.run_id, params=items[i : i + 100])

    def _key(self, key: str) -> str:
        return self._BAD_KEY.sub("_", key)

    def log(self, step: int, metrics: dict, step_key: str) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(
            self.run_id, metrics=[Metric(self._key(k), v, now, step) for k, v in _scalars(metrics).items()]
        )

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


TRACKERS = Registry("run.trackers", {"tensorboard": TensorBoardBackend, "wandb": WandbBackend, "mlflow": MlflowBackend})
"""Metric backends by name; metrics.jsonl is always written besides them."""


def held_out_key(config: Any) -> str:
    """The held-out metric the progress shows: eval/reward for a task whose reward is dense (``Task.dense_reward``),
    else eval/pass_at_1."""
    try:
        from es_ray.tasks import task_class

        dense = getattr(task_class(config.task.name), "dense_reward", False)
    except Exception:  # noqa: BLE001 - a user task that cannot be imported here: the binary default
        dense = False
    return HELD_OUT_REWARD if dense else HELD_OUT_PASS1


SHOWN_AS = {HELD_OUT_REWARD: "heldout_reward", HELD_OUT_PASS1: "heldout_pass@1"}


def on_terminal() -> bool:
    """Whether stderr is a terminal (a bar there; plain lines for a log file)."""
    return sys.stderr.isatty()


def shows_bar(progress: bool) -> bool:
    """Whether an entry point draws a progress bar: run.progress=true and stderr a terminal (a log file gets no
    carriage-return frames). Every entry point asks this one function."""
    return bool(progress) and on_terminal()


def _duration(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m{rest % 60:02d}s" if h else f"{rest // 60}m{rest % 60:02d}s"


class Tracker:
    """``log(step, metrics)`` writes one row to metrics.jsonl and to every backend in ``trackers``; ``config`` (a
    dataclass) is logged once as the run's parameters.

    The console: with ``progress`` and a terminal on stderr, a bar (the training reward, the task's held-out
    metric: ``held_out_key``, and the running step's ``position``: ES's members scored); otherwise (Ray Jobs, Slurm,
    run.progress=false) one line per step (step, reward, held-out score, tokens/s, elapsed, ETA) and one per
    held-out scoring, for log readers."""

    def __init__(
        self,
        run_dir: str | Path,
        total: int,
        config: Any,
        trackers: list[str],
        progress: bool = True,
        desc: str = "es",
        start: int = 0,
        unit: str = "iteration",
        console: bool = True,
    ):
        self.run_dir = Path(run_dir)
        params = flatten(dataclasses.asdict(config))
        self._backends = [JsonlBackend(self.run_dir)]
        self._backends += [TRACKERS.get(name)(self.run_dir, params, desc) for name in dict.fromkeys(trackers)]
        self.desc, self.unit, self.total, self.start = desc, unit, total, start
        self.held_key = held_out_key(config) if hasattr(config, "task") else HELD_OUT_PASS1
        self.shown = {REWARD_MEAN: "train_reward", self.held_key: SHOWN_AS[self.held_key]}
        self._t0, self._steps, self.console = time.perf_counter(), 0, console
        self._t_steps: float | None = None
        self._bar = None
        if console and shows_bar(progress):
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, desc=desc, dynamic_ncols=True)  # a resumed run: from start
        self._shown: dict[str, str] = {}
        self._position: dict[str, str] = {}  # within the step: e.g. {"members": "3/8"}

    @property
    def bar(self) -> bool:
        """Whether the console shows a bar (a terminal, run.progress=true): only then is a within-step position
        worth asking the actors for."""
        return self._bar is not None

    def position(self, done: int, total: int, what: str) -> None:
        """Where the running step is (``done`` of its ``total`` ``what``: ES's members scored), on the bar beside the
        metrics until the step is logged; without a bar, nothing (the step's line says it when it ends)."""
        if self._bar is None:
            return
        self._position = {what: f"{done}/{total}"}
        self._bar.set_postfix({**self._shown, **self._position})

    def log(self, step: int, metrics: dict, step_key: str = "iteration") -> None:
        for backend in self._backends:
            backend.log(step, metrics, step_key)
        self._steps += 1
        self._shown.update(
            {
                name: f"{metrics[k]:.3f}"
                for k, name in self.shown.items()
                if isinstance(metrics.get(k), numbers.Real) and math.isfinite(metrics[k])
            }
        )
        self._position = {}
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(self._shown)
        elif self.console:
            self.message(self.step_line(step, metrics))

    def step_line(self, step: int, metrics: dict) -> str:
        """'es iteration 4/10 reward 0.412 heldout_reward 0.437 tokens/s 523 elapsed 1m02s eta 2m10s' (after step
        3; the ETA from this start's steps, start-up left out)."""
        now = time.perf_counter()
        elapsed, stepping = now - self._t0, now - (self._t_steps or self._t0)
        eta = _duration(stepping / self._steps * (self.total - step - 1)) if self._steps else "?"
        rate = metrics.get("perf/tokens_per_s")
        parts = [
            f"{self.desc} {self.unit} {step + 1}/{self.total}",
            *(
                f"{name.removeprefix('train_')} {self._shown[name]}"
                for name in self.shown.values()
                if name in self._shown
            ),
            f"tokens/s {rate:.0f}" if isinstance(rate, numbers.Real) else "",
            f"elapsed {_duration(elapsed)}",
            f"eta {eta}",
        ]
        return " ".join(p for p in parts if p)

    def begin(self) -> None:
        """The actors are up: the steps' time (what the ETA extrapolates) starts now."""
        self._t_steps = time.perf_counter()

    def held_out(self, step: int, row: dict) -> None:
        """A held-out scoring's line (without a bar; with one, its postfix shows the metric): step -1 is the base
        weights; after step index t it says "after iteration t + 1", the count the step line ("iteration t + 1/N")
        and summary.json's "after" use."""
        self._shown.update(
            {
                name: f"{row[k]:.3f}"
                for k, name in self.shown.items()
                if k != REWARD_MEAN and isinstance(row.get(k), numbers.Real) and math.isfinite(row[k])
            }
        )
        if self._bar is not None or not self.console:
            if self._bar is not None:
                self._bar.set_postfix({**self._shown, **self._position})
            return
        where = "base weights" if step < 0 else f"after {self.unit} {step + 1}"  # counted as the step line counts
        shown = " ".join(
            f"{k.removeprefix('eval/')} {row[k]:.3f}"
            for k in (HELD_OUT_REWARD, HELD_OUT_PASS1, HELD_OUT_ENTROPY)
            if isinstance(row.get(k), numbers.Real)
        )
        self.message(f"{self.desc} held-out ({where}): {shown or 'no problems scored'}")

    def backfill(self, rows: list[dict], step_key: str) -> None:
        """Rows metrics.jsonl already holds (rebuilt on resume) to the other backends."""
        for row in rows:
            for backend in self._backends[1:]:
                backend.log(row[step_key], {k: v for k, v in row.items() if k != step_key}, step_key)

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
    tracker = Tracker(run_dir, 1, config, config.run.trackers, progress=False, desc=desc, console=False)
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
