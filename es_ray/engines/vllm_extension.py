"""The ES replica inside vLLM's worker process (``worker_extension_cls``), reached through ``collective_rpc``.

vLLM mixes ``ESExtension`` into its Worker class; every method here runs where the weights live, so the fp32
master, the noise and the update never leave that process. Arguments are ints, floats and strings, and the
``ReplicaSpec`` (a frozen dataclass of scalars). Every name is ``es_``-prefixed: vLLM refuses an extension
attribute that its Worker already has.

A write goes through the model's own ``load_weights`` with HF names, which maps them onto vLLM's fused tensors
(qkv_proj, gate_up_proj) and tensor-parallel shards, so the noise, drawn per HF tensor, does not depend on how
vLLM stores the weights (docs/design.md "ES, precisely" 4). Then vLLM's own post-load step
(``quant_method.process_weights_after_loading``) runs again on every layer the write touched. On GPU that step
does nothing for unquantized layers; on CPU it repacks the layer's weight for vLLM's GEMM kernel (oneDNN),
which is where vLLM's CPU speed comes from. One patch makes that repacking keep ``layer.weight`` (vLLM drops it
after packing), so the next write and the read-back (``_es_read``: the HF tensor as a view of vLLM's fused one,
the replica's measure of what an update realised) still find it. Measured alternatives, in docs/engines.md (its
table of weight-write paths): vLLM's ``reload_weights`` (rebuilds every layer from meta tensors, writes 1.6x
slower, leaves a tied LM head stale), and F.linear on unpacked weights (writes 4x cheaper, generation 2x slower
at batch 16).

Tensor parallelism: each rank keeps the fp32 master of its own shard only, in HF layout (``tensor_parallel_parts``
says which rows or columns of each HF tensor the rank's weight loader reads), draws the whole HF tensor's noise
and slices it, and writes the whole HF-shaped tensor (its shard in place) through the same ``load_weights``. Setup
proves the bookkeeping: the first write fills everything outside the shards with NaN, then every parameter must
be NaN-free and hold cast(master) where the bookkeeping says. Checksums and states go back per rank, each part
once (``es_checksum_parts``, ``es_state_dict``); the engine combines them. Checkpoints never cross the message
queue: each rank writes the parts it owns to files tensor by tensor (``es_save_part``) and, on resume, is sent
the checkpoint's file names and reads only its own part of each tensor (``es_load_state_dict``).

An input embedding's post-load step is not rerun (``input_embeddings``): vLLM's CPU step packs it for a GEMM it
never runs (the tied LM head, a module of its own, has its own packed copy), which cost a quarter of a write.

Population batching (es.perturbation=lowrank; the engine enables LoRA, ``vllm.VLLMEngine``): ``es_fill_lora``
writes member m's factors into the LoRA slot of adapter id m + 1 with each LoRA layer's ``set_lora``. What it
relies on, vLLM 0.32.0's LoRA internals (they change between releases; tests/engines/test_lowrank_vllm.py checks them):
* ``model_runner.lora_manager`` (``LRUCacheWorkerLoRAManager``): ``add_dummy_lora`` registers an in-memory
  zero adapter under an int id, ``pin_adapter`` activates it into a slot and pins it (never evicted, never
  reactivated, so vLLM never copies the dummy's zeros back over a filled slot); ``list_adapters``;
* its ``_adapter_manager`` (``LRUCacheLoRAModelManager``): ``modules`` (LoRA layer name -> layer, qkv_proj and
  gate_up_proj packed, one slice per HF tensor), ``lora_index_to_id`` (slot of each id), ``lora_slots``;
* a LoRA layer's ``set_lora(slot, lora_a (r x in), lora_b (out x r))`` (lists per slice for packed layers; slices
  for tensor parallelism itself), ``reset_lora``, ``n_slices``; its base layer's parameters are named
  ``<layer>.base_layer.weight`` (``_plain`` maps them back for the loader and the locations);
* a request's LoRA reaches a slot through its int id only; the prefix cache keys blocks by LoRA name, so the engine
  changes the cache salt at every fill;
* CPU: ``PunicaWrapperCPU.add_lora_linear`` is replaced (``batch_cpu_lora_kernels``): vLLM's copies each token's
  factors, 3x slower over a whole ES generation, and misreads slot -1.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Iterable, NamedTuple

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
from vllm.lora.request import LoRARequest
from vllm.model_executor.layers import utils as layer_utils
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

from es_ray.replica import Replica, ReplicaSpec, Shard, state_tensors
from es_ray.strategy import Member

if TYPE_CHECKING:
    from es_ray.replica import ReplicaSpec


LORA_PATH = "/es-ray/lowrank-slot/not-a-file"
"""The path every member's LoRARequest names: the adapters are built in memory by the worker (``vllm_extension``),
and no file is ever read; a path that does not exist makes vLLM fail loudly should it ever try to load one."""


def member_lora_name(position: int) -> str:
    """The LoRA name of the member at ``position`` of a ``generate_members`` call (slot id position + 1)."""
    return f"es-member-{position}"


def keep_weights_when_packing() -> None:
    """CPU: vLLM's GEMM dispatch packs ``layer.weight`` and then drops it; keep it (the packed copy is used)."""
    dispatch = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "_es_ray_keeps_weight", False):
        return

    def keep(layer: torch.nn.Module, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)

    keep._es_ray_keeps_weight = True
    # linear.py and vocab_parallel_embedding.py import it from this module at call time.
    layer_utils.dispatch_cpu_unquantized_gemm = keep


