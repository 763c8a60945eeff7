"""Checkpoints that prove themselves: every file carries a digest checked before it is read (a flipped byte is
refused, naming the file), state files are read with weights_only=True (a planted pickle never runs), a killed save
leaves the previous checkpoint as the latest, and a corrupt seed-log record in the middle is refused with its line
number while a torn last line is cut. No Ray: ES checkpoints through ``es_ray.es.state``, GRPO through its
learner in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import flip_byte

from es_ray.es.state import SeedLog, list_checkpoints, load_es_state, save_es_checkpoint
from es_ray.runtime.checkpoint import MANIFEST, CheckpointError, checkpoint_dirs, publish_dir, staging_dir, verify_dir
from paths import REPO


class Planted:
    """A pickle that runs code when unpickled (what a tampered state file would hold)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant(ckpt: Path, state_name: str, marker: Path) -> None:
    """Replace the state file with a code-running pickle and re-publish, so the digests match: only
    weights_only=True stands between the file and the code."""
    torch.save({"optimizer": Planted(marker)}, ckpt / state_name)
    (ckpt / MANIFEST).unlink()
    tmp = staging_dir(ckpt)
    for f in ckpt.iterdir():
        os.rename(f, tmp / f.name)
    publish_dir(tmp, ckpt)


# -- the shared API ------------------------------------------------------------------------------------------------


