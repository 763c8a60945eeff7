"""The run skeleton (es_ray.runtime.loop.Training) with a stand-in method: no Ray, no model, only the skeleton's
own duties: the held-out cadence and base point, the tracker rows, periodic and final checkpoints, the token budget
counted across a resume, and the clean stop with the resume command."""

from __future__ import annotations

import dataclasses
import json
import os
import signal

import pytest

from es_ray.core.config import ConfigError
from es_ray.es.config import ESTrainConfig
from es_ray.runtime.loop import Training, due
from es_ray.runtime.rundir import changed_settings
from es_ray.runtime.signals import Interrupted
from paths import REPO

TOKENS = 100  # each stand-in step generates this many tokens


class StandIn(Training):
    method, unit, checkpoint_prefix = "grpo", "step", "step"

    def __init__(self, cfg, run_dir, total, start=0, history=None, interrupt_at=None):
        super().__init__(cfg, run_dir, total, start, history)
        self.calls: list[tuple] = []
        self.interrupt_at = interrupt_at
        self.closed = False

    def start_actors(self, guard):
        self.calls.append(("start",))

    def step(self, t, guard):
        if t == self.interrupt_at:
            raise Interrupted(signal.SIGTERM)
        self.calls.append(("step", t))
        return {"reward/mean": float(t), "perf/tokens": TOKENS, "timing_s/generate": 0.01}

    def evaluate_held_out(self):
        self.calls.append(("held_out",))
        return {"reward": 0.5, "pass_at_1": 0.5, "entropy": 1.0, "tokens": 7, "errors": 0, "seconds": 0.0}

    def save(self, path, done):
        self.calls.append(("save", path.name, done))
        return str(path)

    def save_at_stop(self, stop, done):
        self.calls.append(("stop_save", done))
        return self.save(self._checkpoint_dir(done), done)

    def close(self):
        self.closed = True


def config(tmp_path, **run):
    cfg = ESTrainConfig()
    run = {"progress": False, **run}
    return dataclasses.replace(
        cfg, run=dataclasses.replace(cfg.run, dir=str(tmp_path), **run), eval=dataclasses.replace(cfg.eval, every=2)
    )


