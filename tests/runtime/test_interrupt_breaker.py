"""What the interrupt tests of the run skeleton do not try: a second driver on a live run dir, a ledger.json that is
lost or torn, and a kill between a step's commit and its ledger write. No Ray, no model: the run dir's lock and the
ledger's reader."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys

import pytest

from es_ray.core.config import ConfigError
from es_ray.es.config import ESTrainConfig
from es_ray.runtime.ledger import Ledger, earlier_segments
from es_ray.runtime.rundir import open_run_dir, unlock_run_dir

HOLD = """
import sys, time
from pathlib import Path
from es_ray.runtime.rundir import lock_run_dir
lock_run_dir(Path(sys.argv[1]), "es")
print("held", flush=True)
time.sleep(600)
"""


def _cfg(run_dir, **run):
    cfg = ESTrainConfig()
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(run_dir), progress=False, **run))


def test_a_second_driver_on_a_live_run_dir_is_refused_and_a_killed_drivers_hold_is_gone(tmp_path):
    run_dir = tmp_path / "run"
    open_run_dir(_cfg(run_dir), "es")
    (run_dir / "seed_log.jsonl").write_text("")
    unlock_run_dir(run_dir)  # this process's run ended; another driver takes the dir
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for cfg in (_cfg(run_dir, resume=True), _cfg(run_dir, overwrite=True)):
            with pytest.raises(ConfigError) as err:
                open_run_dir(cfg, "es")
            msg = str(err.value)
            assert f"run.dir={run_dir} is in use: another driver is running there" in msg and "\n" not in msg
            assert f"es-train run.resume=true run.dir={run_dir}" in msg
        assert (run_dir / "seed_log.jsonl").is_file()  # run.overwrite=true did not move the live run aside
    finally:
        holder.send_signal(signal.SIGKILL)  # a driver killed without warning: the kernel drops its hold
        holder.wait()
    assert open_run_dir(_cfg(run_dir, resume=True), "es") == run_dir
    unlock_run_dir(run_dir)


def test_a_refused_resume_leaves_no_hold_on_the_run_dir(tmp_path):
    """open_run_dir takes the lock before it compares settings; a resume it refuses releases it again, so this
    process (which lives on: es-compare, a notebook) does not keep another driver out."""
    run_dir = tmp_path / "run"
    open_run_dir(_cfg(run_dir), "es")
    unlock_run_dir(run_dir)
    cfg = _cfg(run_dir, resume=True)
    changed = dataclasses.replace(cfg, es=dataclasses.replace(cfg.es, sigma=cfg.es.sigma * 2))
    with pytest.raises(ConfigError, match="es.sigma"):
        open_run_dir(changed, "es")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read() if holder.poll() is not None else ""
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def _rows(n, tokens=100):
    return [{"iteration": t, "perf/tokens": tokens + t, "eval/tokens": 7, "timing_s/evaluate": 0.5} for t in range(n)]


def _ledger_of(run_dir, steps):
    led = Ledger("es", 0)
    for row in _rows(steps):
        led.add_step(row, row["perf/tokens"], 0, row["eval/tokens"])
    led.write(run_dir, False, end_step=steps)


@pytest.mark.parametrize("damage", ["torn", "missing", "garbage"])
def test_a_lost_or_torn_ledger_is_taken_from_the_metrics_rows_and_said(tmp_path, damage):
    _ledger_of(tmp_path, 3)
    path = tmp_path / "ledger.json"
    if damage == "torn":
        path.write_text(path.read_text()[: len(path.read_text()) // 2])
    elif damage == "missing":
        path.unlink()
    else:
        path.write_text("[1, 2]")
    segments, note = earlier_segments(tmp_path, 3, _rows(3), "iteration")
    assert [s["start_step"] for s in segments] == [0] and segments[0]["end_step"] == 3
    assert segments[0]["tokens_generated"] == 100 + 101 + 102 and segments[0]["tokens_generated_eval"] == 21
    assert segments[0]["step_tokens"] == [100, 101, 102] and segments[0]["stop"] == "unknown"
    assert "steps 0-2 are in the ledger from their metrics rows (303 tokens; device-seconds unknown)" in note
    assert str(path) in note and "\n" not in note
    total = Ledger("es", 3, segments).to_dict(True, end_step=3)
    assert total["tokens_generated"] == 303 and total["steps"] == 3 and total["start_step"] == 0


def test_a_kill_between_a_commit_and_its_ledger_write_keeps_that_steps_tokens(tmp_path):
    """The seed log holds 3 iterations, the ledger 2 (killed in between): the third comes from its metrics row;
    a row the resume rebuilt from the seed log (no tokens) is counted as unknown, not as zero work unsaid."""
    _ledger_of(tmp_path, 2)
    segments, note = earlier_segments(tmp_path, 3, _rows(3), "iteration")
    assert [(s["start_step"], s["end_step"]) for s in segments] == [(0, 2), (2, 3)]
    assert segments[1]["tokens_generated"] == 102 and "killed before its ledger write" in note
    assert Ledger("es", 3, segments).to_dict(True, end_step=3)["tokens_generated"] == 303
    rebuilt = [*_rows(2), {"iteration": 2, "reward/mean": 0.1, "resume/rebuilt": True}]
    segments, note = earlier_segments(tmp_path, 3, rebuilt, "iteration")
    assert segments[1]["steps_without_tokens"] == 1 and "1 step(s) without a token count" in note
    assert earlier_segments(tmp_path, 2, _rows(2), "iteration") == (earlier_segments(tmp_path)[0], "")