def _add_lora_linear(
    self,
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked: tuple[torch.Tensor, ...],
    lora_b_stacked: tuple[torch.Tensor, ...],
    scale: float,
    output_slices: tuple[int, ...],
    **kwargs,
) -> None:
    """y[:, slice s] += scale * (x A_{s,l}^T) B_{s,l}^T for each token's LoRA slot l (slot -1: no adapter), as
    ``PunicaWrapperCPU.add_lora_linear`` (vLLM 0.32, same signature), in a few matmuls per layer instead of vLLM's
    token-by-token ones: per run of consecutive tokens of one slot (``prefill_metadata``: vLLM's requests are in
    member order, so about one run per member) when the runs are few, batched over the runs when they are equally long
    and one per slot in order (``_lora_equal_runs``), else all slots at once (``_lora_dense``). The shrink runs in
    fp32, the expand in y's dtype, as vLLM's kernels do."""
    indices = self.token_lora_indices
    x = x.view(-1, x.shape[-1])
    if not self.is_prefill or indices.numel() != x.shape[0]:  # a layout these were not written for: vLLM's own
        return _STOCK_ADD_LORA_LINEAR(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, **kwargs)
    if self.no_lora:  # no token has an adapter (vLLM skips its kernels the same way)
        return None
    out = y.view(-1, y.shape[-1])
    starts, lengths, slots = (t.tolist() for t in self.prefill_metadata[:3])
    if len(starts) > 4 * lora_a_stacked[0].shape[0]:
        return _lora_dense(indices, out, x, lora_a_stacked, lora_b_stacked, scale, output_slices)
    n, first = lengths[0], slots[0]
    if (
        1 < len(starts)
        and first >= 0
        and n * len(starts) == x.shape[0]
        and lengths == [n] * len(starts)
        and starts == list(range(0, x.shape[0], n))
        and slots == list(range(first, first + len(slots)))
    ):
        return _lora_equal_runs(
            out, x, n, slice(first, first + len(slots)), lora_a_stacked, lora_b_stacked, scale, output_slices
        )
    for start, length, slot in zip(starts, lengths, slots):
        if slot < 0:
            continue
        rows = x[start : start + length].to(torch.float32)
        offset = 0
        for a, b, size in zip(lora_a_stacked, lora_b_stacked, output_slices):
            h = rows @ a[slot, 0].T.to(torch.float32)  # (tokens, r)
            if scale != 1.0:
                h.mul_(scale)
            out[start : start + length, offset : offset + size].addmm_(h.to(y.dtype), b[slot, 0, :size].T.to(y.dtype))
            offset += size
    return None


