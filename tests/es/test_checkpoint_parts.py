"""ES checkpoints written from parts and read back by part (``es_ray.es.state``): each tensor-parallel rank writes
its own part of the state tensor by tensor, the checkpoint is assembled from the parts one tensor at a time (the
same bytes as a save of the whole state), and a rank resuming reads only its part of each tensor, from mappings
that cross processes as file names."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from helpers import FITNESS, RUN_SEED, SKIP_VLLM, replica_spec

from es_ray.engines.vllm_extension import ESExtension, write_state_part
from es_ray.es.state import STATE_TENSORS, LazyTensors, load_es_state, save_es_checkpoint, save_es_checkpoint_parts
from es_ray.replica import Shard
from es_ray.strategy import ask


def _two_ranks(whole: dict) -> tuple[list[dict], dict[str, list[Shard]]]:
    """A whole state split as two tensor-parallel ranks hold it: matrices by rows or by columns (alternating), the
    rest whole on both ranks and owned by rank 0 (a norm weight). Each rank's ``Replica.state_dict``: its owned
    parts with their shards."""
    shards: dict[str, list[Shard]] = {}
    for i, (name, t) in enumerate(sorted(whole["master"].items())):
        if t.dim() == 2:
            dim = i % 2
            half = t.shape[dim] // 2
            shards[name] = [Shard.part(t.shape, dim, 0, half), Shard.part(t.shape, dim, half, t.shape[dim])]
        else:
            shards[name] = [Shard(tuple(t.shape)), Shard(tuple(t.shape), owner=False)]
    ranks = []
    for r in range(2):
        owned = {n: s[r] for n, s in shards.items() if s[r].owner}
        ranks.append(
            {
                "shards": owned,
                "master": {n: s.take(whole["master"][n]).clone() for n, s in owned.items()},
                "optimizer": {
                    "t": whole["optimizer"]["t"],
                    "state": {
                        n: {k: owned[n].take(v).clone() for k, v in m.items()}
                        for n, m in whole["optimizer"]["state"].items()
                        if n in owned
                    },
                },
                "theta0": {n: s.take(whole["theta0"][n]).clone() for n, s in owned.items()},
            }
        )
    return ranks, shards


@pytest.fixture()
def whole_state(tiny_model_dir) -> dict:
    gen = torch.Generator().manual_seed(0)
    master = {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in LazyTensors(tiny_model_dir).items()}
    del master["lm_head.weight"]  # tied: the embedding
    opt = {
        n: {"m": torch.randn(t.shape, generator=gen), "v": torch.rand(t.shape, generator=gen)}
        for n, t in master.items()
    }
    return {"master": master, "optimizer": {"t": 5, "state": opt}, "theta0": {n: t * 0.5 for n, t in master.items()}}


def test_parts_assemble_the_bytes_of_a_whole_save_and_ranks_read_only_their_part(whole_state, tiny_model_dir, tmp_path):
    ranks, shards = _two_ranks(whole_state)
    whole = save_es_checkpoint(tmp_path / "whole", whole_state, tiny_model_dir, {"iteration": 1})
    written = []

    def write_parts(directory: str) -> list[dict]:
        parts = [write_state_part(st, os.path.join(directory, f"rank-{r}")) for r, st in enumerate(ranks)]
        written.extend(sorted(os.listdir(directory)))
        return parts

    parted = save_es_checkpoint_parts(tmp_path / "parted", write_parts, tiny_model_dir, {"iteration": 1})
    assert written == ["rank-0", "rank-1"]
    assert sorted(p.name for p in parted.iterdir()) == sorted(p.name for p in whole.iterdir())
    for name in ("model.safetensors", STATE_TENSORS, "es_state.pt"):
        assert (parted / name).read_bytes() == (whole / name).read_bytes(), name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the parts are gone

    state = load_es_state(parted)
    assert state["optimizer"]["t"] == 5 and set(state["optimizer"]["state"]) == set(whole_state["master"])
    for n, t in whole_state["master"].items():
        assert torch.equal(state["master"][n], t)
        assert torch.equal(state["theta0"][n], whole_state["theta0"][n])
        for k, v in whole_state["optimizer"]["state"][n].items():
            assert torch.equal(state["optimizer"]["state"][n][k], v)
    # what a rank is sent: file names, not tensors; and it reads only its own rows or columns of the master
    sent = pickle.dumps(state)
    assert len(sent) < 20_000 < sum(4 * t.numel() for t in whole_state["master"].values())
    rank1 = pickle.loads(sent)
    mine = {n: s[1] for n, s in shards.items()}
    master, moments, theta0 = (
        rank1["master"].sliced(mine),
        rank1["optimizer"]["state"].sliced(mine),
        rank1["theta0"].sliced(mine),
    )
    for n, s in mine.items():
        assert tuple(master[n].shape) == s.local_shape and torch.equal(master[n], s.take(whole_state["master"][n]))
        assert torch.equal(theta0[n], s.take(whole_state["theta0"][n]))
        assert all(torch.equal(moments[n][k], s.take(v)) for k, v in whole_state["optimizer"]["state"][n].items())


def test_a_checkpoint_with_the_moments_in_es_state_pt_still_loads(whole_state, tiny_model_dir, tmp_path):
    """The layout written before es_state.tensors: the moments and theta_0 torch.save'd inside es_state.pt."""
    from es_ray.runtime.checkpoint import save_checkpoint

    path = save_checkpoint(
        tmp_path / "old",
        whole_state["master"],
        tiny_model_dir,
        {"optimizer": whole_state["optimizer"], "theta0": whole_state["theta0"]},
        {"iteration": 1},
        "es",
    )
    assert not (path / STATE_TENSORS).exists()
    state = load_es_state(path)
    assert state["optimizer"]["t"] == 5
    for n, t in whole_state["master"].items():
        assert torch.equal(state["master"][n], t) and torch.equal(state["theta0"][n], whole_state["theta0"][n])
        assert torch.equal(state["optimizer"]["state"][n]["m"], whole_state["optimizer"]["state"][n]["m"])