@pytest.fixture(autouse=True, scope="module")
def no_cluster():
    """No Ray for the stand-ins, module fixtures included (a function-scoped patch would come after them, and a
    module fixture's run would start a local Ray that the next module's own Ray then collides with)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("es_ray.runtime.cluster.connect", lambda cluster, verbose=False: None)
        yield


def test_a_run_steps_scores_checkpoints_and_summarises(tmp_path):
    job = StandIn(config(tmp_path, checkpoint_every=2), tmp_path, total=5)
    summary = job.run()
    saves = [c for c in job.calls if c[0] == "save"]
    assert saves == [("save", "step_000002", 2), ("save", "step_000004", 4), ("save", "final", 5)]
    # the base point, then after steps 0 (the first), 1 and 3 (every 2nd) and 4 (the last: the final evaluation)
    assert [i for i, c in enumerate(job.calls) if c == ("held_out",)] == [1, 3, 5, 9, 12]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [("eval/reward" in r) for r in rows] == [True, True, False, True, True]
    assert summary["reward_mean"] == [0.0, 1.0, 2.0, 3.0, 4.0] and summary["eval_reward"] == [0.5] * 4
    assert summary["held_out_final"] == {
        "after": 5,
        "reward": 0.5,
        "pass_at_1": 0.5,
        "entropy": 1.0,
        "tokens": 7,
        "errors": 0,
    }
    assert json.loads((tmp_path / "summary.json").read_text())["final_checkpoint"].endswith("final")
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert ledger["finished"] is True and ledger["tokens_generated"] == 5 * TOKENS
    assert ledger["tokens_generated_eval"] == 5 * 7  # held-out tokens counted apart, the base point's too
    assert job.closed


def test_the_token_budget_counts_the_steps_before_a_resume(tmp_path):
    before = [{"step": t, "reward/mean": 0.0, "perf/tokens": TOKENS} for t in range(3)]
    job = StandIn(config(tmp_path, stop_at_tokens=5 * TOKENS), tmp_path, total=10, start=3, history=before)
    summary = job.run()
    # 3 steps before the resume + 2 now reach the budget: the run stops there, not 5 steps later
    assert [c[1] for c in job.calls if c[0] == "step"] == [3, 4]
    assert ("save", "final", 5) in job.calls and len(summary["reward_mean"]) == 5
    assert not any(c == ("held_out",) for c in job.calls[:2])  # no base point on a resume
    assert json.loads((tmp_path / "ledger.json").read_text())["stop_reason"].startswith("run.stop_at_tokens")


def test_a_signal_saves_the_completed_steps_and_exits_with_the_resume_command(tmp_path, capsys):
    job = StandIn(config(tmp_path), tmp_path, total=5, interrupt_at=3)
    with pytest.raises(SystemExit) as exit_:
        job.run()
    assert exit_.value.code == 128 + signal.SIGTERM
    assert ("stop_save", 3) in job.calls and not any(c[1] == "final" for c in job.calls if c[0] == "save")
    out = capsys.readouterr().out
    assert "grpo: stopped by SIGTERM after 3 step(s); checkpoint" in out
    assert f"Continue with: grpo-train run.resume=true run.dir={tmp_path}" in out
    assert json.loads((tmp_path / "ledger.json").read_text())["finished"] is False and job.closed


def test_cadence():
    assert [t for t in range(10) if due(3, t, 10)] == [2, 5, 8]
    assert [t for t in range(9) if due(3, t, 9)] == [2, 5]  # never at the last step: the final checkpoint is
    assert not any(due(0, t, 10) for t in range(10))


def test_changed_settings_ignores_free_keys_and_faults_and_reads_missing_keys_as_asked():
    old = {"es.sigma": 0.001, "run.progress": True, "faults.kill_actor_at": -1, "es.rank": 8}
    new = {"es.sigma": 0.002, "run.progress": False, "faults.kill_actor_at": 3, "es.new_key": 1}
    assert changed_settings(old, new, {"run.progress"}) == ["es.sigma"]
    assert changed_settings(old, new, {"run.progress"}, missing=True) == ["es.new_key", "es.rank", "es.sigma"]
    assert changed_settings(old, dict(old)) == []


# -- an interrupt at each phase of an iteration, then a resume: the record equals an uninterrupted run's ----------

PHASES = ("evaluate", "update", "held_out", "logged", "checkpoint", "crash_before_log")
"""Where the stand-in ES iteration gets SIGINT (or, for crash_before_log, dies between its metrics row and its
seed-log line, as a kill -9 there would leave it)."""


class Crash(Exception):
    pass


class LoggedStandIn(Training):
    """ES's shape without Ray: evaluate (interruptible), then in a critical stretch the update, the record (the
    skeleton's held-out scoring, trackers and ledger) and the seed-log line that commits the iteration."""

    method, unit, checkpoint_prefix = "es", "iteration", "iter"

    def __init__(self, cfg, run_dir, total, point=None, phase=None, at=2):
        from es_ray.es.recovery import ResumePoint

        point = point or ResumePoint()
        super().__init__(cfg, run_dir, total, point.start, point.history)
        self.rebuilt, self.phase, self.at, self.committed = point.rebuilt, phase, at, point.start
        self.log = open(run_dir / "seed_log.jsonl", "a")

    def _maybe(self, phase, t, guard):
        if (self.phase, self.at) == (phase, t):
            os.kill(os.getpid(), signal.SIGINT)
            guard.check()  # what an actor group's wait loop does while the actors work

    def start_actors(self, guard):
        pass

    def step(self, t, guard):
        self._maybe("evaluate", t, guard)
        rewards = [0.1 * t, 0.2 * t + 0.05, 0.3]
        row = {"reward/mean": sum(rewards) / 3, "perf/tokens": TOKENS + t, "timing_s/evaluate": 0.01}
        with guard.critical():
            self._maybe("update", t, guard)
            self.committed_row = row
            self.record(t, row)
            if (self.phase, self.at) == ("crash_before_log", t):
                raise Crash()
            self.log.write(
                json.dumps({"iteration": t, "rewards": rewards, "fitness": [1.0, 0.0, -1.0], "checksum": f"c{t}"})
                + "\n"
            )
            self.log.flush()
            self.committed = t + 1
            self._maybe("logged", t, guard)
        return row

    def evaluate_held_out(self):
        self._maybe("held_out", self.committed + 1, self.guard)  # scored after iteration 1 (eval.every=2)
        return {
            "reward": 0.01 * self.committed,
            "pass_at_1": 0.0,
            "entropy": None,
            "tokens": 7,
            "errors": 0,
            "seconds": 0.0,
        }

    def save(self, path, done):
        if path.name != "final":
            self._maybe("checkpoint", done - 1, self.guard)
        return str(path)

    def save_at_stop(self, stop, done):
        return ""

    @property
    def done(self):
        return self.committed

    def close(self):
        self.log.close()


