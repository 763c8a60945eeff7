"""run.resume=true continues a stopped ES run to the same final weights, bit for bit, as the run left alone: after
a run stopped on a replica mismatch (checkpoint + seed-log replay) and after `es-train` got SIGTERM."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import time

import pytest
from helpers import alive_es_actors, assert_same_weights, final_weights, flip_byte, log_rows, tiny_cfg

from es_ray.es.state import SeedLog
from es_ray.es.config import ESTrainConfig
from es_ray.core.config import ConfigError
from es_ray.es.driver import run
from es_ray.es.recovery import RESUME_FREE, ReplicaMismatchError
from es_ray.runtime.checkpoint import CheckpointError
from es_ray.runtime.rundir import check_same_run

pytestmark = pytest.mark.ray

ITERATIONS = 4


def resume_cfg(model_dir, run_dir, **over):
    """Adam, so the optimizer state must survive the checkpoint too."""
    base = dict(es__iterations=ITERATIONS, es__optimizer="adam", es__lr=1e-3, run__checkpoint_every=2, eval__every=0)
    return tiny_cfg(model_dir, run_dir, **{**base, **over})


@pytest.fixture(scope="module")
def reference(ray_local, tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    return run_dir, final_weights(run(resume_cfg(tiny_model_dir, run_dir)))


def test_run_stopped_on_a_mismatch_resumes_to_the_same_weights(reference, tiny_model_dir, tmp_path):
    """Two actors stop at iteration 3 (one replica corrupted); one actor resumes from iter_2 + 1 replayed update."""
    stopped = resume_cfg(
        tiny_model_dir, tmp_path, cluster__num_actors=2, faults__corrupt_replica_at_iteration=3, faults__actor_rank=1
    )
    with pytest.raises(ReplicaMismatchError, match=r"iteration 3: replica checksums differ.*es\.on_mismatch=rebuild"):
        run(stopped)
    assert len(SeedLog.read(tmp_path / "seed_log.jsonl")) == 3
    with open(tmp_path / "seed_log.jsonl", "a") as f:  # a crash mid-write leaves a torn line: it must be cut
        f.write('{"iteration": 3, "sigma"')
    summary = run(resume_cfg(tiny_model_dir, tmp_path, run__resume=True))
    assert_same_weights(final_weights(summary), reference[1])
    ref_log, log = log_rows(reference[0], "seed_log.jsonl"), log_rows(tmp_path, "seed_log.jsonl")
    assert [r["checksum"] for r in log] == [r["checksum"] for r in ref_log] and len(log) == ITERATIONS
    assert [r["iteration"] for r in log_rows(tmp_path, "metrics.jsonl")] == list(range(ITERATIONS))
    assert len(summary["reward_mean"]) == ITERATIONS


def _cli_overrides(cfg: ESTrainConfig) -> list[str]:
    """The settings of cfg that differ from the defaults, as es-train arguments."""
    default = dataclasses.asdict(ESTrainConfig())
    out = []
    for section, fields in dataclasses.asdict(cfg).items():
        for key, value in fields.items():
            if value != default[section][key]:
                text = json.dumps(value) if isinstance(value, bool) else repr(value)
                out.append(f"{section}.{key}={text}")
    return out


def test_sigterm_writes_a_checkpoint_exits_cleanly_and_resumes_exactly(reference, ray_local, tiny_model_dir, tmp_path):
    cfg = resume_cfg(tiny_model_dir, tmp_path, faults__actor_delay_s=1.5)
    address = ray_local.get_runtime_context().gcs_address
    proc = subprocess.Popen(
        ["es-train", *_cli_overrides(cfg), f"cluster.address={address}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log = tmp_path / "seed_log.jsonl"
    deadline = time.monotonic() + 240
    while not (log.is_file() and log.read_text().count("\n") >= 1) and proc.poll() is None:
        assert time.monotonic() < deadline, "es-train logged no iteration in time"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped by SIGTERM" in out and "run.resume=true" in out, out[-3000:]
    done = len(SeedLog.read(log))
    assert 1 <= done < ITERATIONS
    assert (tmp_path / "checkpoints" / f"iter_{done:06d}" / "model.safetensors").is_file()
    assert not alive_es_actors()

    # every logged iteration has its row (written before its seed-log line); without a terminal, one line a step
    assert len(log_rows(tmp_path, "metrics.jsonl")) >= done
    assert f"es iteration {done}/{ITERATIONS}" in out and " eta " in out, out[-3000:]
    assert "Loading weights" not in out and "Token authentication" not in out  # run.verbose=false
    summary = run(resume_cfg(tiny_model_dir, tmp_path, run__resume=True))
    assert_same_weights(final_weights(summary), reference[1])
    # the record: rows, values and ledger as the uninterrupted run's, plus the work it names as done twice
    rows, ref_rows = log_rows(tmp_path, "metrics.jsonl"), log_rows(reference[0], "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [r["iteration"] for r in log_rows(tmp_path, "seed_log.jsonl")]
    keys = ("iteration", "reward/mean", "perf/tokens", "es/update_norm")
    assert [{k: r[k] for k in keys} for r in rows] == [{k: r[k] for k in keys} for r in ref_rows]
    ledger, ref_ledger = (json.loads((d / "ledger.json").read_text()) for d in (tmp_path, reference[0]))
    assert [s["stop"] for s in ledger["segments"]] == ["signal SIGTERM", "finished"]
    assert ledger["segments"][1]["start_step"] == done and ledger["steps"] == ITERATIONS
    assert ledger["tokens_generated"] == ref_ledger["tokens_generated"] + ledger["redone"]["tokens_generated"]


def test_resume_refuses_settings_that_change_the_run(tiny_model_dir, tmp_path):
    old = dataclasses.asdict(resume_cfg(tiny_model_dir, tmp_path))
    check_same_run(
        old,
        resume_cfg(
            tiny_model_dir,
            tmp_path,
            es__iterations=9,
            cluster__num_actors=2,
            run__resume=True,
            faults__actor_delay_s=1.0,
        ),
        RESUME_FREE,
    )
    with pytest.raises(ConfigError, match=r"es\.sigma"):
        check_same_run(old, resume_cfg(tiny_model_dir, tmp_path, es__sigma=0.05, run__resume=True), RESUME_FREE)
    os.makedirs(tmp_path / "checkpoints")
    (tmp_path / "config.json").write_text(json.dumps(old))
    (tmp_path / "seed_log.jsonl").write_text(json.dumps({"iteration": 1}) + "\n")
    with pytest.raises(ConfigError, match="iterations 0, 1, 2"):
        run(resume_cfg(tiny_model_dir, tmp_path, run__resume=True))


def test_resume_refuses_a_corrupted_checkpoint_or_seed_log_naming_the_file(reference, tiny_model_dir, tmp_path):
    """A copy of the finished reference run: one flipped byte in the final checkpoint's weights stops the resume
    with one line naming the file (not a checksum mismatch blamed on the hardware); a changed record in the middle
    of the seed log stops it before any actor starts, naming the line. Each resume extends the run by one iteration:
    a finished run resumed with nothing left to do reads no checkpoint (it says so and starts nothing)."""
    shutil.copytree(reference[0], tmp_path, dirs_exist_ok=True)
    weights = tmp_path / "checkpoints" / "final" / "model.safetensors"
    flip_byte(weights)
    with pytest.raises(CheckpointError) as err:
        run(resume_cfg(tiny_model_dir, tmp_path, run__resume=True, es__iterations=ITERATIONS + 1))
    assert str(err.value).startswith(f"{weights}: sha256") and "\n" not in str(err.value)
    assert not alive_es_actors()
    lines = (tmp_path / "seed_log.jsonl").read_text().split("\n")
    lines[1] = lines[1].replace('"iteration": 1', '"iteration": 1, "x": 0')
    (tmp_path / "seed_log.jsonl").write_text("\n".join(lines))
    with pytest.raises(ConfigError, match=r"seed_log\.jsonl: line 2 is corrupted"):
        run(resume_cfg(tiny_model_dir, tmp_path, run__resume=True, es__iterations=ITERATIONS + 1))
