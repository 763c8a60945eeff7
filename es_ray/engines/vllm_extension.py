"""The ES replica inside vLLM's worker process (``worker_extension_cls``), reached through ``collective_rpc``.

vLLM mixes ``ESExtension`` into its Worker class; every method here runs where the weights live, so the fp32
master, the noise and the update never leave that process. Arguments are ints, floats and strings, and the
``ReplicaSpec`` (a frozen dataclass of scalars). Every name is ``es_``-prefixed: vLLM refuses an extension
attribute that its Worker already has.

A write goes through the model's own ``load_weights`` with HF names, which maps them onto vLLM's fused tensors
(qkv_proj, gate_up_proj) and tensor-parallel shards, so the noise, drawn per HF tensor, does not depend on how
vLLM stores the weights (DESIGN "ES, precisely" 4). Then vLLM's own post-load step
(``quant_method.process_weights_after_loading``) runs again on every layer the write touched. On GPU that step
does nothing for unquantized layers; on CPU it repacks the layer's weight for vLLM's GEMM kernel (oneDNN),
which is where vLLM's CPU speed comes from. One patch makes that repacking keep ``layer.weight`` (vLLM drops it
after packing), so the next write and the read-back (``_es_read``: the HF tensor as a view of vLLM's fused one,
the replica's measure of what an update realised) still find it. Measured alternatives, in the README's
engine section: vLLM's ``reload_weights`` (rebuilds every layer from meta tensors, writes 1.6x slower, leaves a
tied LM head stale), and F.linear on unpacked weights (writes 4x cheaper, generation 2x slower at batch 16).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

if TYPE_CHECKING:
    from es_ray.replica import ReplicaSpec


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


def drop_log_lines(logger_name: str, text: str) -> None:
    """Drop the records of ``logger_name`` whose message contains ``text`` (vLLM lines that say nothing here)."""
    import logging

    class _Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return text not in record.getMessage()

    logging.getLogger(logger_name).addFilter(_Drop())


keep_weights_when_packing()  # imported by vLLM in the worker before the model loads
# vLLM's weight loader warns on every fp32 tensor written into a bf16 parameter (dozens per perturbation); casting
# the fp32 master to the engine's dtype is what every write does by design.
drop_log_lines("vllm.model_executor.models.utils", "into parameter with dtype")


def hf_parameter_shapes(model_dir: str) -> dict[str, torch.Size]:
    """The HF model's parameter names (tied weights once) and shapes, from a meta-device model: no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: p.shape for name, p in model.named_parameters()}


class ESExtension:
    """Mixed into vLLM's Worker; ``self.model_runner`` and ``self.device`` are the Worker's."""

    # -- setup ---------------------------------------------------------------------------------------------
    def es_setup(self, spec: ReplicaSpec) -> None:
        """Build the replica (``Replica.from_checkpoint``: fp32 master from the checkpoint, then written)."""
        from es_ray.replica import Replica, ReplicaSpec

        if not isinstance(spec, ReplicaSpec):  # vLLM's msgpack (engine core in its own process) sends it as a map
            spec = ReplicaSpec(**spec)
        names = self._es_hf_shapes()
        self._es_replica = Replica.from_checkpoint(self.model_config.model, names, spec, self._es_write,
                                                   self._es_read, device=self.device)

    def _es_hf_shapes(self) -> dict[str, torch.Size]:
        shapes = getattr(self, "_es_shapes", None)
        if shapes is None:
            shapes = self._es_shapes = hf_parameter_shapes(self.model_config.model)
        return shapes

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

    def _es_locations(self, model) -> dict[str, tuple[str, int, int]] | None:
        """HF name -> (vLLM parameter name, first row, rows): packed modules (qkv_proj, gate_up_proj) split by their
        output sizes, a vocabulary padded by vLLM cut back to the HF rows. None under tensor parallelism, where a
        rank holds a shard only. Built once; parameters are looked up by name at each read, since vLLM's post-load
        step may replace them."""
        from vllm.distributed import get_tensor_model_parallel_world_size

        if get_tensor_model_parallel_world_size() != 1:
            return None
        locations = getattr(self, "_es_locs", None)
        if locations is None:
            shapes = self._es_hf_shapes()
            packed = getattr(model, "packed_modules_mapping", {})
            locations = {}
            for name, param in model.named_parameters():
                module_name, _, leaf = name.rpartition(".")
                prefix, _, short = module_name.rpartition(".")
                if short in packed:
                    start = 0
                    for part, rows in zip(packed[short], model.get_submodule(module_name).output_sizes):
                        locations[f"{prefix}.{part}.{leaf}"] = (name, start, int(rows))
                        start += int(rows)
                elif name in shapes:
                    locations[name] = (name, 0, shapes[name][0] if shapes[name] else 1)
            self._es_locs = locations
        return locations

    def _es_read(self, name: str) -> torch.Tensor | None:
        """The tensor vLLM holds for one HF name, in its dtype and HF shape, as a view (no copy); None under tensor
        parallelism."""
        model = self.model_runner.get_model()
        locations = self._es_locations(model)
        if locations is None:
            return None
        if name not in locations:
            raise KeyError(f"vLLM's model has no tensor for the HF parameter {name!r}")
        param_name, start, rows = locations[name]
        param = model.get_parameter(param_name)
        return param.detach().narrow(0, start, rows) if param.dim() else param.detach()

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
        if self._es_locations(self.model_runner.get_model()) is None:
            raise NotImplementedError("reading weights back from vLLM needs tensor_parallel_size=1")
        return {name: self._es_read(name).to("cpu", torch.float32, copy=True) for name in self._es_hf_shapes()}


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