def test_the_weights_file_is_hashed_as_it_is_written(tmp_path):
    """write_fp32_safetensors returns the sha256 of the file it wrote (taken from the bytes as they were written,
    tensor by tensor in a helper thread); publish_dir takes it instead of reading the file again, and the file loads
    with safetensors as written."""
    from safetensors.torch import load_file

    from es_ray.core.manifest import sha256_file
    from es_ray.runtime.checkpoint import write_fp32_safetensors

    g = torch.Generator().manual_seed(0)
    tensors = {
        "b": torch.randn(3, 5, generator=g),
        "a": torch.randn(7, generator=g, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "big": torch.randn(512, 257, generator=g),
    }
    tmp = staging_dir(tmp_path / "ck")
    digest = write_fp32_safetensors(
        tmp / "model.safetensors", {k: (tuple(t.shape), lambda t=t: t) for k, t in tensors.items()}, {"format": "pt"}
    )
    assert digest == sha256_file(tmp / "model.safetensors")
    loaded = load_file(tmp / "model.safetensors")
    assert all(torch.equal(loaded[k], t.float()) for k, t in tensors.items())
    (tmp / "meta.json").write_text("{}")
    final = publish_dir(tmp, tmp_path / "ck", {"model.safetensors": digest})
    assert verify_dir(final)["model.safetensors"]["sha256"] == digest


def test_an_es_checkpoint_of_a_transformers_replica_does_not_import_vllm(tiny_model_dir, tmp_path):
    """Saving (and verifying) an ES checkpoint needs no engine library: a transformers actor's final checkpoint
    paid vLLM's import (seconds) when the state's keys were listed beside vLLM's part writer."""
    code = f"""
import sys
from es_ray.es.state import load_es_state, save_es_checkpoint
from es_ray.models import load_hf_weights
save_es_checkpoint({str(tmp_path / "ck")!r}, {{"master": load_hf_weights({str(tiny_model_dir)!r})}},
                   {str(tiny_model_dir)!r}, {{"iteration": 1}})
load_es_state({str(tmp_path / "ck")!r})
assert "vllm" not in sys.modules, "vllm imported"
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    verify_dir(tmp_path / "ck")


def test_publish_writes_digests_and_verify_names_the_bad_file(tmp_path):
    tmp = staging_dir(tmp_path / "ck")
    assert tmp.name.startswith(".")
    (tmp / "shard").mkdir()
    (tmp / "shard" / "rank0.bin").write_bytes(b"x" * 100)
    (tmp / "meta.json").write_text("{}")
    final = publish_dir(tmp, tmp_path / "ck")
    assert not tmp.exists() and set(verify_dir(final)) == {"shard/rank0.bin", "meta.json"}
    flip_byte(final / "shard" / "rank0.bin")
    with pytest.raises(CheckpointError, match=r"rank0\.bin: sha256 .* where manifest\.json says"):
        verify_dir(final)
    flip_byte(final / "shard" / "rank0.bin")
    (final / "extra.safetensors").write_bytes(b"")  # a loader that globs would read it
    with pytest.raises(CheckpointError, match=r"extra\.safetensors: not in"):
        verify_dir(final)
    (final / "extra.safetensors").unlink()
    (final / "meta.json").write_text("{ }")  # same content, other size
    with pytest.raises(CheckpointError, match=r"meta\.json: 3 bytes where manifest\.json says 2"):
        verify_dir(final)
    (final / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json: missing"):
        verify_dir(final)


def test_publishing_again_replaces_the_old_directory_and_hidden_ones_are_never_listed(tmp_path):
    for content in (b"old", b"new"):
        tmp = staging_dir(tmp_path / "final")
        (tmp / "f").write_bytes(content)
        publish_dir(tmp, tmp_path / "final")
    assert (tmp_path / "final" / "f").read_bytes() == b"new"
    stale = staging_dir(tmp_path / "step_000009")  # what a kill during a write leaves
    (stale / "grpo_meta.json").write_text("{}")
    assert checkpoint_dirs(tmp_path) == [tmp_path / "final"]
    assert not stale.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["final"]


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_a_published_directory_has_the_mode_the_umask_gives(tmp_path, mask):
    """mkdtemp stages at 0700; the published checkpoint is what mkdir would make (0777 less the umask), so other
    users and nodes' processes on shared storage read it as they read its files."""
    old = os.umask(mask)
    try:
        tmp = staging_dir(tmp_path / "final")
        (tmp / "f").write_bytes(b"x")
        (tmp / "part").mkdir()
        final = publish_dir(tmp, tmp_path / "final")
    finally:
        os.umask(old)
    assert final.stat().st_mode & 0o777 == 0o777 & ~mask
    assert (final / "f").stat().st_mode & 0o777 == 0o666 & ~mask
    assert (final / "part").stat().st_mode & 0o777 == 0o777 & ~mask


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """The embedded GGUF converted afresh (not the cache's copy, which an older conversion may have written), under
    umask 027."""
    from es_ray.models import convert_gguf, embedded_gguf_path

    old = os.umask(0o027)
    try:
        return convert_gguf(embedded_gguf_path(), tmp_path_factory.mktemp("gguf") / "converted")
    finally:
        os.umask(old)


@pytest.mark.slow
def test_the_converted_default_model_has_the_mode_the_umask_gives(converted):
    assert converted.stat().st_mode & 0o777 == 0o750
    modes = {f.name: f.stat().st_mode & 0o777 for f in converted.iterdir()}
    assert modes and all(m == 0o640 for m in modes.values()), modes  # model.safetensors was written 0600


@pytest.mark.slow
def test_the_converted_default_model_holds_the_gguf_tensors_dequantised(converted):
    """Every tensor against the file read by gguf alone, through llama.cpp's name map: as it is (the embedding a
    Q8_0, the projections Q4_1, the norms F32), q and k through llama.cpp's rotary permutation (convert_hf_to_gguf's
    ``permute``); the LM head tied to the embedding."""
    from gguf import MODEL_ARCH, GGUFReader, dequantize, get_tensor_name_map
    from safetensors.torch import load_file

    from es_ray.models import embedded_gguf_path

    tensors = {t.name: t for t in GGUFReader(embedded_gguf_path()).tensors}
    hf = load_file(converted / "model.safetensors")
    config = json.loads((converted / "config.json").read_text())
    names = get_tensor_name_map(MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}

    def permute(w: torch.Tensor, n: int) -> torch.Tensor:
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    assert config["tie_word_embeddings"] and "lm_head.weight" not in hf
    seen = set()
    for key, weight in hf.items():
        gguf_name = names.get_name(key.removesuffix(".weight")) + ".weight"
        t = tensors[gguf_name]
        from_gguf = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(
            [int(n) for n in reversed(t.shape)]
        )
        proj = key.split(".")[-2]
        assert torch.equal(permute(weight, heads[proj]) if proj in heads else weight, from_gguf), key
        seen.add(gguf_name)
    assert seen == set(tensors)  # every tensor of the file, each once
    assert {
        tensors[n].tensor_type.name for n in ("token_embd.weight", "blk.0.ffn_down.weight", "blk.0.attn_norm.weight")
    } == {"Q8_0", "Q4_1", "F32"}


def _tiny_llama_gguf(path: Path) -> Path:
    """A 2-layer Llama GGUF with a 40-token BPE vocabulary: Q8_0 projections and embedding, F32 norms."""
    import gguf

    hidden, ffn, layers, vocab, heads, kv_heads = 64, 128, 2, 40, 4, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_freq_base(10000.0)
    tokens = [chr(ord("a") + i) for i in range(26)] + [
        "ab",
        "bc",
        "cd",
        "<s>",
        "</s>",
        "<unk>",
        "de",
        "ef",
        "fg",
        "gh",
        "hi",
        "ij",
        "jk",
        "kl",
    ]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * vocab)
    w.add_token_merges(["a b", "b c", "c d", "d e", "e f"])
    w.add_bos_token_id(29)
    w.add_eos_token_id(30)
    rng = np.random.default_rng(0)
    q8 = gguf.GGMLQuantizationType.Q8_0

    def add(name, shape, quantised=True):
        a = rng.standard_normal(shape).astype(np.float32)
        if quantised:
            w.add_tensor(name, gguf.quants.quantize(a, q8), raw_dtype=q8)
        else:
            w.add_tensor(name, a)

    add("token_embd.weight", (vocab, hidden))
    add("output_norm.weight", (hidden,), quantised=False)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", (hidden,), quantised=False)
        add(f"blk.{i}.ffn_norm.weight", (hidden,), quantised=False)
        kv = hidden // heads * kv_heads
        for name, shape in [
            ("attn_q", (hidden, hidden)),
            ("attn_k", (kv, hidden)),
            ("attn_v", (kv, hidden)),
            ("attn_output", (hidden, hidden)),
            ("ffn_gate", (ffn, hidden)),
            ("ffn_up", (ffn, hidden)),
            ("ffn_down", (hidden, ffn)),
        ]:
            add(f"blk.{i}.{name}.weight", shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_conversion_reads_the_gguf_once_and_writes_the_same_files(tmp_path, monkeypatch):
    """convert_gguf on a tiny Llama GGUF: gguf's reader opens the file once and llama.cpp's name map is built
    once (without the sharing: three readers, a map per module), and the files are byte for byte those of a
    conversion without it. gguf's own reader and map are back after, and after an error in the block."""
    import contextlib
    import hashlib

    import gguf
    from gguf.gguf_reader import GGUFReader
    from gguf.tensor_mapping import get_tensor_name_map

    from es_ray import models

    src = _tiny_llama_gguf(tmp_path / "tiny.gguf")
    calls = {"reader": 0, "map": 0}

    def counted_reader(*args, **kwargs):
        calls["reader"] += 1
        return GGUFReader(*args, **kwargs)

    def counted_map(*args, **kwargs):
        calls["map"] += 1
        return get_tensor_name_map(*args, **kwargs)

    def convert(name: str) -> dict:
        calls.update(reader=0, map=0)
        with monkeypatch.context() as m:  # the counters stand in for gguf's own, where they are defined and exported
            for where in ("gguf.gguf_reader", "gguf"):
                m.setattr(f"{where}.GGUFReader", counted_reader)
            for where in ("gguf.tensor_mapping", "gguf"):
                m.setattr(f"{where}.get_tensor_name_map", counted_map)
            out = models.convert_gguf(src, tmp_path / name)
            assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (counted_reader, counted_map)  # put back
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in out.iterdir()} | {"counts": dict(calls)}

    shared = convert("shared")
    with monkeypatch.context() as m:
        m.setattr(models, "_gguf_parsed_once", contextlib.nullcontext)
        plain = convert("plain")
    assert shared.pop("counts") == {"reader": 1, "map": 1}
    counts = plain.pop("counts")
    assert counts["reader"] == 3 and counts["map"] > 10, counts
    assert shared == plain and "model.safetensors" in shared
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (GGUFReader, get_tensor_name_map)
    with pytest.raises(RuntimeError, match="inside"):
        with models._gguf_parsed_once():
            assert gguf.GGUFReader is not GGUFReader
            raise RuntimeError("inside")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (GGUFReader, get_tensor_name_map)


