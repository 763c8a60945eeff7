"""Start-up and shutdown of a command, split into phases, beside a bare Ray and the model load alone.

    python benchmarks/startup.py                                 # es-train, grpo-train, es-eval, baselines; 3 repeats
    python benchmarks/startup.py --commands es-eval --repeats 1

Each repeat of each command runs the real entry point (``es_ray.es.train:main``, ``es_ray.grpo.train:main``,
``es_ray.evaluation.es_eval:main``) in a fresh process on the CPU demo model (the embedded SmolLM2-135M) with a tiny
budget (``COMMANDS``: one iteration or step, no held-out scoring; es-eval 8 arithmetic problems). Timers are
wrapped around named functions (``TRACED``) in the driver and, through Ray's worker setup hook (``SETUP_HOOK_ENV``), in
every actor process; each writes (pid, event, time) to a trace file, and the phases are read off the trace:

  python         spawn until this harness runs (the interpreter)
  imports        the harness until the driver's first traced call: the entry point's imports, Hydra's
                 compose and the override check, the config's validation
  prepare        ``runtime.loop.prepare``: the memory plan, the model resolved (the embedded one converted once),
                 the task loaded, the run dir opened (es-eval: ``resolve_model`` and the rest of its set-up)
  ray_start      ``runtime.cluster.connect``: a local ``ray.init``
  actor_spawn    actors asked for until the first actor's class runs ``__init__`` (the worker process, Ray's
                 worker start, the actor module's imports there)
  model_load     ``PreTrainedModel.from_pretrained`` (the first actor's, or the driver's in-process)
  engine_build   ``engines.base.make_engine`` less the model load in it (the engine's libraries imported, the
                 tokenizer, the model moved and set up)
  actor_init     the rest of the first actor's ``__init__`` (task, grader, replica, ...)
  actors_ready   the last ``__init__`` done until the driver has all actors (ready calls, placement, checks)
  work           the iteration / step / evaluation itself (not a fixed cost)
  checkpoint     the method's ``save`` (the final checkpoint)
  other          what lies between the phases above before the driver's run returns (tracker, ledger, ...)
  shutdown       the entry point returning until the process has exited (actors killed, ``ray.shutdown``,
                 the interpreter's exit)

fixed = total - work, the cost a command pays whatever its budget. Baselines, each in its own process:
``bare_ray`` (``ray.init`` as the commands start it + ``ray.shutdown``), ``bare_ray_actor`` (the same plus one
actor created and called once) and ``model_load`` (torch and transformers imported and the demo model loaded).

Figures are medians over ``--repeats`` interleaved rounds (each round runs every command and baseline once, so a
busy minute on a shared machine touches all of them); the load average is printed before and after. The JSON
object on the last line holds: machine, settings, and per command and baseline its phases' medians
(``<name>/<phase>_s``), ``<name>/total_s``, ``<name>/fixed_s`` and ``<name>/fixed_over_bare_ray``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Imports stay inside the functions: what a command imports, and when, is what this benchmark times.

HERE = Path(__file__).resolve().parent
TRACE_ENV = "ES_RAY_STARTUP_TRACE"
SETUP_HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"  # ray._private.ray_constants, read by Ray's default_worker

COMMANDS = {
    "es-train": ("es_ray.es.train", ["es.iterations=1", "eval.every=0"]),
    "grpo-train": ("es_ray.grpo.train", ["grpo.steps=1", "eval.every=0"]),
    "es-eval": (
        "es_ray.evaluation.es_eval",
        ["eval.tasks=[arithmetic]", "eval.limit=8", "eval.n=4", "eval.k=[1,4]", "eval.max_new_tokens=32"],
    ),
}
"""command -> (its entry module, the overrides of its tiny budget); every command also gets run.dir and
run.progress=false."""
BASELINES = ("bare_ray", "bare_ray_actor", "model_load")

TRACED = {
    "es_ray.runtime.loop": [("prepare", "prepare")],
    "es_ray.runtime.cluster": [("connect", "ray_start")],
    "es_ray.models": [("resolve_model", "resolve_model")],
    "es_ray.engines.base": [("make_engine", "engine_build")],
    "transformers.modeling_utils": [("PreTrainedModel.from_pretrained", "model_load")],
    "es_ray.es.driver": [("ESRun.start_actors", "start_actors"), ("ESRun.step", "work"), ("ESRun.save", "checkpoint")],
    "es_ray.grpo.driver": [
        ("GRPORun.start_actors", "start_actors"),
        ("GRPORun.step", "work"),
        ("GRPORun.save", "checkpoint"),
    ],
    "es_ray.evaluation.es_eval": [("_run_chunks", "start_actors")],
    "es_ray.evaluation.worker": [("EvalWorker.__init__", "actor_init"), ("EvalWorker.run_chunk", "work")],
    "es_ray.es.worker": [("ESWorker.__init__", "actor_init")],
    "es_ray.grpo.rollout": [("RolloutWorker.__init__", "actor_init")],
    "es_ray.grpo.learner": [("GRPOLearner.__init__", "actor_init")],
}
"""module -> [(attribute path, event)]: timed once the module has been imported (nothing is imported early)."""


# -- the trace (driver and actor processes) ----------------------------------------------------------------------
def _record(event: str, edge: str) -> None:
    path = os.environ.get(TRACE_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "event": event, "edge": edge, "t": time.time()}) + "\n")


def _timed(fn, event: str):
    def wrapper(*a, **kw):
        _record(event, "begin")
        try:
            return fn(*a, **kw)
        finally:
            _record(event, "end")

    wrapper.__wrapped__, wrapper.startup_traced = fn, True
    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        setattr(wrapper, attr, getattr(fn, attr, None))
    return wrapper


def _patch(module, path: str, event: str) -> None:
    owner_path, _, name = path.rpartition(".")
    owner = module
    for part in filter(None, owner_path.split(".")):
        owner = getattr(owner, part, None)
        if owner is None:
            return
    raw = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    if raw is None or getattr(getattr(raw, "__func__", raw), "startup_traced", False):
        return
    if isinstance(raw, classmethod):
        setattr(owner, name, classmethod(_timed(raw.__func__, event)))
    else:
        setattr(owner, name, _timed(raw, event))


class _AfterImport:
    """A meta-path finder that lets the import happen as it would, then times ``TRACED``'s functions of the module
    just executed: the harness adds no import of its own to the phases it measures."""

    def find_spec(self, name, path=None, target=None):
        if name not in TRACED:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            for attr, event in TRACED[name]:
                _patch(module, attr, event)

        spec.loader.exec_module = exec_and_patch
        return spec


def install() -> None:
    """Trace this process (the driver, or an actor: Ray's ``worker_process_setup_hook``)."""
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
        for name in TRACED:  # already imported (a worker that imported a traced module before its hook ran)
            if name in sys.modules:
                for attr, event in TRACED[name]:
                    _patch(sys.modules[name], attr, event)
    _record("process", "up")


def child(command: str, overrides: list[str]) -> None:
    """One traced run of ``command``'s entry point in this process (``--child``)."""
    import importlib

    install()
    sys.argv = [command, *overrides]
    main = importlib.import_module(COMMANDS[command][0]).main
    _record("entry", "begin")
    try:
        main()
    finally:
        _record("entry", "end")


# -- baselines ----------------------------------------------------------------------------------------------------
def baseline(name: str) -> None:
    """``bare_ray``, ``bare_ray_actor``: Ray started as the commands start it, (one actor created and called,)
    shut down. ``model_load``: the demo model loaded by transformers, as an engine loads it."""
    _record("process", "up")
    if name == "model_load":
        _record("imports", "begin")
        import torch
        from transformers import AutoModelForCausalLM

        from es_ray.models import resolve_model

        _record("imports", "end")
        model_dir = resolve_model("")
        _record("model_load", "begin")
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        _record("model_load", "end")
        return
    _record("imports", "begin")
    import ray

    _record("imports", "end")
    _record("ray_start", "begin")
    ray.init(address="local", include_dashboard=False, configure_logging=False, log_to_driver=True)
    _record("ray_start", "end")
    if name == "bare_ray_actor":

        @ray.remote(num_cpus=1)
        class One:
            def ping(self) -> int:
                return os.getpid()

        _record("actor_spawn", "begin")
        ray.get(One.remote().ping.remote())
        _record("actor_spawn", "end")
    _record("entry", "end")
    ray.shutdown()


# -- the parent: runs, phases, report ------------------------------------------------------------------------------
def run_once(name: str, workdir: Path, repeat: int) -> dict:
    """Run ``name`` (a command or a baseline) once in a fresh process; its phases in seconds."""
    trace = workdir / f"{name}-{repeat}.trace"
    # Every actor traces itself: Ray's worker_process_setup_hook, set where a job's runtime_env would set it (Ray's
    # WORKER_PROCESS_SETUP_HOOK_ENV_VAR) but in the environment the local raylet inherits, as connect() passes the
    # actors' variables: a runtime_env would keep the raylet from reusing its prestarted workers
    env = {
        **os.environ,
        TRACE_ENV: str(trace),
        SETUP_HOOK_ENV: "startup.install",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")])),
    }
    if name in COMMANDS:
        args = ["--child", name, f"run.dir={workdir / f'{name}-{repeat}'}", "run.progress=false", *COMMANDS[name][1]]
    else:
        args = ["--baseline", name]
    trace.unlink(missing_ok=True)
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(HERE / "startup.py"), *args], env=env, capture_output=True, text=True)
    t_exit = time.time()
    if proc.returncode:
        raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    return phases(events, t0, t_exit)


