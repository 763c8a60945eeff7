"""One run skeleton under every training method (ES and GRPO). What a run does around its method's step is written
once here:

    prepare          the memory plan against the device, on a local cluster the model converted and the task
                     loaded (a typo fails before any actor starts), the run dir opened (a resume with changed
                     settings refused, naming them)
    Training.run     the ledger, the cluster, the tracker, the interrupt guard; the method's actors started (and
                     brought to the resume point); the held-out curve's base point; per step: the method's step,
                     its record (``record``: held-out scoring (eval.every, and the last step), the tracker row,
                     the ledger), written with the step's commit so no committed step lacks it, the budget
                     (run.stop_at_*), checkpoints (run.checkpoint_every) kept in bounds (run.keep_checkpoints;
                     the disk they need checked at the start; an extended run's earlier final kept); the final
                     held-out scores, checkpoint and summary.json; after a signal or a lost actor a checkpoint of
                     the completed steps (with a grace of its own once the running step returned) and the resume
                     command; what the run cost (ledger.json, every segment of it, the actors' peak memory read
                     after every step), after every step and at the end

A method is a subclass that implements the hooks (start its actors, one step, one held-out scoring, save a
checkpoint) and keeps nothing else: ``es_ray.es.driver.ESRun``, ``es_ray.grpo.driver.GRPORun``.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from es_ray.core.config import ConfigError
from es_ray.held_out import write_base_point
from es_ray.memory_plan import startup_check
from es_ray.models import resolve_model, safetensors_index
from es_ray.runtime import cluster
from es_ray.runtime.actors import ActorLostError
from es_ray.runtime.checkpoint import checkpoint_dirs, dir_bytes, keep_as, mark_kept_final, prune_checkpoints, read_meta
from es_ray.runtime.ledger import Ledger, earlier_segments
from es_ray.runtime.names import REWARD_MEAN, held_out_row
from es_ray.runtime.rundir import RunDirError, open_run_dir, resume_command, unlock_run_dir, write_error
from es_ray.runtime.signals import InterruptGuard, Interrupted
from es_ray.runtime.tracking import Tracker
from es_ray.tasks import load_task


def prepare(
    cfg: Any, method: str, resume_free: Iterable[str] = (), preflight: Callable[[Path], None] | None = None
) -> Path:
    """Everything a run checks before it starts an actor; returns the opened run dir. ``preflight`` is the method's
    own check against the converted model (e.g. low rank's es.rank against the layers)."""
    startup_check(method, cfg)  # the memory plan against the device, before any model is fetched or loaded
    if not cfg.cluster.address:  # fail fast on this machine; on a remote cluster the actors check
        model_dir = resolve_model(cfg.model.path)  # also converts the embedded model once, before actors start
        load_task(cfg.task)
        if preflight is not None:
            preflight(model_dir)
    return open_run_dir(cfg, method, resume_free)  # refuses a resume with changed settings, naming them


def _spans(steps: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out: list[str] = []
    for t in sorted(steps):
        if out and int(out[-1].split("-")[-1]) == t - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{t}"
        else:
            out.append(str(t))
    return ", ".join(out)


def one_line(exc: BaseException) -> str:
    """``Type: message`` of an error on one line, for the ledger's stop: an actor's error (Ray's RayTaskError, whose
    text is its traceback, colour codes included) is given by its cause."""
    err = getattr(exc, "cause", None) or exc
    lines = [x.strip() for x in re.sub(r"\x1b\[[0-9;]*m", "", str(err)).splitlines() if x.strip()]
    return f"{type(err).__name__}: {lines[0][:200] if lines else ''}"


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def due(every: int, t: int, last: int) -> bool:
    """Whether a cadence of ``every`` steps (0: never) falls after step t: t + 1 a multiple of it, before ``last``."""
    return bool(every) and (t + 1) % every == 0 and t + 1 < last


class Training:
    """A training method on the common skeleton. Subclasses set the class attributes and implement the hooks."""

    method = ""
    """The run dir's and the ledger's method ("es", "grpo"), and the word that opens every message."""
    unit = "step"
    """A step's name in metrics.jsonl (its step key) and in messages ("iteration" for ES)."""
    checkpoint_prefix = "step"
    """Periodic checkpoints are checkpoints/<prefix>_<done:06d>."""

    def __init__(self, cfg: Any, run_dir: Path, total: int, start: int = 0, history: list[dict] | None = None):
        self.cfg, self.run_dir, self.total, self.start = cfg, run_dir, total, start
        self.history = list(history or [])  # metrics rows of the steps before a resume, then this run's
        self._history_before = len(self.history)
        self.tracker = None

    # -- the method's hooks ------------------------------------------------------------------------------------
    def start_actors(self, guard) -> None:
        """Start the method's actors (models loaded) and bring them to the resume point."""
        raise NotImplementedError

    def step(self, t: int, guard) -> dict:
        """One training step: its metrics row (with perf/tokens, and perf/tokens_backpropagated if any)."""
        raise NotImplementedError

    def evaluate_held_out(self) -> dict:
        """The current weights on the held-out set: held_out_scores' answer (reward, pass_at_1, ..., tokens)."""
        raise NotImplementedError

    def save(self, path: Path, done: int) -> str:
        """Write a checkpoint of ``done`` completed steps at ``path``; returns where it is."""
        raise NotImplementedError

    def save_at_stop(self, stop: BaseException, done: int) -> str:
        """After ``stop`` (a signal or a lost actor): a checkpoint of the ``done`` completed steps ('' when none was
        written); raise ``stop`` to give up (nothing left to save from)."""
        raise NotImplementedError

    checkpoint_copies = 0
    """fp32 copies of the model's weights a checkpoint holds (the weights, plus optimizer moments and the like): the
    disk estimate printed at the start (0: not estimated)."""

    def events(self) -> dict:
        """What happened beside the step (actor replacements): merged into its row."""
        return {}

    @property
    def groups(self) -> list:
        """The actor groups alive now (their cost goes into the ledger; they are killed at the end)."""
        return []

    @property
    def done(self) -> int:
        """Steps completed (ES: committed iterations)."""
        return self.start + len(self.history) - self._history_before

    def close(self) -> None:
        """Release what the method holds beyond its actor groups (placement, logs)."""

    def summary(self) -> dict:
        """Entries of summary.json beside the common ones."""
        return {}

    # -- the skeleton --------------------------------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.cfg
        finished_before = self._nothing_left()
        if finished_before is not None:  # no Ray, no replay, no new ledger segment
            return finished_before
        tokens_before = sum(h.get("perf/tokens", 0) for h in self.history)
        # one ledger per run: a resume adds its segment to those of the starts before it
        earlier, ledger_note = (
            earlier_segments(self.run_dir, self.start, self.history[: self._history_before], self.unit)
            if cfg.run.resume
            else ([], "")
        )
        self.ledger = ledger = Ledger(self.method, self.start, earlier)
        disk_note = self.check_disk()  # refused here, before the cluster starts, when the checkpoints cannot fit
        cluster.connect(cfg.cluster, cfg.run.verbose)
        self.tracker = Tracker(
            self.run_dir,
            self.total,
            cfg,
            cfg.run.trackers,
            cfg.run.progress,
            desc=self.method,
            start=self.start,
            unit=self.unit,
        )
        if disk_note:
            self.tracker.message(f"{self.method}: {disk_note}")
        if ledger_note:  # never silently: the run's cost lacks what the lost ledger held
            self.tracker.message(f"{self.method}: ledger: {ledger_note}")
        if self.rebuilt:  # rows metrics.jsonl lacked, rebuilt on resume: the other trackers get them too
            self.tracker.backfill(self.rebuilt, step_key=self.unit)
            self.tracker.message(
                f"{self.method}: {self.unit}(s) {_spans([r[self.unit] for r in self.rebuilt])} "
                "had no metrics row; rebuilt from the seed log (resume/rebuilt=true)"
            )
        missing = sorted(set(range(self.start)) - {h.get(self.unit) for h in self.history})
        if missing:  # never silently: a curve with holes says where and why
            self.tracker.message(
                f"{self.method}: {self.unit}(s) {_spans(missing)} before the resume point have no "
                f"metrics row and nothing to rebuild one from (metrics.jsonl lost them, and "
                f"{self.method} keeps no per-step log); the curves skip them"
            )
        summary: dict = {"run_dir": str(self.run_dir)}
        finished, failed = False, None
        with InterruptGuard(cfg.faults.stop_timeout_s) as guard:
            self.guard = guard
            try:
                self.start_actors(guard)
                ledger.started()
                for group in self.groups:  # a kill in the first step keeps the start-up's cost
                    ledger.add_group(group, cfg.cluster, ask=False)
                ledger.write(self.run_dir, False, end_step=self.done)
                if cfg.eval.every and self.start == 0:  # the held-out curve's first point: the base weights
                    with ledger.apart("held_out"):
                        res = self.evaluate_held_out()
                        write_base_point(self.run_dir, res, ledger)
                    self.tracker.held_out(-1, held_out_row(res))
                self.tracker.begin()
                for t in range(self.start, self.total):
                    with guard.step():  # a signal once the step is committed waits until it is recorded
                        row = self.step(t, guard)
                        if self._recorded < t:  # the method did not record it with its commit
                            self.record(t, row)
                    for group in self.groups:  # peak memory read between steps, while every actor is idle: a
                        ledger.add_group(group, cfg.cluster, timeout_s=5.0)  # stop mid-step keeps the peak so far
                    ledger.write(self.run_dir, False, end_step=self.done)  # what a kill without warning keeps
                    stop = ledger.stop_reason(
                        cfg.run, self.groups, cfg.cluster, tokens_before + ledger.tokens_generated
                    )
                    if stop:
                        self.tracker.message(f"{self.method}: stopping after {self.unit} {self.done}: {stop}")
                        break
                    if due(cfg.run.checkpoint_every, t, self.total):
                        with ledger.apart("checkpoint"):
                            self.save(self._checkpoint_dir(self.done), self.done)
                        self.prune()
                final_eval = self._final_held_out()
                final = self.run_dir / "checkpoints" / "final"
                with ledger.apart("checkpoint"):
                    self.keep_earlier_final(final)
                    final = self.save(final, self.done)
                self.prune()
                finished = True
                ledger.stop = f"budget: {ledger.stopped}" if ledger.stopped else "finished"
                summary.update(
                    final_checkpoint=str(final),
                    **self.summary(),
                    reward_mean=[h[REWARD_MEAN] for h in self.history if REWARD_MEAN in h],
                    eval_reward=[h["eval/reward"] for h in self.history if "eval/reward" in h],
                )
                if final_eval is not None:
                    summary["held_out_final"] = final_eval
                (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
                self.tracker.message(f"{self.method}: done; final checkpoint {final}")
                return summary
            except (Interrupted, ActorLostError) as stop:
                ledger.stop = f"signal {stop}" if isinstance(stop, Interrupted) else f"lost actor: {stop}"
                failed = stop
                try:
                    self._stop_cleanly(stop)
                except Exception as exc:  # the stop-time checkpoint could not be written (SystemExit passes)
                    if write_error(exc) is None:
                        raise
                    raise self._write_failed(write_error(exc)) from None
            except BaseException as exc:
                ledger.stop, failed = f"error: {one_line(exc)}", exc
                if write_error(exc) is not None:  # a full or read-only disk: one line naming the fix
                    raise self._write_failed(write_error(exc)) from None
                raise
            finally:
                for group in self.groups:  # what the run cost, also when it stopped early
                    ledger.add_group(group, cfg.cluster)
                    group.kill()
                try:
                    ledger.write(self.run_dir, finished, end_step=self.done)
                except OSError as exc:  # never hides the error that stopped the run
                    if failed is None and write_error(exc) is not None:
                        raise self._write_failed(exc) from None
                    if failed is None:
                        raise
                finally:
                    self.close()
                    self.tracker.close()
                    unlock_run_dir(self.run_dir)  # the next driver (a resume) may take the run dir

    def _nothing_left(self) -> dict | None:
        """A resume of a run that already finished every step (its summary.json and final checkpoint written, for
        as many steps as the config asks): said in one line, and its summary returned; None when there is work."""
        if not self.cfg.run.resume or self.start < self.total:
            return None
        path = self.run_dir / "summary.json"
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            return None  # stopped after its last step but before the end: the final checkpoint is still to write
        final = summary.get("final_checkpoint")
        if (
            not final
            or not Path(final).is_dir()
            or (summary.get("held_out_final") or {}).get("after", self.done) != self.done
        ):
            return None
        key = {"iteration": "es.iterations", "step": "grpo.steps"}.get(self.unit, "the step count")
        units = f"{self.total} {self.unit}{'s' * (self.total != 1)}"
        print(
            f"{self.method}: nothing to do: {self.run_dir} already ran all {units} and holds its "
            f"final checkpoint {final}; raise {key}= to extend it",
            flush=True,
        )
        return summary

    ledger = None
    guard = None
    rebuilt: Sequence[dict] = ()
    """Metrics rows a resume rebuilt (from the seed log) where metrics.jsonl lacked them: written to the trackers."""
    _recorded = -1
    """The last step whose row is recorded."""

    def record(self, t: int, row: dict) -> None:
        """Step t's record: held-out scoring (eval.every) into its row, the row to every tracker, its cost to the
        ledger. A method whose commit is a log of its own (ES's seed log) calls this before writing it, so a step in
        that log always has its row; otherwise the skeleton calls it once the step returns."""
        ledger = self.ledger
        with ledger.apart("held_out"):  # not training: its device time and tokens are counted apart
            eval_tokens = self._held_out(t, row)
        row.update(self.events())
        self.tracker.log(t, row, step_key=self.unit)
        ledger.add_step(
            row,
            row["perf/tokens"],
            row.get("perf/tokens_backpropagated", 0),
            eval_tokens,
            self.groups,
            self.cfg.cluster,
        )
        for group in self.groups:  # the time held so far, for the ledger written after every step
            ledger.add_group(group, self.cfg.cluster, ask=False)
        self.history.append(row)
        self._recorded = t

    def _checkpoint_dir(self, done: int) -> Path:
        return self.run_dir / "checkpoints" / f"{self.checkpoint_prefix}_{done:06d}"

    # -- checkpoints in bounds (run.keep_checkpoints) ------------------------------------------------------------
    def prune(self) -> None:
        """run.keep_checkpoints: the numbered checkpoints beyond the newest k are deleted (final never)."""
        gone = prune_checkpoints(self.run_dir / "checkpoints", self.checkpoint_prefix, self.cfg.run.keep_checkpoints)
        if gone:
            self.tracker.message(
                f"{self.method}: removed {', '.join(d.name for d in gone)} (run.keep_checkpoints="
                f"{self.cfg.run.keep_checkpoints} keeps the newest and final)"
            )

    def keep_earlier_final(self, final: Path) -> None:
        """A finished run extended: its earlier final is kept as <prefix>_<its steps> (hard links: no second copy
        on disk) before the new final replaces it, and recorded so run.keep_checkpoints never deletes it (else an
        extension with more periodic checkpoints than the bound would delete it as soon as it was kept)."""
        if not final.is_dir():
            return
        try:
            n = int(read_meta(final, self.method)[self.unit])
        except (OSError, ValueError, KeyError, TypeError):  # not a checkpoint this run can read: left as it is
            return
        dst = self._checkpoint_dir(n)
        if n != self.done and not dst.exists():
            keep_as(final, dst)
            mark_kept_final(dst.parent, dst.name)
            self.tracker.message(f"{self.method}: the earlier final ({n} {self.unit}(s)) is kept as {dst.name}")

    def check_disk(self) -> str:
        """The disk a checkpoint takes (the newest of this run's, else ``checkpoint_copies`` fp32 copies of the
        model's weights) against the free space of run.dir for those this run keeps at once; a run whose
        checkpoints cannot fit is refused (ConfigError naming the keys). Returns the line to print ('' when no
        estimate: a model this machine does not hold)."""
        run = self.cfg.run
        present = checkpoint_dirs(self.run_dir / "checkpoints")
        per, how = (dir_bytes(present[-1]), f"as {present[-1].name}") if present else (self.estimate_bytes(), "")
        if not per:
            return ""
        how = how or f"{self.checkpoint_copies} fp32 cop{'y' if self.checkpoint_copies == 1 else 'ies'} of the weights"
        periodic = sum(due(run.checkpoint_every, t, self.total) for t in range(self.start, self.total))
        kept = min(periodic, run.keep_checkpoints) if run.keep_checkpoints else periodic
        at_once = kept + 2  # the numbered ones kept, final, and the one being written before the old one goes
        need = per * max(1, at_once - len(present))
        free = shutil.disk_usage(self.run_dir).free
        line = (
            f"a checkpoint takes {_gb(per)} ({how}); {kept} numbered (run.keep_checkpoints="
            f"{run.keep_checkpoints}) + final + one being written need {_gb(need)} more, {_gb(free)} free in "
            f"{self.run_dir}"
        )
        if need > free:
            raise ConfigError(
                f"{self.method}: {line}: the checkpoints cannot fit; free space there, keep fewer "
                "(run.keep_checkpoints=1), write fewer (run.checkpoint_every=0), or choose another "
                "run.dir"
            )
        return line

    def estimate_bytes(self) -> int:
        """``checkpoint_copies`` x 4 bytes x the model's parameters (read from its safetensors headers), where this
        machine holds the model (0 otherwise, or with no copies declared)."""
        if not self.checkpoint_copies or self.cfg.cluster.address:
            return 0
        try:
            index = safetensors_index(resolve_model(self.cfg.model.path))
        except Exception:  # noqa: BLE001 - only an estimate: the actors check the model themselves
            return 0
        return self.checkpoint_copies * 4 * sum(math.prod(shape) for _, shape in index.values())

    def _held_out(self, t: int, row: dict) -> int:
        """eval.every (and the first and the last step): the current weights on the held-out set into the row
        (eval/reward, eval/pass_at_1, ...); returns the tokens generated."""
        every = self.cfg.eval.every
        if not every or ((t + 1) % every and t != 0 and t + 1 != self.total):
            return 0
        res = self.evaluate_held_out()
        row.update(held_out_row(res))
        self.tracker.held_out(t, row)
        return res["tokens"]

    def _final_held_out(self) -> dict | None:
        """The held-out scores of the weights a finished segment ends with (summary.json's held_out_final): the
        last row's, or scored now where that row has none (a budget stop, a resume with nothing left to run)."""
        if not self.cfg.eval.every:
            return None
        last = self.history[-1] if self.history else {}
        if "eval/reward" not in last or self._recorded < 0:
            with self.ledger.apart("held_out"):
                res = self.evaluate_held_out()
                self.ledger.tokens_generated_eval += int(res["tokens"])
            last = held_out_row(res)
            self.tracker.held_out(self.done - 1, last)
        return {"after": self.done, **{k.removeprefix("eval/"): v for k, v in last.items() if k.startswith("eval/")}}

    def _write_failed(self, err: OSError):
        """A write into the run dir failed (no space, a quota, read-only): the error to raise, one line naming the
        fix and the resume command (what is committed stays: every file is replaced whole or cut back on resume)."""
        where = err.filename or "a file of the run (a checkpoint, or a log)"
        return RunDirError(
            f"{self.method}: writing into run.dir={self.run_dir} failed: {err.strerror} ({where}); "
            f"{self.done} {self.unit}(s) are committed{self.stop_note()}. Free space on that file "
            f"system or make it writable, then continue with: "
            f"{resume_command(self.method, self.run_dir)}"
        )

    def _stop_cleanly(self, stop) -> None:
        """After SIGTERM / Ctrl-C, or an actor lost for good (its node gone and no room for a replacement): a
        checkpoint of the completed steps (a step and what must follow it are never split by a signal), then exit
        non-zero with the resume command."""
        done = self.done
        if self.guard is not None:  # the step that ran at the signal is recorded: the checkpoint's own grace
            self.guard.rearm()
        saved = self.save_at_stop(stop, done)
        if saved:
            self.prune()
        cause = stop if not isinstance(stop, ActorLostError) else f"a lost actor ({stop})"
        self.tracker.message(
            f"{self.method}: stopped by {cause} after {done} {self.unit}(s); "
            f"{'checkpoint ' + saved if saved else 'no new checkpoint'}{self.stop_note()}. "
            f"Continue with: {resume_command(self.method, self.run_dir)}"
        )
        raise SystemExit(stop.exit_code)

    def stop_note(self) -> str:
        """What the stop message adds after the checkpoint (ES: the seed log)."""
        return ""