# -- ES ----------------------------------------------------------------------------------------------------------


@pytest.fixture()
def es_checkpoint(tiny_model_dir, tmp_path) -> Path:
    state = load_es_state(tiny_model_dir)
    master = {n: state["master"][n] for n in state["master"]}
    opt = {
        "t": 3,
        "state": {n: {"m": torch.full_like(t, 0.5), "v": torch.ones_like(t)} for n, t in list(master.items())[:2]},
    }
    path = tmp_path / "run" / "checkpoints" / "iter_000002"
    save_es_checkpoint(
        path, {"master": master, "optimizer": opt, "theta0": None}, tiny_model_dir, {"iteration": 2, "checksum": "abc"}
    )
    return path


def test_es_checkpoint_round_trip_reads_tensor_by_tensor(es_checkpoint, tiny_model_dir):
    state = load_es_state(es_checkpoint)
    base = load_es_state(tiny_model_dir)["master"]
    assert set(state["master"]) == set(base)
    assert all(torch.equal(state["master"][n], base[n]) for n in base)
    assert state["optimizer"]["t"] == 3 and len(state["optimizer"]["state"]) == 2
    assert state["master"].nbytes() == sum(4 * t.numel() for n, t in base.items() if n != "lm_head.weight")
    assert [(it, p.name) for it, p, _ in list_checkpoints(es_checkpoint.parents[1])] == [(2, "iter_000002")]