def _resume_point(cfg, run_dir):
    """ES's resume point from the stand-in's seed log (the real reader and row rebuilding)."""
    from es_ray.es.recovery import ResumePoint, rebuild_rows
    from es_ray.es.state import SeedLog
    from es_ray.runtime.rundir import keep_metrics, write_metrics

    records = SeedLog.recover(run_dir / "seed_log.jsonl")
    history, rebuilt = rebuild_rows(
        records, keep_metrics(run_dir / "metrics.jsonl", len(records), "iteration"), run_dir
    )
    if rebuilt:
        write_metrics(run_dir / "metrics.jsonl", history)
    return ResumePoint(start=len(records), history=history, rebuilt=rebuilt)


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _interrupted_then_resumed(tmp_path, phase, total=4):
    run_dir = tmp_path / phase
    run_dir.mkdir()
    cfg = config(run_dir, checkpoint_every=1)
    with pytest.raises((SystemExit, Crash)):
        LoggedStandIn(cfg, run_dir, total, phase=phase).run()
    stopped = {"rows": len(_rows(run_dir)), "logged": len((run_dir / "seed_log.jsonl").read_text().splitlines())}
    resumed = config(run_dir, checkpoint_every=1, resume=True)
    LoggedStandIn(resumed, run_dir, total, point=_resume_point(resumed, run_dir)).run()
    return run_dir, stopped


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    LoggedStandIn(config(run_dir, checkpoint_every=1), run_dir, 4).run()
    return _rows(run_dir), json.loads((run_dir / "ledger.json").read_text())


@pytest.mark.parametrize("phase", PHASES)
def test_an_interrupt_at_any_phase_then_a_resume_records_what_an_uninterrupted_run_does(phase, tmp_path, uninterrupted):
    ref_rows, ref_ledger = uninterrupted
    run_dir, stopped = _interrupted_then_resumed(tmp_path, phase)
    # at the stop: every logged iteration has its row (a row may lead its log line, never trail it)
    assert stopped["rows"] >= stopped["logged"]
    rows = _rows(run_dir)
    keys = ("iteration", "reward/mean", "perf/tokens", "eval/reward")
    assert [{k: r.get(k) for k in keys} for r in rows] == [{k: r.get(k) for k in keys} for r in ref_rows]
    log = [json.loads(line) for line in (run_dir / "seed_log.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in log] == [r["iteration"] for r in rows] == [0, 1, 2, 3]
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert len(ledger["segments"]) == 2 and ledger["finished"]
    first, second = ledger["segments"]
    assert first["stop"] == ("error: Crash: " if phase == "crash_before_log" else "signal SIGINT")
    assert second["stop"] == "finished" and second["start_step"] == first["end_step"]
    # the run's tokens: the uninterrupted run's plus the work done twice, which the ledger names
    assert ledger["tokens_generated"] == ref_ledger["tokens_generated"] + ledger["redone"]["tokens_generated"]
    assert ledger["redone"]["steps"] == (1 if phase == "crash_before_log" else 0)
    assert ledger["steps"] == 4 and ledger["steps_computed"] == 4 + ledger["redone"]["steps"]
    assert json.loads((run_dir / "summary.json").read_text())["held_out_final"]["after"] == 4


def test_a_resume_rebuilds_rows_the_metrics_lack_and_refuses_rows_that_contradict_the_seed_log(tmp_path):
    cfg = config(tmp_path)
    LoggedStandIn(cfg, tmp_path, 3).run()
    rows = _rows(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["iteration"] != 1))
    point = _resume_point(cfg, tmp_path)
    assert [r["iteration"] for r in point.rebuilt] == [1] and point.rebuilt[0]["resume/rebuilt"] is True
    assert point.rebuilt[0]["reward/mean"] == pytest.approx(rows[1]["reward/mean"], abs=1e-15)
    assert [r["iteration"] for r in _rows(tmp_path)] == [0, 1, 2]  # written back in order
    bad = [dict(r, **{"reward/mean": 9.0}) if r["iteration"] == 2 else r for r in _rows(tmp_path)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad + bad[:1]))
    with pytest.raises(ConfigError, match=r"iterations 0 have two rows; iterations 2 give a reward/mean"):
        _resume_point(cfg, tmp_path)


