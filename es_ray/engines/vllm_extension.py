"""The ES replica inside vLLM's worker process (``worker_extension_cls``), reached through ``collective_rpc``.

vLLM mixes ``ESExtension`` into its Worker class; every method here runs where the weights live, so the fp32
master, the noise and the update never leave that process. Arguments are ints, floats and strings only.
Every name is ``es_``-prefixed: vLLM refuses an extension attribute that its Worker already has.

Weights are written through the model's own ``load_weights`` with HF names, which maps them onto vLLM's fused
tensors (qkv_proj, gate_up_proj) and tensor-parallel shards: the noise is drawn per HF tensor, so it does not
depend on how vLLM stores the weights (DESIGN "ES, precisely" 4).

CPU: vLLM's CPU backend prepacks linear weights for its GEMM kernel at load time and drops ``layer.weight``,
so a later write would not reach them. ``keep_linear_weights`` (applied when this module is imported in the
worker, before the model loads) keeps linear layers and the LM head unpacked: they multiply with
``torch.nn.functional.linear`` on ``layer.weight``, which every write updates in place. On GPU vLLM computes
from ``layer.weight`` anyway and the patch does nothing. The alternative, re-running vLLM's post-load
processing after each write (``reload_weights``), was measured and rejected: see ``benchmarks/engines.py``
and the README's engine section.
"""

from __future__ import annotations

from typing import Iterable

import torch


def keep_linear_weights() -> None:
    """CPU only: make vLLM's CPU GEMM dispatch keep ``layer.weight`` and use F.linear on it."""
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or getattr(layer_utils, "_es_ray_patched", False):
        return

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:  # signature of the vLLM function
        layer.cpu_linear = torch.nn.functional.linear

    # linear.py and vocab_parallel_embedding.py import this function at call time, so the module attribute
    # is what they get.
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch
    layer_utils._es_ray_patched = True


keep_linear_weights()


def hf_parameter_names(model_dir: str) -> list[str]:
    """The HF model's parameter names (tied weights once), from a meta-device model: no memory, no weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [name for name, _ in model.named_parameters()]


class ESExtension:
    """Mixed into vLLM's Worker; ``self.model_runner`` and ``self.device`` are the Worker's."""

    # -- setup ---------------------------------------------------------------------------------------------
    def es_setup(self, model_dir: str, run_seed: int, noise: str, noise_table_size: int, trainable: str,
                 optimizer: str, lr: float, adam_beta1: float, adam_beta2: float, adam_eps: float,
                 weight_decay: float, anchor_decay: float) -> str:
        """Build the replica from the checkpoint's fp32 tensors (never from the engine's cast weights)."""
        from es_ray.models import load_hf_weights
        from es_ray.replica import Replica, ReplicaSpec

        model = self.model_runner.get_model()
        self._es_dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        spec = ReplicaSpec(
            run_seed=run_seed, noise=noise, noise_table_size=noise_table_size, trainable=trainable,
            optimizer=optimizer, lr=lr, adam_beta1=adam_beta1, adam_beta2=adam_beta2, adam_eps=adam_eps,
            weight_decay=weight_decay, anchor_decay=anchor_decay,
            engine_dtype=str(self._es_dtype).removeprefix("torch."),
        )
        names = hf_parameter_names(model_dir)
        source = load_hf_weights(model_dir, names)
        missing = [n for n in names if n not in source]
        if missing:
            raise ValueError(f"{model_dir}: no tensor for HF parameters {missing[:5]} (of {len(missing)})")
        self._es_replica = Replica(((n, source.pop(n)) for n in names), spec, self._es_write, device=self.device)
        self._es_replica.restore()
        return spec.engine_dtype

    def _es_write(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (HF name, fp32 tensor) pairs into the model through its weight loader, cast to its dtype."""
        model = self.model_runner.get_model()
        with torch.no_grad():
            model.load_weights((name, t) for name, t in named)

    def _es(self):
        replica = getattr(self, "_es_replica", None)
        if replica is None:
            raise RuntimeError("es_setup must run before any other es_ call")
        return replica

    # -- ES operations (int / float arguments) -------------------------------------------------------------
    def es_perturb(self, iteration: int, noise_id: int, sign: int, sigma: float) -> None:
        self._es().perturb(iteration, noise_id, sign, sigma)

    def es_restore(self) -> None:
        self._es().restore()

    def es_update(self, iteration: int, members: list[list[int]], fitness: list[float], sigma: float) -> dict:
        from es_ray.strategy import Member

        return self._es().update(iteration, [Member(*map(int, m)) for m in members], list(fitness), sigma)

    def es_checksum(self) -> str:
        return self._es().checksum()

    # -- weights and state (tensors: checkpoints, GRPO sync and tests only) ----------------------------------
    def es_write_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self._es_write((name, t.to(self.device)) for name, t in named)

    def es_state_dict(self) -> dict:
        sd = self._es().state_dict()
        return _to_cpu(sd)

    def es_load_state_dict(self, sd: dict) -> None:
        self._es().load_state_dict(sd)

    def es_read_weights(self) -> dict[str, torch.Tensor]:
        """The engine's weights in HF layout (fused tensors split back), fp32 on the CPU. Tensor parallel 1 only."""
        from vllm.distributed import get_tensor_model_parallel_world_size

        if get_tensor_model_parallel_world_size() != 1:
            raise NotImplementedError("reading weights back from vLLM needs tensor_parallel_size=1")
        model = self.model_runner.get_model()
        packed = getattr(model, "packed_modules_mapping", {})
        out: dict[str, torch.Tensor] = {}
        for name, param in model.named_parameters():
            module_name, _, leaf = name.rpartition(".")
            prefix, _, short = module_name.rpartition(".")
            value = param.detach().to("cpu", torch.float32, copy=True)
            if short in packed and param.dim() >= 1:
                sizes = model.get_submodule(module_name).output_sizes
                for part, chunk in zip(packed[short], value.split(list(sizes), dim=0)):
                    out[f"{prefix}.{part}.{leaf}"] = chunk.clone()
            else:
                out[name] = value
        return out


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