def test_a_state_without_moments_writes_no_state_tensors(tiny_model_dir, tmp_path):
    master = dict(LazyTensors(tiny_model_dir).items())
    path = save_es_checkpoint(
        tmp_path / "sgd",
        {"master": master, "optimizer": {"t": 2, "state": {}}, "theta0": None},
        tiny_model_dir,
        {"iteration": 2},
    )
    assert not (path / STATE_TENSORS).exists()
    state = load_es_state(path)
    assert state["optimizer"] == {"t": 2, "state": {}} and state["theta0"] is None


@SKIP_VLLM
def test_tensor_parallel_ranks_save_and_resume_their_own_parts(tiny_model_dir, tmp_path):
    """engine.tensor_parallel_size=2 (vLLM's CPU build) with Adam and theta_0: the checkpoint written from the ranks'
    parts equals the one saved from their gathered state, byte for byte; a resume sends the ranks the checkpoint's
    file names only (one es_load_state_dict) and every rank comes back to the saved master and optimizer exactly;
    the transformers engine resumes from it too, to the same next update."""
    from es_ray.core.config import EngineConfig
    from es_ray.engines.base import make_engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    env = dict(os.environ)
    spec = replica_spec(RUN_SEED, noise="counter", optimizer="adam", anchor_decay=0.1)
    tp = make_engine(
        str(tiny_model_dir),
        EngineConfig(name="vllm", dtype="float32", device="cpu", enforce_eager=True, tensor_parallel_size=2),
    )
    ref = make_engine(str(tiny_model_dir), EngineConfig(name="hf", dtype="float32", device="cpu"))
    try:
        host = tp.replica_host()
        host.setup(spec)
        host.update(0, ask(4), FITNESS, 0.01)
        saved = host.checksum()
        parted = save_es_checkpoint_parts(tmp_path / "parted", host.save_parts, tiny_model_dir, {"iteration": 1})
        gathered = save_es_checkpoint(tmp_path / "gathered", host.state_dict(), tiny_model_dir, {"iteration": 1})
        for name in ("model.safetensors", STATE_TENSORS, "es_state.pt"):
            assert (parted / name).read_bytes() == (gathered / name).read_bytes(), name
        host.update(1, ask(4), FITNESS, 0.01)
        assert host.checksum() != saved
        calls, rpc = [], tp._rpc
        tp._rpc = lambda method, *args: calls.append(method.__name__) or rpc(method, *args)
        try:
            host.load_state_dict(load_es_state(parted))
        finally:
            del tp._rpc
        assert calls == ["es_load_state_dict"] and host.checksum() == saved
        assert tp._rpc(ESExtension.es_mismatches) == [{}, {}]
        again = save_es_checkpoint_parts(tmp_path / "again", host.save_parts, tiny_model_dir, {"iteration": 1})
        for name in ("model.safetensors", STATE_TENSORS):  # the optimizer state came back too
            assert (again / name).read_bytes() == (parted / name).read_bytes(), name
        # the same checkpoint resumes on the unsplit transformers engine: the next Adam step agrees bit for bit
        other = ref.replica_host()
        other.setup(spec)
        other.load_state_dict(load_es_state(parted))
        assert other.checksum() == saved
        host.update(1, ask(4), FITNESS, 0.01)
        other.update(1, ask(4), FITNESS, 0.01)
        assert other.checksum() == host.checksum() != saved
    finally:
        ref.close()
        tp.close()
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(env)
