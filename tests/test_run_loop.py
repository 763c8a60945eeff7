"""The run skeleton (es_ray.runtime.loop.Training) with a stand-in method: no Ray, no model, only the skeleton's
own duties: the held-out cadence and base point, the tracker rows, periodic and final checkpoints, the token budget
counted across a resume, and the clean stop with the resume command."""

from __future__ import annotations

import dataclasses
import json
import signal

import pytest

from es_ray.es.config import ESTrainConfig
from es_ray.runtime.loop import Training, due
from es_ray.runtime.rundir import changed_settings
from es_ray.runtime.signals import Interrupted

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
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(tmp_path), progress=False, **run),
                               eval=dataclasses.replace(cfg.eval, every=2))


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch):
    monkeypatch.setattr("es_ray.runtime.cluster.connect", lambda cluster: None)


def test_a_run_steps_scores_checkpoints_and_summarises(tmp_path):
    job = StandIn(config(tmp_path, checkpoint_every=2), tmp_path, total=5)
    summary = job.run()
    saves = [c for c in job.calls if c[0] == "save"]
    assert saves == [("save", "step_000002", 2), ("save", "step_000004", 4), ("save", "final", 5)]
    # the base point, then after steps 0 (the first), 1 and 3 (every 2nd)
    assert [i for i, c in enumerate(job.calls) if c == ("held_out",)] == [1, 3, 5, 9]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [("eval/reward" in r) for r in rows] == [True, True, False, True, False]
    assert summary["reward_mean"] == [0.0, 1.0, 2.0, 3.0, 4.0] and summary["eval_reward"] == [0.5, 0.5, 0.5]
    assert json.loads((tmp_path / "summary.json").read_text())["final_checkpoint"].endswith("final")
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert ledger["finished"] is True and ledger["tokens_generated"] == 5 * TOKENS
    assert ledger["tokens_generated_eval"] == 4 * 7  # held-out tokens counted apart, the base point's too
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