@pytest.mark.parametrize("name", ["model.safetensors", "es_state.pt", "config.json"])
def test_es_checkpoint_with_a_flipped_byte_is_refused_naming_the_file(es_checkpoint, name):
    flip_byte(es_checkpoint / name)
    with pytest.raises(CheckpointError, match=rf"{es_checkpoint / name}: sha256 .*corrupted"):
        load_es_state(es_checkpoint)


def test_es_meta_with_a_flipped_byte_is_refused_when_listing(es_checkpoint):
    flip_byte(es_checkpoint / "es_meta.json", offset=5)
    with pytest.raises(CheckpointError, match=r"es_meta\.json: sha256"):
        list_checkpoints(es_checkpoint.parents[1])


def test_es_state_with_a_planted_pickle_is_refused_and_never_runs(es_checkpoint, tmp_path):
    marker = tmp_path / "pwned"
    plant(es_checkpoint, "es_state.pt", marker)
    verify_dir(es_checkpoint)  # the digests match: the attacker re-published
    with pytest.raises(CheckpointError, match=r"es_state\.pt: refused by torch\.load\(weights_only=True\)"):
        load_es_state(es_checkpoint)
    assert not marker.exists()


_KILLED_SAVE = """
import os, sys
from pathlib import Path
from es_ray.es.state import load_es_state, save_es_checkpoint
import es_ray.runtime.checkpoint as ck
model, path, where = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
state = load_es_state(model)
state = {"master": dict(state["master"].items()), "optimizer": state["optimizer"], "theta0": None}
rename, calls = os.rename, []
def dying_rename(a, b):
    calls.append(b)
    if where == "between" and len(calls) == 2:  # the old one is aside, the new one not yet in
        os._exit(9)
    rename(a, b)
def dying_publish(tmp, final, digests=None):
    os._exit(9)  # killed after writing, before publishing
ck.os.rename = dying_rename
if where == "writing":
    ck.publish_dir = dying_publish
save_es_checkpoint(path, state, model, {"iteration": 4})
"""


@pytest.mark.parametrize("where, name", [("writing", "iter_000004"), ("between", "iter_000002")])
def test_a_killed_save_leaves_the_previous_checkpoint_as_the_latest(es_checkpoint, tiny_model_dir, where, name):
    checkpoints = es_checkpoint.parent
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_SAVE, str(tiny_model_dir), str(checkpoints / name), where],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 9, proc.stderr[-2000:]
    assert any(p.name.startswith(".") for p in checkpoints.iterdir()), "the kill left nothing behind to clean"
    found = list_checkpoints(checkpoints.parent)
    assert [(it, p.name) for it, p, _ in found] == [(2, "iter_000002")]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["iter_000002"]  # stale directories cleaned
    verify_dir(found[0][1])
    assert load_es_state(found[0][1])["optimizer"]["t"] == 3