def test_without_a_terminal_each_step_and_each_held_out_scoring_is_one_line(tmp_path, capsys):
    LoggedStandIn(config(tmp_path, progress=True), tmp_path, 3).run()  # progress=true, but stderr is no terminal
    out = capsys.readouterr().out.splitlines()
    steps = [line for line in out if line.startswith("es iteration")]
    assert [line.split()[2] for line in steps] == ["1/3", "2/3", "3/3"]
    assert all(" reward " in line and "heldout_reward" in line for line in steps), steps
    assert all("elapsed" in line and "eta" in line for line in steps)
    assert sum(line.startswith("es held-out (") for line in out) == 4  # base, after 0, after 1 (every 2), last


# -- kill -9 at each phase (no handler runs, nothing in `finally`), then a resume: the same record -----------------


class KilledStandIn(LoggedStandIn):
    """The stand-in killed without warning at its phase (os._exit in a forked child: what SIGKILL leaves)."""

    def _maybe(self, phase, t, guard):
        if (self.phase, self.at) == (phase, t):
            os._exit(137)


def _killed_then_resumed(run_dir, phase, total=4):
    cfg = config(run_dir, checkpoint_every=1)
    pid = os.fork()
    if pid == 0:  # the child: the driver that gets killed
        try:
            KilledStandIn(cfg, run_dir, total, phase=phase).run()
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] >> 8 == 137, "the stand-in was not killed at its phase"
    resumed = config(run_dir, checkpoint_every=1, resume=True)
    LoggedStandIn(resumed, run_dir, total, point=_resume_point(resumed, run_dir)).run()


@pytest.mark.parametrize("phase", ("evaluate", "update", "held_out", "logged", "checkpoint"))
def test_a_kill_at_any_phase_then_a_resume_records_what_an_uninterrupted_run_does(
    phase, tmp_path, uninterrupted, capsys
):
    ref_rows, ref_ledger = uninterrupted
    _killed_then_resumed(tmp_path, phase)
    keys = ("iteration", "reward/mean", "perf/tokens", "eval/reward")
    assert [{k: r.get(k) for k in keys} for r in _rows(tmp_path)] == [{k: r.get(k) for k in keys} for r in ref_rows]
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    # "logged": killed after iteration 2's seed-log line, before its ledger write; the ledger takes it from its row
    assert ledger["tokens_generated"] == ref_ledger["tokens_generated"] + ledger["redone"]["tokens_generated"]
    assert ledger["tokens_generated_eval"] == ref_ledger["tokens_generated_eval"]
    assert ledger["steps"] == 4 and ledger["segments"][0]["stop"].startswith("killed")
    assert ledger["segments"][-1]["stop"] == "finished"
    assert ("killed before its ledger write" in capsys.readouterr().out) == (phase == "logged")


# -- a full or read-only disk: one line naming the fix, the error not hidden by the ledger's own failed write -------


class ActorTaskError(Exception):
    """What Ray raises for an actor's error: its text a coloured traceback, the actor's exception its ``cause``."""

    def __init__(self, cause):
        super().__init__("\x1b[36mray::ESWorker.save_checkpoint()\x1b[39m (pid=1)\n  File ...\nOSError: ...")
        self.cause = cause