def phases(events: list[dict], t0: float, t_exit: float) -> dict:
    """The phases of one run from its trace (see the module's docstring)."""
    driver = events[0]["pid"]
    spans: dict[tuple[int, str], list[list[float]]] = {}
    for e in events:
        if e["edge"] == "begin":
            spans.setdefault((e["pid"], e["event"]), []).append([e["t"], e["t"]])
        elif e["edge"] == "end" and spans.get((e["pid"], e["event"])):
            spans[(e["pid"], e["event"])][-1][1] = e["t"]

    def total(pid, event):
        return sum(b - a for a, b in spans.get((pid, event), []))

    def first(pid, event):
        return spans.get((pid, event), [[None, None]])[0]

    out = {"python_s": next(e["t"] for e in events if e["event"] == "process") - t0}
    driver_begins = [
        e["t"] for e in events if e["pid"] == driver and e["edge"] == "begin" and e["event"] not in ("entry", "imports")
    ]
    begins = [t for t in driver_begins] or [t_exit]
    harness = out["python_s"] + t0
    out["imports_s"] = (min(begins) - harness) if "imports" not in {k[1] for k in spans} else total(driver, "imports")
    entry_end = max(
        (e["t"] for e in events if e["pid"] == driver and e["event"] == "entry" and e["edge"] == "end"), default=None
    )
    out["shutdown_s"] = t_exit - entry_end if entry_end is not None else 0.0
    out["ray_start_s"] = total(driver, "ray_start")
    out["prepare_s"] = total(driver, "prepare") or (
        total(driver, "resolve_model") if (driver, "prepare") not in spans else 0.0
    )
    out["checkpoint_s"] = total(driver, "checkpoint")
    actors = [pid for pid, ev in spans if ev == "actor_init" and pid != driver]
    in_process = (driver, "actor_init") in spans
    first_actor = min(actors, key=lambda p: first(p, "actor_init")[0]) if actors else driver
    load = total(first_actor, "model_load") if (actors or in_process) else total(driver, "model_load")
    build = total(first_actor, "engine_build")
    out["model_load_s"] = load
    out["engine_build_s"] = max(0.0, build - load) if build else 0.0
    work = sum(b - a for (pid, ev), ss in spans.items() if ev == "work" and pid == driver for a, b in ss)
    if not work:  # es-eval: the actors' chunks (in parallel: the longest actor's sum)
        work = max((total(pid, "work") for pid, ev in spans if ev == "work"), default=0.0)
    out["work_s"] = work
    start = first(driver, "start_actors")
    if actors:
        init0 = first(first_actor, "actor_init")
        out["actor_spawn_s"] = init0[0] - start[0]
        out["actor_init_s"] = (init0[1] - init0[0]) - build
        last_init = max(first(p, "actor_init")[1] for p in actors)
        if (driver, "work") in spans:
            out["actors_ready_s"] = max(0.0, start[1] - last_init)
    elif (driver, "actor_spawn") in spans:
        out["actor_spawn_s"] = total(driver, "actor_spawn")
    elif in_process:
        out["actor_init_s"] = total(driver, "actor_init") - build
    out["total_s"] = t_exit - t0
    out["fixed_s"] = out["total_s"] - work
    named = sum(v for k, v in out.items() if k not in ("total_s", "fixed_s", "work_s"))
    out["other_s"] = max(0.0, out["fixed_s"] - named)
    return out


