"""The ES replica inside vLLM's worker process (``worker_extension_cls``), reached through ``collective_rpc``.

vLLM mixes ``ESExtension`` into its Worker class; every method here runs where the weights live, so the fp32
master, the noise and the update never leave that process. Arguments are ints, floats and strings only.
Every name is ``es_``-prefixed: vLLM refuses an extension attribute that its Worker already has.

A write goes through the model's own ``load_weights`` with HF names, which maps them onto vLLM's fused tensors
(qkv_proj, gate_up_proj) and tensor-parallel shards, so the noise, drawn per HF tensor, does not depend on how
vLLM stores the weights (DESIGN "ES, precisely" 4). Then vLLM's own post-load step
(``quant_method.process_weights_after_loading``) runs again on every layer the write touched. On GPU that step
does nothing for unquantized layers; on CPU it repacks the layer's weight for vLLM's GEMM kernel (oneDNN),
which is where vLLM's CPU speed comes from. One patch makes that repacking keep ``layer.weight`` (vLLM drops it
after packing), so the next write and ``es_read_weights`` still find it. Measured alternatives, in the README's
engine section: vLLM's ``reload_weights`` (rebuilds every layer from meta tensors, writes 1.6x slower, leaves a
tied LM head stale), and F.linear on unpacked weights (writes 4x cheaper, generation 2x slower at batch 16).
"""

from __future__ import annotations

from typing import Iterable

import torch


def keep_weights_when_packing() -> None:
    """CPU: vLLM's GEMM dispatch packs ``layer.weight`` and then drops it; keep it (the packed copy is used)."""
    from vllm.model_executor.layers import utils as layer_utils

    dispatch = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "_es_ray_keeps_weight", False):
        return

    def keep(layer: torch.nn.Module, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)

    keep._es_ray_keeps_weight = True
    # linear.py and vocab_parallel_embedding.py import it from this module at call time.
    layer_utils.dispatch_cpu_unquantized_gemm = keep


keep_weights_when_packing()  # imported by vLLM in the worker before the model loads


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
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        spec = ReplicaSpec(
            run_seed=run_seed, noise=noise, noise_table_size=noise_table_size, trainable=trainable,
            optimizer=optimizer, lr=lr, adam_beta1=adam_beta1, adam_beta2=adam_beta2, adam_eps=adam_eps,
            weight_decay=weight_decay, anchor_decay=anchor_decay, engine_dtype=str(dtype).removeprefix("torch."),
        )
        names = hf_parameter_names(model_dir)
        source = load_hf_weights(model_dir, names)
        missing = [n for n in names if n not in source]
        if missing:
            raise ValueError(f"{model_dir}: no tensor for HF parameters {missing[:5]} (of {len(missing)})")
        self._es_replica = Replica(((n, source.pop(n)) for n in names), spec, self._es_write, device=self.device)
        self._es_replica.restore()
        return spec.engine_dtype

    def _es_post_load_layers(self, model) -> dict[int, list[torch.nn.Module]]:
        """id(parameter) -> the layers whose post-load step must rerun when it changes (a tied LM head shares the
        embedding); built once, on the first write (ES setup or a plain weight write, e.g. GRPO's sync)."""
        layers = getattr(self, "_es_layers", None)
        if layers is None:
            layers = {}
            for module in model.modules():
                if getattr(module, "quant_method", None) is not None:
                    for param in module.parameters(recurse=False):
                        layers.setdefault(id(param), []).append(module)
            self._es_layers = layers
        return layers

    def _es_write(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """(HF name, fp32 tensor) pairs -> the model's weight loader (casts, fuses, shards) -> post-load step."""
        model = self.model_runner.get_model()
        layer_map = self._es_post_load_layers(model)
        with torch.no_grad():
            loaded = model.load_weights(named)  # copies each tensor before taking the next
            params = dict(model.named_parameters(remove_duplicate=False))
            if loaded is None:  # a model whose loader does not say what it loaded: redo every layer
                loaded = params
            touched = {id(layer): layer for name in loaded if name in params
                       for layer in layer_map.get(id(params[name]), ())}
            for layer in touched.values():
                layer.quant_method.process_weights_after_loading(layer)

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
        return _to_cpu(self._es().state_dict())

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
            if short in packed:
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
