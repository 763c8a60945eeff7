"""grpo.colocate=true: the sync hands the learner's full tensors to the engine beside it where they are, with no host
copy in between (grpo/colocated.py ``sync_local``, ``GRPOLearner.weight_chunk(on_device=True)``). Counted on the CPU
build by a mode that sees every torch call of the sync and adds up the bytes of each new tensor a copy made; the
separate placement's chunks (copied to the host for Ray) are the reference the counter must see."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from es_ray.grpo.config import to_grpo_config

COPIES = {"to", "cpu", "cuda", "clone", "contiguous", "_to_copy", "detach_copy", "copy"}


class CopyCounter(TorchFunctionMode):
    """Bytes of the tensors a copying call (``.to``, ``.cpu``, ``.clone`` ...) returned in new storage: ``moved`` for
    a copy in the same dtype (a transfer), ``cast`` for one into another dtype; in-place writes (``copy_``) are the
    engine's own and counted as ``written``."""

    def __init__(self):
        super().__init__()
        self.moved = self.cast = self.written = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        src = next((t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None)
        if name == "copy_" and isinstance(out, torch.Tensor):
            self.written += out.nbytes
        elif (
            name in COPIES
            and isinstance(out, torch.Tensor)
            and src is not None
            and out.numel()
            and out.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
        ):
            if out.dtype == src.dtype:
                self.moved += out.nbytes
            else:
                self.cast += out.nbytes
        return out


def test_a_colocated_sync_copies_nothing_through_the_host(tiny_model_dir):
    from es_ray.grpo.colocated import ColocatedWorker

    cfg = to_grpo_config(
        {
            "model": {"path": str(tiny_model_dir)},
            "task": {"name": "es_test_tasks:VowelTask", "train_size": 4},
            "engine": {"name": "hf", "threads": 1, "device": "cpu", "dtype": "float32"},
            "cluster": {"num_actors": 1},
            "grpo": {"colocate": True, "micro_batch_size": 2, "prompts_per_step": 2, "group_size": 2},
        }
    )
    worker = ColocatedWorker(cfg)
    with torch.no_grad():
        for p in worker.learner.params:
            p.add_(0.25)  # the learner moved away from the engine: the sync must bring the engine along
    model_bytes = sum(p.nbytes for p in worker.learner.named.values())
    with CopyCounter() as together:
        out = worker.sync_local("float32")
    engine = worker.engine.params
    assert all(torch.equal(engine[n], p) for n, p in worker.learner.named.items())
    assert out["bytes"] == model_bytes and together.written == model_bytes
    assert together.moved == 0 and together.cast == 0, (together.moved, together.cast)

    with CopyCounter() as apart:  # the separate placement's chunks: copied to the host for Ray's object store
        for k in range(len(worker.learner.chunks)):
            worker.write_weights(worker.learner.weight_chunk(k, "float32"))
    assert apart.moved == model_bytes  # the counter sees the host round trip where there is one
    print(
        f"bytes copied per sync (CPU build, tiny model of {model_bytes} B): colocated {together.moved}, "
        f"through the host {apart.moved}"
    )


def test_discarded_weights_are_refused_to_a_generate_until_a_whole_sync_rewrites_them(monkeypatch):
    """Level 2 (grpo/colocated.py SLEEP_LEVEL) discards the engine's weights: woken, vLLM maps back memory holding
    whatever it holds (vLLM's ``CuMemBackend.suspend`` offloads "weights" at level 1 only). A generate or probe after
    a sync that failed half-way is refused instead of sampling from that memory; a whole sync allows it again."""
    import pytest
    from types import SimpleNamespace

    from es_ray.grpo import colocated

    calls, fail = [], {"at": 1}

    def weight_chunk(k, dtype, everywhere, on_device):
        if k == fail["at"]:
            raise RuntimeError("chunk lost")
        return {f"w{k}": torch.zeros(1)}

    engine = SimpleNamespace(
        sleep=lambda level: calls.append(("sleep", level)),
        wake_up=lambda tags: calls.append(("wake", *tags)),
        write_weights=lambda items: calls.append(("write", [n for n, _ in items])),
        generate=lambda *a: calls.append("generate") or [],
    )
    worker = object.__new__(colocated.ColocatedWorker)
    worker.cfg, worker.engine, worker.sleeping, worker.discarded = None, engine, [], False
    worker.learner = SimpleNamespace(chunks=[0, 1], train_step=lambda s, a: {}, weight_chunk=weight_chunk)
    monkeypatch.setattr(colocated, "_on_gpu", lambda cfg: True)
    monkeypatch.setattr(colocated, "_release_cached_device_memory", lambda: None)
    monkeypatch.setattr(colocated.RolloutWorker, "generate", lambda self, *a: self.engine.generate(*a))
    monkeypatch.setattr(
        colocated.RolloutWorker,
        "write_weights",
        lambda self, w: self.engine.write_weights(list(w.items())) or {"bytes": 0},
    )
    worker.train_step([], [])
    with pytest.raises(RuntimeError, match="chunk lost"):
        worker.sync_local("bfloat16")  # chunk 0 written, chunk 1 not
    for call in (lambda: worker.generate([0], 2, 0), lambda: worker.probe()):
        with pytest.raises(RuntimeError, match="discarded by its level-2 sleep"):
            call()
    assert "generate" not in calls and ("wake", "kv_cache") not in calls
    fail["at"] = None
    worker.sync_local("bfloat16")
    worker.generate([0], 2, 0)
    assert calls[-3:] == [("write", ["w1"]), ("wake", "kv_cache"), "generate"]