@pytest.mark.parametrize("where", ("seed_log", "checkpoint", "stop_checkpoint"))
def test_a_full_disk_stops_the_run_in_one_line_naming_the_fix(where, tmp_path, monkeypatch, capsys):
    import errno

    from es_ray.runtime.ledger import Ledger
    from es_ray.runtime.rundir import RunDirError

    full = OSError(errno.ENOSPC, "No space left on device")

    class FullDisk(LoggedStandIn):
        def step(self, t, guard):
            if where == "seed_log" and t == 2:
                raise full
            if where == "stop_checkpoint" and t == 2:
                raise Interrupted(signal.SIGTERM)
            return super().step(t, guard)

        def save(self, path, done):
            if where == "checkpoint" and done == 2:
                raise ActorTaskError(full)
            return super().save(path, done)

        def save_at_stop(self, stop, done):
            raise ActorTaskError(full)

    writes = []
    real_write = Ledger.write

    def ledger_write(self, *args, **kw):  # the disk is full for the ledger too once the run has failed
        writes.append(self.stop)
        if self.stop != "running":
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / ".ledger.json.tmp"))
        return real_write(self, *args, **kw)

    monkeypatch.setattr(Ledger, "write", ledger_write)
    with pytest.raises(RunDirError) as err:
        FullDisk(config(tmp_path, checkpoint_every=1), tmp_path, 4).run()
    msg = str(err.value)
    assert "\n" not in msg and f"writing into run.dir={tmp_path} failed: No space left on device" in msg
    assert "2 iteration(s) are committed" in msg and f"es-train run.resume=true run.dir={tmp_path}" in msg
    stop = writes[-1]
    assert stop == (
        "signal SIGTERM" if where == "stop_checkpoint" else "error: OSError: [Errno 28] No space left on device"
    )


# -- checkpoints in bounds (run.keep_checkpoints, the disk check, an extended run's earlier final) ---------------


class Writing(StandIn):
    """A stand-in whose checkpoints are real published directories (a 1000-byte file and the meta)."""

    def save(self, path, done):
        from es_ray.runtime.checkpoint import meta_file, publish_dir, staging_dir

        tmp = staging_dir(path)
        (tmp / "model.safetensors").write_bytes(bytes(1000))
        (tmp / meta_file("grpo")).write_text(json.dumps({"step": done}))
        self.calls.append(("save", path.name, done))
        return str(publish_dir(tmp, path))


def _names(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.startswith("."))


def test_keep_checkpoints_keeps_the_newest_and_final(tmp_path, capsys):
    Writing(config(tmp_path, checkpoint_every=1, keep_checkpoints=2), tmp_path, total=5).run()
    assert _names(tmp_path) == ["final", "step_000003", "step_000004"]
    assert "removed step_000001 (run.keep_checkpoints=2 keeps the newest and final)" in capsys.readouterr().out
    every = tmp_path / "all"
    every.mkdir()
    Writing(config(every, checkpoint_every=1, keep_checkpoints=0), every, total=5).run()
    assert _names(every) == ["final", *(f"step_{n:06d}" for n in range(1, 5))]


def test_a_stop_time_checkpoint_counts_against_the_bound(tmp_path):
    job = Writing(config(tmp_path, checkpoint_every=1, keep_checkpoints=1), tmp_path, total=5, interrupt_at=3)
    with pytest.raises(SystemExit):
        job.run()
    assert _names(tmp_path) == ["step_000003"]


def test_extending_a_finished_run_keeps_its_earlier_final(tmp_path, capsys):
    from es_ray.runtime.checkpoint import read_meta, verify_dir

    Writing(config(tmp_path), tmp_path, total=3).run()
    inode = (tmp_path / "checkpoints" / "final" / "model.safetensors").stat().st_ino
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    Writing(config(tmp_path, resume=True), tmp_path, total=5, start=3, history=rows).run()
    assert _names(tmp_path) == ["final", "step_000003"]
    kept = tmp_path / "checkpoints" / "step_000003"
    verify_dir(kept)  # its manifest went along: it loads as any checkpoint
    assert read_meta(kept, "grpo")["step"] == 3 and read_meta(tmp_path / "checkpoints" / "final", "grpo")["step"] == 5
    assert (kept / "model.safetensors").stat().st_ino == inode  # a hard link: no second copy on disk
    assert "the earlier final (3 step(s)) is kept as step_000003" in capsys.readouterr().out