def _lora_equal_runs(
    out: torch.Tensor,
    x: torch.Tensor,
    n: int,
    slots: slice,
    lora_a_stacked,
    lora_b_stacked,
    scale: float,
    output_slices,
) -> None:
    """``_add_lora_linear`` when the tokens are runs of n, one per slot of the consecutive ``slots``, in order (a
    decode step of members with equally many requests, or their prefill of the same prompts): one batched shrink over
    the runs for all slices (a packed q/k/v or gate/up layer reads its input once: 23% less time than a shrink per
    slice at a decode step, 13% in prefill) and one batched expand per slice, instead of 2 products per run and
    slice (a decode step's are tiny, and their count, not their FLOPs, was the time)."""
    runs = slots.stop - slots.start
    xv = x.view(runs, n, x.shape[-1]).to(torch.float32)
    ov = out.view(runs, n, out.shape[-1])
    # the slices' shrinks as one product (a packed q/k/v or gate/up layer reads its input once, not per slice)
    a_all = (
        lora_a_stacked[0][slots, 0]
        if len(lora_a_stacked) == 1
        else torch.cat([a[slots, 0] for a in lora_a_stacked], dim=1)
    )  # (runs, slices * r, in)
    h_all = torch.bmm(xv, a_all.transpose(1, 2).to(torch.float32))  # (runs, n, slices * r)
    if scale != 1.0:
        h_all.mul_(scale)
    h_all = h_all.to(out.dtype)
    offset, col = 0, 0
    for b, size in zip(lora_b_stacked, output_slices):
        rank = b.shape[-1]
        ov[..., offset : offset + size].baddbmm_(
            h_all[..., col : col + rank], b[slots, 0, :size].transpose(1, 2).to(out.dtype)
        )
        offset, col = offset + size, col + rank


def _lora_dense(
    indices: torch.Tensor,
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked,
    lora_b_stacked,
    scale: float,
    output_slices,
) -> None:
    """``_add_lora_linear`` for tokens in any order: every slot's factors side by side, one shrink matmul for all
    slices and slots (T x (S L r)), the blocks of the slots a token does not use set to zero, then one expand
    matmul per slice over (L r). L times the FLOPs of the adapters, in 1 + S matmuls."""
    slots, rank = lora_a_stacked[0].shape[0], lora_b_stacked[0].shape[-1]
    a = torch.cat([t.reshape(slots * rank, x.shape[-1]) for t in lora_a_stacked]).to(torch.float32)
    h = x.to(torch.float32) @ a.T
    if scale != 1.0:
        h.mul_(scale)
    mine = (indices.unsqueeze(1) == torch.arange(slots, device=indices.device)).to(h.dtype)  # (T, L); -1: none
    h = (h.view(x.shape[0], len(lora_a_stacked), slots, rank) * mine[:, None, :, None]).to(out.dtype)
    offset = 0
    for s, (b, size) in enumerate(zip(lora_b_stacked, output_slices)):
        b = b.reshape(slots, b.shape[-2], rank).transpose(1, 2).reshape(slots * rank, b.shape[-2]).to(out.dtype)
        out[:, offset : offset + size].addmm_(h[:, s].reshape(x.shape[0], slots * rank), b[:, :size])
        offset += size


_STOCK_ADD_LORA_LINEAR = None


def batch_cpu_lora_kernels() -> None:
    """vLLM's CPU LoRA kernels for linear layers (``PunicaWrapperCPU.add_lora_linear`` over ``lora.ops.torch_ops``;
    the CPU runner takes their prefill path on every step) copy each token's own adapter factors and multiply token
    by token: tokens x (in + out) x rank floats copied per layer and slice, gigabytes per prefill at SmolLM2 size,
    and they read slot -1 (no adapter) as the last slot. ``_add_lora_linear`` replaces them (same signature); the
    embedding and LM-head kernels are left as they are (ES puts no adapter there)."""
    global _STOCK_ADD_LORA_LINEAR
    if PunicaWrapperCPU.add_lora_linear is not _add_lora_linear:
        _STOCK_ADD_LORA_LINEAR = PunicaWrapperCPU.add_lora_linear
        PunicaWrapperCPU.add_lora_linear = _add_lora_linear