# -- GRPO --------------------------------------------------------------------------------------------------------


@pytest.fixture()
def grpo_checkpoint(tiny_model_dir, tmp_path):
    from es_ray.grpo.config import to_grpo_config
    from es_ray.grpo.learner import GRPOLearner

    def make():
        return GRPOLearner(
            to_grpo_config(
                {
                    "model": {"path": str(tiny_model_dir)},
                    "engine": {"threads": 1},
                    "grpo": {"lr": 1e-2, "micro_batch_size": 2},
                }
            )
        )

    lrn = make()
    samples = [{"prompt_ids": [1, 2, 3], "completion_ids": [10 + i, 20, 30]} for i in range(2)]
    lrn.train_step(samples, [1.0, -1.0])
    path = tmp_path / "checkpoints" / "step_000001"
    lrn.save(str(path), {"step": 1})
    return make, lrn, path


def test_grpo_checkpoint_round_trip_with_weights_only(grpo_checkpoint):
    make, lrn, path = grpo_checkpoint
    fresh = make()
    assert fresh.load(str(path))["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(fresh.weights().values(), lrn.weights().values()))
    assert fresh.optimizer.state_dict()["state"].keys() == lrn.optimizer.state_dict()["state"].keys()


@pytest.mark.parametrize("name", ["model.safetensors", "grpo_state.pt"])
def test_grpo_checkpoint_with_flipped_bytes_is_refused_naming_the_file(grpo_checkpoint, name):
    make, _, path = grpo_checkpoint
    for k in range(16):  # the review's 16 flipped bytes
        flip_byte(path / name, offset=(path / name).stat().st_size // 2 + 7 * k)
    with pytest.raises(CheckpointError, match=rf"{path / name}: sha256 .*corrupted"):
        make().load(str(path))


def test_grpo_state_with_a_planted_pickle_is_refused_and_never_runs(grpo_checkpoint, tmp_path):
    make, _, path = grpo_checkpoint
    marker = tmp_path / "pwned"
    plant(path, "grpo_state.pt", marker)
    with pytest.raises(CheckpointError, match=r"grpo_state\.pt: refused by torch\.load\(weights_only=True\)"):
        make().load(str(path))
    assert not marker.exists()


def test_grpo_driver_lists_only_published_checkpoints(grpo_checkpoint):
    from es_ray.grpo.driver import last_checkpoint

    _, _, path = grpo_checkpoint
    stale = staging_dir(path.parent / "step_000002")
    (stale / "grpo_meta.json").write_text(json.dumps({"step": 2}))
    assert last_checkpoint(path.parents[1]) == path and not stale.exists()


# -- the seed log --------------------------------------------------------------------------------------------------


def _log(tmp_path, n=4) -> Path:
    log = SeedLog(tmp_path / "seed_log.jsonl")
    for t in range(n):
        log.append({"iteration": t, "sigma": 0.02, "members": [[0, 0, 1]], "fitness": [0.25 * t - 0.1]})
    log.close()
    return tmp_path / "seed_log.jsonl"


@pytest.mark.parametrize(
    "edit",
    [
        lambda line: line.replace(b"0.15", b"0.25"),  # valid JSON, another number: only the digest sees it
        lambda line: line[:10] + b"\xff" + line[11:],  # not JSON any more
    ],
)
def test_a_corrupt_record_in_the_middle_is_refused_with_its_line_number(tmp_path, edit):
    path = _log(tmp_path)
    lines = path.read_bytes().split(b"\n")
    assert b"0.15" in lines[1]
    lines[1] = edit(lines[1])
    path.write_bytes(b"\n".join(lines))
    size = path.stat().st_size
    with pytest.raises(ValueError, match=r"line 2 is corrupted.*keep lines 1-1"):
        SeedLog.recover(path)
    assert path.stat().st_size == size  # nothing cut


def test_only_a_torn_last_line_is_cut(tmp_path):
    path = _log(tmp_path)
    whole = path.read_bytes()
    with open(path, "ab") as f:
        f.write(b'{"iteration": 4, "sig')
    assert [r["iteration"] for r in SeedLog.recover(path)] == [0, 1, 2, 3]
    assert path.read_bytes() == whole
    lines = whole.split(b"\n")
    path.write_bytes(b"\n".join(lines[:3]) + b"\n" + lines[3].replace(b"0.65", b"0.75") + b"\n")
    with pytest.raises(ValueError, match="line 4 is corrupted"):  # a complete last line is not torn
        SeedLog.recover(path)


# -- host memory planned for checkpoints -------------------------------------------------------------------------


def test_kuberay_worker_memory_covers_the_es_host_plan_at_7b():
    """The RayJob's GPU workers ask for the host RAM one ES actor plans at the largest preset (7B): the processes
    and 2.5 x the largest tensor, checkpoints being written and read tensor by tensor at any optimizer; and not
    for the whole state gathered into the actor, which no path does any more."""
    import re

    sys.path.insert(0, str(REPO / "benchmarks"))
    from host_memory import ENGINE_PROCESS_GIB, es_actor_host_plan_gib

    from es_ray.memory_plan import preset

    text = (REPO / "launch" / "kuberay" / "rayjob.yaml").read_text()
    worker = text[text.index("workerGroupSpecs") :]
    asked = [int(x) for x in re.findall(r"memory: (\d+)Gi", worker)]
    plan = es_actor_host_plan_gib("qwen2.5-7b")
    master_gib = 4 * preset("qwen2.5-7b").parameters() / (1 << 30)
    assert ENGINE_PROCESS_GIB < plan < ENGINE_PROCESS_GIB + master_gib / 4  # streamed: far below one master
    assert asked and plan <= min(asked) and max(asked) <= plan + 8, (
        f"worker memory {asked} Gi out of step with the plan's {plan:.1f} GiB"
    )
    assert f"{plan:.1f} GiB" in worker  # the comment beside it states the plan's figure


def test_a_checkpoint_given_as_model_path_is_verified(es_checkpoint):
    """es-eval, es-compare and a run starting from another run's checkpoint resolve it through resolve_model."""
    from es_ray.models import resolve_model

    assert resolve_model(str(es_checkpoint)) == es_checkpoint.resolve()
    flip_byte(es_checkpoint / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: sha256"):
        resolve_model(str(es_checkpoint))


def test_a_staged_directory_moved_into_a_checkpoint_is_published_at_the_umasks_mode(tmp_path):
    """A sharded GRPO learner stages its moments in a directory of their own (``staging_dir``, mkdtemp's 0700) and
    moves it into the checkpoint as ``shards/``: it is published at what mkdir gives too, or another user's process
    could list the checkpoint but not open the optimizer state it resumes from."""
    import shutil

    old = os.umask(0o022)
    try:
        shards = staging_dir(tmp_path / "final-shards")  # as GRPOLearner.save stages them, beside the checkpoint
        (shards / "moments-0-of-1.safetensors").write_bytes(b"x")
        tmp = staging_dir(tmp_path / "final")
        shutil.move(shards, tmp / "shards")  # save_checkpoint's ``extra``
        final = publish_dir(tmp, tmp_path / "final")
    finally:
        os.umask(old)
    assert (final / "shards").stat().st_mode & 0o777 == 0o755


def test_the_umask_is_read_without_changing_it_where_proc_does_not_say_it(monkeypatch):
    """Without /proc/self/status's Umask line (not Linux, an old kernel, no /proc) the umask is still read without
    setting it: os.umask is process-wide, and a thread creating a file meanwhile would get the wrong mode."""
    from es_ray.core import manifest

    real = Path.read_text
    monkeypatch.setattr(
        Path,
        "read_text",
        lambda self, *a, **k: (
            (_ for _ in ()).throw(OSError("no /proc")) if str(self) == "/proc/self/status" else real(self, *a, **k)
        ),
    )
    set_to = []
    umask = os.umask
    monkeypatch.setattr(os, "umask", lambda mask: set_to.append(mask) or umask(mask))
    old = umask(0o027)
    try:
        assert manifest.umask() == 0o027
    finally:
        umask(old)
    assert set_to == []