def test_an_extended_runs_earlier_final_is_not_pruned_by_its_periodic_checkpoints(tmp_path, capsys):
    """An extension that writes periodic checkpoints (more than run.keep_checkpoints of them) still keeps the
    earlier final it announced; its own periodic ones rotate as ever, and so do a later extension's."""
    Writing(config(tmp_path), tmp_path, total=3).run()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    Writing(
        config(tmp_path, resume=True, checkpoint_every=1, keep_checkpoints=2), tmp_path, total=7, start=3, history=rows
    ).run()
    out = capsys.readouterr().out
    assert "the earlier final (3 step(s)) is kept as step_000003" in out
    assert "step_000003" not in out.split("is kept as step_000003", 1)[1]  # never announced as removed after
    assert _names(tmp_path) == ["final", "step_000003", "step_000005", "step_000006"]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    Writing(
        config(tmp_path, resume=True, checkpoint_every=1, keep_checkpoints=2), tmp_path, total=9, start=7, history=rows
    ).run()
    assert _names(tmp_path) == ["final", "step_000003", "step_000006", "step_000007", "step_000008"]


def test_without_hard_links_the_earlier_final_is_kept_as_a_copy(tmp_path, monkeypatch):
    """A file system without hard links (some network mounts): the earlier final is copied (no link to the new
    final's files) and loads as any checkpoint, with its own step."""
    import errno
    import os

    import es_ray.runtime.checkpoint as checkpoint

    Writing(config(tmp_path), tmp_path, total=3).run()
    before = (tmp_path / "checkpoints" / "final" / "model.safetensors").read_bytes()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]

    def no_link(src, dst):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(checkpoint.os, "link", no_link)
    Writing(config(tmp_path, resume=True), tmp_path, total=5, start=3, history=rows).run()
    kept = tmp_path / "checkpoints" / "step_000003"
    checkpoint.verify_dir(kept)
    assert (kept / "model.safetensors").stat().st_nlink == 1 and (kept / "model.safetensors").read_bytes() == before
    assert checkpoint.read_meta(kept, "grpo")["step"] == 3
    assert checkpoint.read_meta(tmp_path / "checkpoints" / "final", "grpo")["step"] == 5


class Estimated(StandIn):
    checkpoint_copies = 3

    def estimate_bytes(self):
        return 10**9


def test_the_disk_a_checkpoint_needs_is_printed_and_checked(tmp_path, capsys, monkeypatch):
    import shutil
    from collections import namedtuple

    Estimated(config(tmp_path, checkpoint_every=1, keep_checkpoints=2), tmp_path, total=5).run()
    out = capsys.readouterr().out
    assert (
        "a checkpoint takes 1.00 GB (3 fp32 copies of the weights); 2 numbered (run.keep_checkpoints=2) + final + "
        "one being written need 4.00 GB more" in out
    )
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**10, 10**10 - 3 * 10**9, 3 * 10**9))
    (tmp_path / "small").mkdir()
    (tmp_path / "one").mkdir()
    job = Estimated(config(tmp_path / "small", checkpoint_every=1, keep_checkpoints=2), tmp_path / "small", total=5)
    with pytest.raises(ConfigError, match=r"need 4\.00 GB more, 3\.00 GB free .*cannot fit.*run\.keep_checkpoints=1"):
        job.run()
    assert not job.calls  # refused before anything started
    Estimated(config(tmp_path / "one", checkpoint_every=1, keep_checkpoints=1), tmp_path / "one", total=5).run()


def test_a_negative_keep_checkpoints_is_refused_naming_the_key(tmp_path):
    from es_ray.runtime.validation import validate_run

    with pytest.raises(ConfigError, match=r"run\.keep_checkpoints=-1 must be >= 0"):
        validate_run(config(tmp_path, keep_checkpoints=-1).run)


# -- a stop during a long step keeps it (faults.stop_timeout_s covers the step, then the checkpoint apart) --------

