"""Validation of the shared config sections against the registries of the layers below the runtime (engine
names, task names, trackers) and the cluster address syntax. Every message names the key and what to change."""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

from es_ray.core.config import (
    ClusterConfig,
    ConfigError,
    EngineConfig,
    RunConfig,
    TaskConfig,
    check_absolute,
    check_positive,
    validate_faults,
    validate_held_out,
    validate_sampling,
)
from es_ray.core.dtypes import DTYPES
from es_ray.core.registry import Registry
from es_ray.engines import ENGINES, engines_that
from es_ray.grading.boxed import ANSWER_MODES
from es_ray.metrics.coverage import OBJECTIVES
from es_ray.runtime.cluster import check_address_syntax
from es_ray.runtime.tracking import TRACKERS
from es_ray.tasks import TASKS, is_import_path
from es_ray.tasks.countdown import SOURCES

DEVICES = Registry(
    "engine.device",
    {
        "auto": "CUDA when torch sees a GPU, else the CPU",
        "cpu": "the CPU",
        "cuda": "the GPU (refused where torch sees none)",
    },
)
PLACEMENTS = Registry(
    "cluster.placement",
    {
        "pack": "actors on as few nodes as fit (Ray's PACK)",
        "spread": "actors over as many nodes as there are (Ray's SPREAD)",
    },
)


def validate_engine(engine: EngineConfig) -> None:
    traits = ENGINES.get(engine.name)  # refuses an unknown name with the accepted ones
    DTYPES.check(engine.dtype, "engine.dtype")
    DEVICES.check(engine.device)
    check_positive("engine.batch_size", engine.batch_size)
    if not 0 <= engine.gpu_memory_utilization <= 1:
        raise ConfigError(
            f"engine.gpu_memory_utilization={engine.gpu_memory_utilization} must be in [0, 1] (0: the engine's default)"
        )
    check_positive("engine.max_model_len", engine.max_model_len, allow_zero=True)
    check_positive("engine.tensor_parallel_size", engine.tensor_parallel_size)
    if engine.tensor_parallel_size > 1 and not traits.tensor_parallel:
        raise ConfigError(
            f"engine.tensor_parallel_size={engine.tensor_parallel_size} needs an engine that splits a "
            f"model over GPUs: set engine.name= to one of {', '.join(engines_that('tensor_parallel'))}"
        )
    if engine.batch_invariant and not traits.batch_invariant:
        raise ConfigError(
            f"engine.batch_invariant=true needs an engine with a batch-invariant mode, and engine.name="
            f"{engine.name} has none: set engine.name= one of "
            f"{', '.join(engines_that('batch_invariant'))}, or engine.batch_invariant=false"
        )
    if engine.device != "auto":
        traits.check_settings(engine.device, engine.dtype, False, engine.batch_invariant)


def validate_cluster(cluster: ClusterConfig, engine: EngineConfig | None = None, *, allow_zero_actors=False) -> None:
    check_positive("cluster.num_actors", cluster.num_actors, allow_zero=allow_zero_actors)
    check_positive("cluster.gpus_per_actor", cluster.gpus_per_actor, allow_zero=True)
    check_positive("cluster.cpus_per_actor", cluster.cpus_per_actor, allow_zero=True)
    PLACEMENTS.check(cluster.placement)
    check_positive("cluster.wait_for_resources_s", cluster.wait_for_resources_s, allow_zero=True)
    if not 0 <= cluster.worker_niceness <= 19:
        raise ConfigError(
            f"cluster.worker_niceness={cluster.worker_niceness} is not a niceness increment; set "
            "cluster.worker_niceness= to 0 (the driver's priority) up to 19 (the lowest)"
        )
    check_address_syntax(cluster.address)
    traits = ENGINES.get(engine.name) if engine is not None else None
    if traits is not None and not cluster.address and find_spec(traits.package) is None:
        others = [n for n in ENGINES.names() if n != engine.name]
        raise ConfigError(
            f"engine.name={engine.name} needs the {traits.package} package, which is not installed: "
            f"{traits.install}, or set engine.name= one of {', '.join(others)}"
        )
    if engine is not None and cluster.gpus_per_actor and cluster.gpus_per_actor < engine.tensor_parallel_size:
        raise ConfigError(
            f"engine.tensor_parallel_size={engine.tensor_parallel_size} needs that many GPUs per "
            f"actor; set cluster.gpus_per_actor={engine.tensor_parallel_size}"
        )


def validate_run(run: RunConfig) -> None:
    check_absolute("run.dir", run.dir)
    check_absolute("run.root", run.root)
    if run.keep_checkpoints < 0:
        raise ConfigError(
            f"run.keep_checkpoints={run.keep_checkpoints} must be >= 0 (the newest k numbered "
            "checkpoints are kept besides final; 0: all)"
        )
    if run.resume and not run.dir:
        raise ConfigError("run.resume=true needs run.dir= the absolute directory of the run to continue")
    for name in run.trackers:
        backend = TRACKERS.get(name)  # refuses an unknown name with the accepted ones
        if find_spec(backend.module) is None:
            raise ConfigError(
                f"run.trackers={name} needs the {backend.module} package, which is not installed: "
                f"{backend.install}, or drop {name} from run.trackers"
            )


def validate_task(task: TaskConfig) -> None:
    if ":" not in task.name:
        TASKS.check(task.name)
    elif not is_import_path(task.name):  # a well-formed path is imported where it runs (in the actors)
        raise ConfigError(
            f"task.name={task.name!r} is not package.module:TaskClass; set task.name= to one of "
            f"{', '.join(TASKS)} or to package.module:TaskClass"
        )
    if task.train_size < 0 or task.eval_size < 0:
        raise ConfigError("task.train_size and task.eval_size must be >= 0")
    SOURCES.check(task.countdown_source)
    ANSWER_MODES.check(task.answer, "task.answer")
    OBJECTIVES.check(task.objective)
    if task.reward and (task.reward.count(":") != 1 or not all(task.reward.split(":"))):
        raise ConfigError(
            f"task.reward={task.reward!r} is not module:function; set "
            "task.reward=package.module:function (docs/tasks.md), or task.reward='' for the task's own "
            "reward"
        )


def validate_trainer(cfg: Any) -> None:
    """The sections ES and GRPO training share: model, task, sampling, engine, cluster, eval, run, faults."""
    validate_task(cfg.task)
    validate_sampling(cfg.sampling)
    validate_engine(cfg.engine)
    validate_cluster(cfg.cluster, cfg.engine)
    validate_run(cfg.run)
    validate_held_out(cfg.eval)
    validate_faults(cfg.faults)