def machine() -> dict:
    model = ""
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu_model": model or "unknown", "cpu_count": os.cpu_count(), "load_average_1m": os.getloadavg()[0]}


ORDER = (
    "python",
    "imports",
    "prepare",
    "ray_start",
    "actor_spawn",
    "model_load",
    "engine_build",
    "actor_init",
    "actors_ready",
    "checkpoint",
    "other",
    "shutdown",
    "fixed",
    "work",
    "total",
)


def report(figures: dict, names: list[str]) -> None:
    print(f"{'seconds (median)':<16}" + "".join(f"{n:>15}" for n in names))
    for phase in ORDER:
        vals = [figures.get(f"{n}/{phase}_s") for n in names]
        if any(v for v in vals if v is not None):
            print(f"{phase:<16}" + "".join(f"{v:>15.2f}" if v is not None else f"{'-':>15}" for v in vals))
    print(
        f"{'fixed / bare_ray':<16}"
        + "".join(
            f"{figures[f'{n}/fixed_over_bare_ray']:>15.2f}" if f"{n}/fixed_over_bare_ray" in figures else f"{'-':>15}"
            for n in names
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commands", default=",".join(COMMANDS), help="comma-separated, of " + ", ".join(COMMANDS))
    ap.add_argument("--baselines", default=",".join(BASELINES), help="comma-separated, of " + ", ".join(BASELINES))
    ap.add_argument("--repeats", type=int, default=3, help="rounds; figures are medians over them")
    ap.add_argument(
        "--dir",
        default="",
        help="where the runs and traces go, kept (default: a temporary directory, "
        "removed at the end: each grpo-train run leaves a 1.6 GB checkpoint)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--baseline", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.child:
        return child(args.child, rest)
    if args.baseline:
        return baseline(args.baseline)
    names = [n for n in args.commands.split(",") if n] + [n for n in args.baselines.split(",") if n]
    unknown = [n for n in names if n not in COMMANDS and n not in BASELINES]
    if unknown or args.repeats < 1:
        ap.error(
            f"unknown {unknown}: choose from {', '.join([*COMMANDS, *BASELINES])}"
            if unknown
            else "--repeats must be >= 1"
        )
    host = machine()
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="startup-"))
    workdir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    try:
        for r in range(args.repeats):
            for n in names:
                runs[n].append(run_once(n, workdir, r))
                print(f"round {r}: {n} " + json.dumps(runs[n][-1]), file=sys.stderr, flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    figures: dict = {}
    for n, rs in runs.items():
        for key in sorted({k for x in rs for k in x}):
            figures[f"{n}/{key}"] = statistics.median(x.get(key, 0.0) for x in rs)
    bare = figures.get("bare_ray/total_s")
    if bare:
        for n in COMMANDS:
            if f"{n}/fixed_s" in figures:
                figures[f"{n}/fixed_over_bare_ray"] = figures[f"{n}/fixed_s"] / bare
    report(figures, names)
    print(
        json.dumps(
            {
                "machine": {**host, "load_average_end": list(os.getloadavg())},
                "repeats": args.repeats,
                "commands": {n: COMMANDS[n][1] for n in names if n in COMMANDS},
                **figures,
            }
        )
    )


if __name__ == "__main__":
    main()