_LONG_STEP = """
import dataclasses, json, os, signal, sys, time
from pathlib import Path
import ray  # imported now: the watchdog's own import of it would otherwise add its seconds to the grace
import es_ray.runtime.cluster as cluster
cluster.connect = lambda c, verbose=False: None
from es_ray.es.config import ESTrainConfig
from es_ray.runtime.loop import Training

run_dir = Path(sys.argv[1])

class Long(Training):
    method, unit, checkpoint_prefix = "grpo", "step", "step"
    def start_actors(self, guard): pass
    def step(self, t, guard):
        if t == 1:  # the signal comes while the learner's step runs; it returns 4 s later, within the 6 s grace
            os.kill(os.getpid(), signal.SIGTERM)
            with guard.critical():
                time.sleep(4.0)
        return {"reward/mean": 0.0, "perf/tokens": 1}
    def evaluate_held_out(self): raise AssertionError
    def save(self, path, done):
        time.sleep(4.0)  # the checkpoint takes longer than what is left of the grace after the step
        path.mkdir(parents=True)
        (path / "done").write_text(str(done))
        return str(path)
    def save_at_stop(self, stop, done):
        return self.save(self._checkpoint_dir(done), done)

cfg = ESTrainConfig()
cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(run_dir), progress=False, trackers=[]),
                          eval=dataclasses.replace(cfg.eval, every=0),
                          faults=dataclasses.replace(cfg.faults, stop_timeout_s=6.0))
Long(cfg, run_dir, total=4).run()
"""


def test_a_stop_during_a_long_step_saves_the_step_once_it_returns(tmp_path):
    """SIGTERM while a step's commit runs (the learner's step): the step returns within faults.stop_timeout_s and is
    recorded, and the stop-time checkpoint gets a grace of its own, so the finished step is saved (before, the one
    grace ran out during the checkpoint and nothing was saved)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _LONG_STEP, str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert (tmp_path / "checkpoints" / "step_000002" / "done").read_text() == "2", out[-3000:]
    assert "stopped by SIGTERM after 2 step(s)" in out and "Continue with: grpo-train run.resume=true" in out
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert ledger["state"] == "stopped" and ledger["segments"][-1]["stop"] == "signal SIGTERM"
    assert ledger["segments"][-1]["end_step"] == 2


def test_held_out_lines_count_iterations_as_the_step_line_and_the_summary_do(tmp_path, capsys):
    summary = LoggedStandIn(config(tmp_path, progress=True), tmp_path, 3).run()
    out = capsys.readouterr().out.splitlines()
    held = [line.split("(")[1].split(")")[0] for line in out if line.startswith("es held-out (")]
    assert held == ["base weights", "after iteration 1", "after iteration 2", "after iteration 3"]
    last_step = next(line for line in out if line.startswith("es iteration 3/3"))
    last_held = next(line for line in out if "after iteration 3" in line)
    assert last_held.split("reward ")[1].split()[0] == last_step.split("heldout_reward ")[1].split()[0]
    assert summary["held_out_final"]["after"] == 3


def test_a_resume_with_nothing_left_says_so_and_starts_nothing(tmp_path, capsys, monkeypatch):
    first = StandIn(config(tmp_path), tmp_path, total=3)
    first.run()
    (tmp_path / "checkpoints" / "final").mkdir(parents=True)  # the stand-in's save writes no files
    ledger = (tmp_path / "ledger.json").read_text()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    capsys.readouterr()

    def no_ray(*a, **kw):
        raise AssertionError("a resume with nothing to do connected to Ray")

    monkeypatch.setattr("es_ray.runtime.cluster.connect", no_ray)
    again = StandIn(config(tmp_path, resume=True), tmp_path, total=3, start=3, history=rows)
    summary = again.run()
    assert again.calls == [] and summary["final_checkpoint"].endswith("final")
    out = capsys.readouterr().out
    assert f"grpo: nothing to do: {tmp_path} already ran all 3 steps" in out and "grpo.steps=" in out
    assert (tmp_path / "ledger.json").read_text() == ledger  # no new segment
    more = StandIn(config(tmp_path, resume=True), tmp_path, total=4, start=3, history=rows)
    monkeypatch.setattr("es_ray.runtime.cluster.connect", lambda cluster, verbose=False: None)
    more.run()  # an extension still runs its new step
    assert ("step", 3) in more.calls