def input_embeddings(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The vocabulary embeddings that only look rows up (``weight``), whose post-load step need not rerun after a
    write: on CPU vLLM packs every embedding for its GEMM as if it were an LM head, and repacking the input
    embedding's unused copy cost as much as the tied LM head's, a quarter of a write on SmolLM2-135M. Only where the
    model has an LM head of its own (a ParallelLMHead, tied or not) computing the logits; a model that computes them
    with its embedding module keeps it. The stale copy is replaced by a function that refuses, so a model that
    did use it fails loudly instead of computing with old weights."""
    modules = list(model.modules())
    if not any(isinstance(m, ParallelLMHead) for m in modules):
        return []
    found = [m for m in modules if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)]
    for module in found:
        if hasattr(module, "cpu_linear"):
            module.cpu_linear = _stale_gemm
    return found


def _stale_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    raise RuntimeError(
        "es_ray does not repack an input embedding's CPU GEMM copy after a write "
        "(vllm_extension.input_embeddings), and this model computes with it: repack it there"
    )


def drop_log_lines(logger_name: str, text: str) -> None:
    """Drop the records of ``logger_name`` whose message contains ``text`` (vLLM lines that say nothing here)."""

    class _Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return text not in record.getMessage()

    logging.getLogger(logger_name).addFilter(_Drop())


keep_weights_when_packing()  # imported by vLLM in the worker before the model loads
batch_cpu_lora_kernels()
# vLLM's weight loader warns on every fp32 tensor written into a bf16 parameter (dozens per perturbation); casting
# the fp32 master to the engine's dtype is what every write does by design.
drop_log_lines("vllm.model_executor.models.utils", "into parameter with dtype")


def hf_parameter_shapes(model_dir: str) -> dict[str, torch.Size]:
    """The HF model's parameter names (tied weights once) and shapes, from a meta-device model: no memory."""
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: p.shape for name, p in model.named_parameters()}


class Location(NamedTuple):
    """Where one HF tensor lives on this rank: rows [row, row + rows) of vLLM's parameter ``param`` hold ``shard`` of
    it (the HF layout of that part: a row-parallel weight's columns are the local parameter's)."""

    param: str
    row: int
    rows: int
    shard: Shard


def tensor_parallel_parts(
    module: torch.nn.Module, param: torch.nn.Parameter, shapes: list[tuple[int, ...]], rank: int
) -> list[tuple[int, Shard]]:
    """For one vLLM parameter holding the HF tensors of ``shapes`` (several for a packed module, in its packing
    order: q/k/v, gate/up), what tensor-parallel rank ``rank`` holds of each: (rows it takes in the local parameter,
    its part of the HF tensor). It follows vLLM's weight loaders, which the setup checks it against:
    * VocabParallelEmbedding, ParallelLMHead (``shard_indices``): vocabulary rows [org_vocab_start, org_vocab_end),
      first in the local parameter (vLLM's padding rows follow);
    * RowParallelLinear (``input_is_parallel``): weight columns [r w, (r + 1) w), w the local width; the bias whole;
    * ColumnParallelLinear and its packed kinds (``output_size_per_partition``): each part's rows [s n, (s + 1) n),
      n its local rows (output_sizes / TP), s the layer's rank, or for QKV's k and v that rank // num_kv_head_replicas
      (KV heads are replicated when TP exceeds their number; the lowest rank of a replica group owns the part);
    * anything else (norms, ReplicatedLinear, a layer with tp_size 1): the whole tensor, owned by rank 0."""
    tp_size, tp_rank = int(getattr(module, "tp_size", 1)), int(getattr(module, "tp_rank", rank))
    rows = [s[0] if s else 1 for s in shapes]
    if tp_size == 1:
        return [(r, Shard(tuple(s), owner=rank == 0)) for r, s in zip(rows, shapes)]
    if len(shapes) == 1 and len(getattr(module, "output_sizes", ())) > 1:
        raise NotImplementedError(
            f"{type(module).__name__} holds one fused HF tensor of shape {shapes[0]}: its "
            "tensor-parallel shard is not one block of rows, which a sharded ES master needs; "
            "use engine.tensor_parallel_size=1"
        )
    if hasattr(module, "shard_indices") and getattr(param, "output_dim", None) == 0:
        start, stop = module.shard_indices.org_vocab_start_index, module.shard_indices.org_vocab_end_index
        return [(stop - start, Shard.part(shapes[0], 0, start, stop))]
    if hasattr(module, "input_is_parallel") and getattr(param, "input_dim", None) == 1:
        width = param.shape[1]
        return [(rows[0], Shard.part(shapes[0], 1, tp_rank * width, (tp_rank + 1) * width))]
    if (
        hasattr(module, "output_size_per_partition")
        and not hasattr(module, "input_is_parallel")
        and getattr(param, "output_dim", None) == 0
    ):
        local = [size // tp_size for size in module.output_sizes] if len(shapes) > 1 else [param.shape[0]]
        out = []
        for i, (shape, n) in enumerate(zip(shapes, local)):
            replicas = int(getattr(module, "num_kv_head_replicas", 1)) if i > 0 else 1
            s = tp_rank // replicas
            out.append((n, Shard.part(shape, 0, s * n, (s + 1) * n, owner=tp_rank % replicas == 0)))
        return out
    return [(r, Shard(tuple(s), owner=rank == 0)) for r, s in zip(rows, shapes)]


def check_written_in_place(storage: dict[str, int], model: torch.nn.Module, loaded: Iterable[str]) -> None:
    """RuntimeError unless every parameter a write loaded still has the storage it had before (``storage``: vLLM
    parameter name -> ``data_ptr()`` taken before the write). vLLM 0.32's weight loaders copy into the parameter and
    its GPU post-load step does nothing for unquantized layers, so this holds; a loader or post-load step that
    replaced a tensor (a quantized layer's repacking, a later vLLM) would leave the captured CUDA graphs computing
    with the old one, and the write would silently not reach generation."""
    params = {_plain(name): p for name, p in model.named_parameters(remove_duplicate=False)}
    moved = sorted(
        name for name in loaded if name in storage and name in params and params[name].data_ptr() != storage[name]
    )
    if moved:
        raise RuntimeError(
            f"vLLM replaced {moved[:3]} ({len(moved)} parameters) while es_ray wrote weights, and the "
            "CUDA graphs it captured at start still read the old tensors: set engine.enforce_eager=true "
            "(no captured graphs), or use an unquantized checkpoint"
        )


class ESExtension:
    """Mixed into vLLM's Worker; ``self.model_runner`` and ``self.device`` are the Worker's."""

    # -- setup ---------------------------------------------------------------------------------------------
    def es_setup(self, spec: ReplicaSpec) -> None:
        """Build the replica (``Replica.from_checkpoint``: fp32 master from the checkpoint, this rank's shards only,
        then written), and check that the engine took exactly the shards: no NaN from outside them anywhere, and
        cast(master) where the bookkeeping puts each."""
        if not isinstance(spec, ReplicaSpec):  # vLLM's msgpack (engine core in its own process) sends it as a map
            spec = ReplicaSpec(**spec)
        model = self.model_runner.get_model()
        shards = {name: loc.shard for name, loc in self._es_locations(model).items()}
        self._es_replica = Replica.from_checkpoint(
            self.model_config.model,
            self._es_hf_shapes(),
            spec,
            self._es_write,
            self._es_read,
            device=self.device,
            shards=shards,
        )
        nan = [name for name, p in model.named_parameters() if p.is_floating_point() and p.isnan().any()]
        bad = self._es_replica.engine_mismatches()
        if nan or bad:
            raise RuntimeError(
                f"tensor-parallel rank {self._es_rank()}: the engine's loader did not take the shards "
                f"this replica keeps (NaN in {nan[:3]}, cast(master) not held in {list(bad)[:3]}); "
                "tensor_parallel_parts does not match this vLLM layer: use tensor_parallel_size=1"
            )

    def _es_rank(self) -> int:
        return get_tensor_model_parallel_rank()

    def _es_hf_shapes(self) -> dict[str, torch.Size]:
        shapes = getattr(self, "_es_shapes", None)
        if shapes is None:
            shapes = self._es_shapes = hf_parameter_shapes(self.model_config.model)
        return shapes

    def _es_post_load_layers(self, model) -> dict[int, list[torch.nn.Module]]:
        """id(parameter) -> the layers whose post-load step must rerun when it changes (a tied LM head shares the
        embedding); built once, on the first write (ES setup or a plain weight write, e.g. GRPO's sync). Input
        embeddings are left out (``input_embeddings``)."""
        layers = getattr(self, "_es_layers", None)
        if layers is None:
            layers = {}
            skip = {id(m) for m in input_embeddings(model)}
            for module in model.modules():
                if getattr(module, "quant_method", None) is not None and id(module) not in skip:
                    for param in module.parameters(recurse=False):
                        layers.setdefault(id(param), []).append(module)
            self._es_layers = layers
        return layers

    def _es_write(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """(HF name, fp32 tensor) pairs -> the model's weight loader (casts, fuses, shards) -> post-load step."""
        model = self.model_runner.get_model()
        layer_map = self._es_post_load_layers(model)
        # On a GPU a step may still be in flight (asynchronous scheduling) or run on another stream than this
        # write: wait for the device before and after, so no forward pass sees half-written weights.
        self._es_sync()
        with torch.no_grad():
            params = {_plain(name): p for name, p in model.named_parameters(remove_duplicate=False)}
            storage = {name: p.data_ptr() for name, p in params.items()} if self._es_graphs_captured() else None
            loaded = model.load_weights(named)  # copies each tensor before taking the next
            if loaded is None:  # a model whose loader does not say what it loaded: redo every layer
                loaded = params
            touched = {
                id(layer): layer for name in loaded if name in params for layer in layer_map.get(id(params[name]), ())
            }
            for layer in touched.values():
                layer.quant_method.process_weights_after_loading(layer)
        self._es_sync()
        if storage is not None:
            check_written_in_place(storage, model, loaded)

    def _es_graphs_captured(self) -> bool:
        """vLLM on a GPU replays CUDA graphs (and torch.compile'd code) captured at start-up over the parameters'
        addresses unless engine.enforce_eager=true: a write must land in those same tensors."""
        return self.device.type == "cuda" and not getattr(self.model_config, "enforce_eager", False)

    def _es_sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _es_locations(self, model) -> dict[str, Location]:
        """HF name -> its ``Location`` on this rank: packed modules (qkv_proj, gate_up_proj) split by their local
        output sizes (a LoRA-wrapped layer's parameters, ``...qkv_proj.base_layer.weight``, matched without the
        wrapper's name), a vocabulary padded by vLLM cut back to the HF rows, tensor-parallel shards by
        ``tensor_parallel_parts``. Built once; parameters are looked up by name at each read, since vLLM's post-load
        step may replace them."""
        locations = getattr(self, "_es_locs", None)
        if locations is None:
            shapes, rank = self._es_hf_shapes(), self._es_rank()
            packed = getattr(model, "packed_modules_mapping", {})
            locations = {}
            for name, param in model.named_parameters():
                module_name = name.rpartition(".")[0]
                plain_module, _, leaf = _plain(name).rpartition(".")
                prefix, _, short = plain_module.rpartition(".")
                parts = [f"{prefix}.{part}.{leaf}" for part in packed[short]] if short in packed else [_plain(name)]
                if not all(part in shapes for part in parts):
                    continue
                row = 0
                module = model.get_submodule(module_name)
                for part, (rows, shard) in zip(
                    parts, tensor_parallel_parts(module, param, [tuple(shapes[p]) for p in parts], rank)
                ):
                    locations[part] = Location(name, row, rows, shard)
                    row += rows
            self._es_locs = locations
        return locations

    def _es_read(self, name: str) -> torch.Tensor:
        """The tensor vLLM holds on this rank for one HF name, in its dtype, shaped as this rank's part of the HF
        tensor, as a view (no copy)."""
        model = self.model_runner.get_model()
        locations = self._es_locations(model)
        if name not in locations:
            raise KeyError(f"vLLM's model has no tensor for the HF parameter {name!r}")
        loc = locations[name]
        param = model.get_parameter(loc.param)
        return param.detach().narrow(0, loc.row, loc.rows) if param.dim() else param.detach()

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
        return self._es().update(iteration, [Member(*map(int, m)) for m in members], list(fitness), sigma)

    def es_checksum_parts(self) -> dict:
        return self._es().checksum_parts()

    def es_mismatches(self) -> dict[str, int]:
        """Per tensor, the elements where this rank's engine does not hold cast(master) (empty: exact)."""
        return self._es().engine_mismatches()

    # -- population batching (es.perturbation=lowrank): vLLM's LoRA slots ------------------------------------
    def es_fill_lora(self, iteration: int, members: list[list[int]], sigma: float) -> None:
        """Member m's factors (``Replica.member_factors``) into the LoRA slot of adapter id m + 1, in place:
        lora_a = A_m^T (r x in), lora_b = B_s,m (out x r) = sign * sigma / sqrt(r) * B_m, so the slot adds
        (x A_m) B_s,m^T to the layer's output, scaling 1. Packed layers (qkv_proj, gate_up_proj) take one slice
        per HF tensor in their packing order; a LoRA layer part the replica does not perturb (outside
        model.trainable) gets zeros. The base weights are not touched. The slots hold the factors in the model's
        dtype (vLLM's LoRA buffers; its GPU kernels take fp16/bf16 only): what a member is scored with is rounded
        there, while the update never reads the slots: it regenerates each factor in fp32 from its seed
        (``Replica.update``)."""
        slots = self._es_lora_slots(len(members))
        factors = self._es().member_factors(iteration, [Member(*map(int, m)) for m in members], sigma)
        modules = self._es_lora_manager()._adapter_manager.modules
        self._es_sync()  # a step in flight (GPU) must not see half-filled slots
        with torch.no_grad():
            for module_name, names in self._es_lora_targets().items():
                module = modules[module_name]
                for m, slot in enumerate(slots):
                    a = [factors[n][0][m].T if n in factors else None for n in names]
                    b = [factors[n][1][m] if n in factors else None for n in names]
                    if all(t is None for t in a):
                        module.reset_lora(slot)
                    elif len(names) == 1:
                        module.set_lora(slot, a[0], b[0])
                    else:
                        module.set_lora(slot, a, b)
        self._es_sync()

    def _es_lora_manager(self):
        manager = getattr(self.model_runner, "lora_manager", None)
        if manager is None:
            raise RuntimeError(
                "es.perturbation=lowrank: this vLLM engine was built without LoRA (VLLMEngine needs "
                "lowrank=LowRankSlots(...), which make_engine passes for es.perturbation=lowrank)"
            )
        return manager

    def _es_lora_slots(self, count: int) -> list[int]:
        """The slot indices of adapters 1..count, registering each the first time as an in-memory adapter (vLLM's
        own zero-weight dummy, no file) and pinning it: a pinned adapter is never evicted nor deactivated, so vLLM
        never copies the dummy's zeros over a slot this extension filled, and a request for ids 1..count never
        loads anything (a load would fail on the LoRARequest's path, which does not exist)."""

        worker = self._es_lora_manager()
        manager = worker._adapter_manager
        if count > manager.lora_slots:
            raise RuntimeError(
                f"{count} members, and the engine has {manager.lora_slots} LoRA slots (LowRankSlots.members)"
            )
        registered = worker.list_adapters()
        for lora_id in range(1, count + 1):
            if lora_id not in registered:
                worker.add_dummy_lora(LoRARequest(member_lora_name(lora_id - 1), lora_id, LORA_PATH), rank=1)
            worker.pin_adapter(lora_id)  # activates it into a free slot if it is not active
        return [manager.lora_index_to_id.index(lora_id) for lora_id in range(1, count + 1)]

    def _es_lora_targets(self) -> dict[str, list[str]]:
        """LoRA layer name -> the HF tensors it computes, in its slice order (``Location.row``); built once, and
        checked: every tensor the replica perturbs has a LoRA layer (else its perturbation would be dropped)."""
        targets = getattr(self, "_es_lora", None)
        if targets is None:
            model = self.model_runner.get_model()
            by_param: dict[str, list[tuple[int, str]]] = {}
            for name, loc in self._es_locations(model).items():
                by_param.setdefault(loc.param, []).append((loc.row, name))
            targets = {}
            for module_name, module in self._es_lora_manager()._adapter_manager.modules.items():
                names = [name for _, name in sorted(by_param.get(f"{module_name}.base_layer.weight", []))]
                if len(names) != int(getattr(module, "n_slices", 1)):
                    raise RuntimeError(
                        f"LoRA layer {module_name} has {getattr(module, 'n_slices', 1)} slices and "
                        f"the HF tensors {names}: es_fill_lora does not know this layer's layout"
                    )
                targets[module_name] = names
            covered = {name for names in targets.values() for name in names}
            missing = [name for name in self._es().names if name not in covered]
            if missing:
                raise RuntimeError(
                    f"es.perturbation=lowrank perturbs {missing[:3]} ({len(missing)} tensors), and "
                    "vLLM's LoRA has no layer for them; narrow model.trainable or use engine.name=hf"
                )
            self._es_lora = targets
        return targets

    # -- weights and state (tensors: checkpoints, GRPO sync and tests only) ----------------------------------
    def es_write_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        # a tensor already on this device (a colocated learner's, es_ray/engines/vllm.py) is written as it is
        self._es_write((name, t.to(self.device)) for name, t in named)

    def es_state_dict(self) -> dict:
        """This rank's ``Replica.state_dict`` (the parts it owns) on the CPU, without a copy where it is there."""
        return _to_cpu(self._es().state_dict())

    def es_load_state_dict(self, sd: dict) -> None:
        """A state of tensors, or a checkpoint read lazily (``es_ray.es.state.load_es_state``, sent as its file
        names): then every tensor of it (master, optimizer moments, theta_0) is read when the replica takes it, this
        rank reading only its own rows or columns (``sliced``)."""
        replica = self._es()
        sd = {key: value.sliced(replica.shards) if hasattr(value, "sliced") else value for key, value in sd.items()}
        opt = sd.get("optimizer")
        if opt is not None and hasattr(opt["state"], "sliced"):
            sd["optimizer"] = {**opt, "state": opt["state"].sliced(replica.shards)}
        replica.load_state_dict(sd)

    def es_save_part(self, directory: str) -> dict:
        """This rank's part of the state (the parts it owns: master, optimizer moments, theta_0) written under
        ``directory``/rank-<r> (``write_state_part``): nothing is gathered, only file names and shards go back."""
        return write_state_part(self._es().state_dict(), os.path.join(directory, f"rank-{self._es_rank()}"))

    def es_load_state_file(self, path: str) -> None:
        """This rank's parts of the state saved at ``path`` (``VLLMReplicaHost.load_state_dict`` under tensor
        parallelism): the file is memory-mapped, so the rank copies its shard out of the page cache instead of
        receiving the whole state."""
        self._es().load_state_dict(torch.load(path, map_location="cpu", mmap=True, weights_only=True))

    def es_logit_scale(self, scale: float) -> float:
        """Set the model's logit scale (vLLM's LogitsProcessor multiplies the logits by it before any log-prob is
        taken, prompt log-probs included) and return the previous one. ``VLLMEngine.token_logprobs`` divides it by
        T for one call, so vLLM returns log softmax(l / T) of the tokens asked for, not the whole vocabulary."""
        processor = getattr(self.model_runner.get_model(), "logits_processor", None)
        if processor is None or not hasattr(processor, "scale"):
            raise RuntimeError(
                f"{type(self.model_runner.get_model()).__name__} has no logits_processor.scale: "
                "log-probs at a temperature other than 1 need it; use engine.name=hf"
            )
        previous, processor.scale = float(processor.scale), float(scale)
        return previous

    def es_device_memory(self) -> tuple[int, int]:
        """(free, total) bytes of this worker's own GPU, measured here, after vLLM sized its KV cache
        (``VLLMEngine.check_es_memory``)."""
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def es_read_weights(self) -> tuple[dict[str, Shard], dict[str, torch.Tensor]]:
        """The parts of the engine's weights this rank owns, in HF layout (fused tensors split back), fp32 on the
        CPU, with their shards (``gather_shards`` joins the ranks')."""
        locations = self._es_locations(self.model_runner.get_model())
        owned = {name: loc.shard for name, loc in locations.items() if loc.shard.owner}
        return owned, {name: self._es_read(name).to("cpu", torch.float32, copy=True) for name in owned}


def write_state_part(state: dict, directory: str) -> dict:
    """One replica's ``Replica.state_dict`` (on any device) into ``directory``, one safetensors file per tensor,
    each copied to the CPU in fp32 on its own: a tensor-parallel rank's part of an ES checkpoint, which
    ``es_ray.es.state.save_es_checkpoint_parts`` assembles. Returns {"t", "tensors": key -> (file, shard)}."""
    os.makedirs(directory, exist_ok=True)
    shards, out = state.get("shards") or {}, {}
    for number, (key, name, t) in enumerate(state_tensors(state)):
        file = os.path.join(directory, f"{number:06d}.safetensors")
        save_file({key: t.detach().to("cpu", torch.float32).contiguous()}, file)
        out[key] = (file, shards.get(name) or Shard(tuple(t.shape)))
    return {"t": int((state.get("optimizer") or {}).get("t", 0)), "tensors": out}


def _plain(name: str) -> str:
    """A vLLM parameter name without LoRA wrappers (``qkv_proj.base_layer.weight`` -> ``qkv_proj.weight``), as the
    model's ``load_weights`` names what it loaded."""
    return name.replace(".base_layer.", ".")


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu")
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
