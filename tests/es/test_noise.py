"""Noise identity (docs/design.md "ES, precisely" 1): a pure function of (run seed, iteration, noise id, tensor
name)."""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from es_ray.noise import (
    NOISE_KINDS,
    PORTABLE_KINDS,
    NoiseSource,
    _tables_cpu,
    counter_noise,
    derive_seed,
    philox4x32,
    resolve_kind,
    table_seed,
)

SHAPE = torch.Size([64, 48])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(np.corrcoef(a.reshape(-1).double().numpy(), b.reshape(-1).double().numpy())[0, 1])


# -- seeds ------------------------------------------------------------------------------------------------


def test_derive_seed_is_deterministic_and_63_bit():
    seeds = [
        derive_seed(s, t, i, n)
        for s in (0, 1, 2**40)
        for t in (-1, 0, 7)
        for i in (0, 3)
        for n in ("a", "model.layers.0.mlp.up_proj.weight")
    ]
    assert seeds == [
        derive_seed(s, t, i, n)
        for s in (0, 1, 2**40)
        for t in (-1, 0, 7)
        for i in (0, 3)
        for n in ("a", "model.layers.0.mlp.up_proj.weight")
    ]
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds)
    assert len(set(seeds)) == len(seeds)  # every tuple differs, so every seed does
    assert table_seed(5) == derive_seed(5, -1, -1, "__noise_table__")


def test_derive_seed_each_component_matters():
    base = derive_seed(0, 1, 2, "w")
    assert derive_seed(1, 1, 2, "w") != base
    assert derive_seed(0, 2, 2, "w") != base
    assert derive_seed(0, 1, 3, "w") != base
    assert derive_seed(0, 1, 2, "w2") != base
    # components are not simply summed or concatenated ambiguously
    assert derive_seed(0, 1, 2, "w") != derive_seed(0, 2, 1, "w")
    assert derive_seed(0, 12, 3, "w") != derive_seed(0, 1, 23, "w")


# -- per_tensor -------------------------------------------------------------------------------------------


def test_per_tensor_same_tuple_gives_identical_bits():
    a = NoiseSource(11).noise(3, 5, "layer.w", SHAPE)
    b = NoiseSource(11).noise(3, 5, "layer.w", SHAPE)
    assert a.dtype == torch.float32 and a.shape == SHAPE
    assert torch.equal(_bits(a), _bits(b))
    # the same source asked again (after other draws) still reproduces it
    src = NoiseSource(11)
    src.noise(0, 0, "other", torch.Size([17]))
    assert torch.equal(_bits(src.noise(3, 5, "layer.w", SHAPE)), _bits(a))


def test_per_tensor_out_buffer_gives_the_same_values():
    src = NoiseSource(4)
    fresh = src.noise(2, 1, "w", SHAPE)
    flat = torch.full((SHAPE.numel() + 10,), float("nan"))
    view = flat[: SHAPE.numel()].view(SHAPE)
    got = src.noise(2, 1, "w", SHAPE, out=view)
    assert torch.equal(got, fresh)
    assert torch.equal(view, fresh)  # written in place
    assert torch.isnan(flat[SHAPE.numel() :]).all()  # nothing written past the view


@pytest.mark.parametrize("change", ["run_seed", "iteration", "noise_id", "name"])
def test_per_tensor_different_tuple_gives_independent_noise(change):
    args = {"run_seed": 1, "iteration": 2, "noise_id": 3, "name": "model.layers.0.self_attn.q_proj.weight"}
    other = dict(args)
    other[change] = "model.layers.0.self_attn.k_proj.weight" if change == "name" else args[change] + 1
    a = NoiseSource(args["run_seed"]).noise(args["iteration"], args["noise_id"], args["name"], SHAPE)
    b = NoiseSource(other["run_seed"]).noise(other["iteration"], other["noise_id"], other["name"], SHAPE)
    assert not torch.equal(a, b)
    assert (a == b).float().mean() < 0.01
    assert abs(_corr(a, b)) < 0.06  # 3072 values: std of a null correlation ~0.018


def test_equal_shaped_tensors_get_different_noise():
    """The reference's issue #46: equal-shaped tensors must not share noise."""
    src = NoiseSource(0)
    q = src.noise(0, 0, "model.layers.0.self_attn.q_proj.weight", SHAPE)
    o = src.noise(0, 0, "model.layers.0.self_attn.o_proj.weight", SHAPE)
    assert q.shape == o.shape
    assert not torch.equal(q, o)
    assert abs(_corr(q, o)) < 0.06


def test_per_tensor_noise_is_standard_normal():
    x = NoiseSource(123).noise(0, 0, "big", torch.Size([1000, 1000])).double()
    assert abs(float(x.mean())) < 0.005  # std error 0.001
    assert abs(float(x.std()) - 1.0) < 0.005
    assert 0.30 < float((x.abs() > 1.0).double().mean()) < 0.335  # P(|N(0,1)|>1) = 0.3173


def test_unknown_noise_kind_is_refused():
    with pytest.raises(ValueError, match="per_tensor, table, counter"):
        NoiseSource(0, kind="gaussian")


# -- table ------------------------------------------------------------------------------------------------


def test_table_slice_is_deterministic_and_located_by_the_seed():
    size = 5000
    a = NoiseSource(9, kind="table", table_size=size)
    b = NoiseSource(9, kind="table", table_size=size)
    assert a.table is not None and a.table.numel() == size
    assert torch.equal(a.table, b.table)
    shape = torch.Size([12, 10])
    x = a.noise(4, 2, "w", shape)
    y = b.noise(4, 2, "w", shape)
    assert x.shape == shape and x.dtype == torch.float32
    assert torch.equal(x, y)
    start = derive_seed(9, 4, 2, "w") % (size - shape.numel() + 1)
    assert torch.equal(x.reshape(-1), a.table[start : start + shape.numel()])
    # another name or member lands elsewhere
    assert not torch.equal(x, a.noise(4, 2, "w2", shape))
    assert not torch.equal(x, a.noise(4, 3, "w", shape))
    # another run seed draws another table
    assert not torch.equal(a.table, NoiseSource(10, kind="table", table_size=size).table)


def test_table_exactly_the_tensor_size_uses_the_whole_table():
    src = NoiseSource(1, kind="table", table_size=120)
    assert torch.equal(src.noise(0, 0, "w", torch.Size([10, 12])).reshape(-1), src.table)


def test_table_smaller_than_tensor_raises_naming_the_setting():
    src = NoiseSource(1, kind="table", table_size=100)
    with pytest.raises(ValueError, match="es.noise_table_size") as info:
        src.noise(0, 0, "model.embed_tokens.weight", torch.Size([10, 11]))
    assert "model.embed_tokens.weight" in str(info.value)


def test_table_noise_is_standard_normal():
    src = NoiseSource(77, kind="table", table_size=1 << 20)
    t = src.table.double()
    assert abs(float(t.mean())) < 0.005
    assert abs(float(t.std()) - 1.0) < 0.005


# -- counter ----------------------------------------------------------------------------------------------
# A pure-Python reference of the same integer function (Random123's Philox-4x32-10 with the plain 64-bit product,
# tables from the math module rounded to fp32, numpy's fp32 multiply): a new device is checked against it.

_M32 = (1 << 32) - 1
PHILOX_KAT = [  # Random123 kat_vectors: counter, key, expected
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((_M32,) * 4, (_M32,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]
TABLES_DIGEST = "9b8c30f2fd95398c"
"""blake2b-8 of the counter's radius, cos and sin tables: a host whose tables differ draws other noise."""


def _philox_ref(ctr, key, rounds=10):
    (c0, c1, c2, c3), (k0, k1) = ctr, key
    for _ in range(rounds):
        prod0, prod1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (prod1 >> 32) ^ c1 ^ k0, prod1 & _M32, (prod0 >> 32) ^ c3 ^ k1, prod0 & _M32
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    return c0, c1, c2, c3


def _counter_ref(seed: int, e: int) -> np.float32:
    j = e // 8
    word = _philox_ref((j & _M32, j >> 32, 0, 0), (seed & _M32, seed >> 32))[e % 8 // 2]
    i, a = word >> 13, word & 8191
    r = np.float32(math.sqrt(-2 * math.log((i + 0.5) / 2**19)))
    angle = 2 * math.pi * (a + 0.5) / 8192
    return r * np.float32(math.cos(angle) if e % 2 == 0 else math.sin(angle))


def _digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.cpu().contiguous().numpy().tobytes(), digest_size=8).hexdigest()


@pytest.mark.parametrize("ctr,key,want", PHILOX_KAT)
def test_philox_matches_the_random123_known_answers(ctr, key, want):
    assert _philox_ref(ctr, key) == want
    assert philox4x32(*ctr, *key) == want  # on Python ints
    words = philox4x32(*(torch.tensor([c, 0], dtype=torch.int64) for c in ctr), *key)  # on int64 tensors
    assert [int(w[0]) for w in words] == list(want)


def test_counter_equals_the_python_reference():
    seed = derive_seed(3, 1, 4, "model.layers.0.mlp.up_proj.weight")
    got = counter_noise(seed, 0, torch.empty(300))
    want = np.array([_counter_ref(seed, e) for e in range(300)], dtype=np.float32)
    assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32))
    # beyond 2^35 elements the block index needs Philox's second counter word
    start = (1 << 35) - 13
    got = counter_noise(seed, start, torch.empty(29))
    want = np.array([_counter_ref(seed, start + e) for e in range(29)], dtype=np.float32)
    assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32))


def test_counter_tables_are_pinned():
    radius, cos, sin = _tables_cpu()
    h = hashlib.blake2b(digest_size=8)
    for t in (radius, cos, sin):
        h.update(t.numpy().tobytes())
    assert h.hexdigest() == TABLES_DIGEST


def test_counter_is_deterministic_and_independent_of_chunks_and_threads():
    src = NoiseSource(5, kind="counter")
    shape = torch.Size([41, 73])  # 2993 elements: not a multiple of the 8-element Philox block
    a = src.noise(2, 1, "w", shape)
    assert a.dtype == torch.float32 and a.shape == shape
    assert torch.equal(_bits(a), _bits(NoiseSource(5, kind="counter").noise(2, 1, "w", shape)))
    for chunk in (7, 8, 1000, 1 << 22):
        assert torch.equal(_bits(NoiseSource(5, kind="counter", chunk=chunk).noise(2, 1, "w", shape)), _bits(a))
    threads = torch.get_num_threads()
    big = torch.Size([300, 1000])  # ops over torch's parallel grain with a large chunk
    try:
        torch.set_num_threads(1)
        one = NoiseSource(5, kind="counter", chunk=1 << 20).noise(0, 0, "w", big)
        torch.set_num_threads(2)
        two = NoiseSource(5, kind="counter", chunk=1 << 20).noise(0, 0, "w", big)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(_bits(one), _bits(two))
    assert torch.equal(_bits(one), _bits(NoiseSource(5, kind="counter").noise(0, 0, "w", big)))


def test_counter_out_buffer_gives_the_same_values():
    src = NoiseSource(4, kind="counter")
    flat = torch.full((SHAPE.numel() + 10,), float("nan"))
    got = src.noise(2, 1, "w", SHAPE, out=flat[: SHAPE.numel()].view(SHAPE))
    assert torch.equal(got, src.noise(2, 1, "w", SHAPE))
    assert torch.isnan(flat[SHAPE.numel() :]).all()


def test_counter_is_the_same_under_another_cpu_capability():
    """ATen's CPU kernels differ by capability (torch.randn does: DEFAULT draws other numbers than AVX2), the
    counter must not: this process (its native capability) against a subprocess held to DEFAULT."""
    code = (
        "import hashlib, torch; from es_ray.noise import counter_noise; "
        "x = counter_noise(123456789, 17, torch.empty(100003)); "
        "print(torch.backends.cpu.get_cpu_capability(), "
        "hashlib.blake2b(x.numpy().tobytes(), digest_size=8).hexdigest())"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["DEFAULT", _digest(counter_noise(123456789, 17, torch.empty(100003)))]


def test_counter_noise_is_standard_normal():
    x = NoiseSource(123, kind="counter").noise(0, 0, "big", torch.Size([1024, 1024])).double().reshape(-1)
    assert abs(float(x.mean())) < 0.005  # std error 0.001
    assert abs(float(x.std()) - 1.0) < 0.005
    assert 0.30 < float((x.abs() > 1.0).double().mean()) < 0.335  # P(|N(0,1)|>1) = 0.3173
    # Kolmogorov-Smirnov distance of the sorted sample from the normal CDF (1% critical value 1.63/sqrt(n) = 0.0016)
    ranks = (torch.arange(x.numel(), dtype=torch.float64) + 0.5) / x.numel()
    assert float((torch.special.ndtr(x.sort().values) - ranks).abs().max()) < 0.0016
    assert float(x.abs().max()) < 5.27  # the tails are cut at 5.27 (P = 1.4e-7 for a true normal)


def test_counter_elements_and_streams_are_uncorrelated():
    src = NoiseSource(8, kind="counter")
    x = src.noise(0, 0, "model.layers.0.self_attn.q_proj.weight", torch.Size([1 << 20])).double()
    for lag in (1, 2, 7, 8, 9):  # within a Box-Muller pair (lag 1), across words (2), across Philox blocks (8)
        assert abs(_corr(x[:-lag], x[lag:])) < 0.005  # null std 0.001
    assert abs(_corr(x[0::2], x[1::2])) < 0.005  # the two halves of each pair
    assert abs(_corr(x[0::2] ** 2, x[1::2] ** 2)) < 0.01  # independent, not only uncorrelated
    for other in (
        src.noise(0, 0, "model.layers.0.self_attn.k_proj.weight", x.shape),  # another tensor
        src.noise(0, 1, "model.layers.0.self_attn.q_proj.weight", x.shape),  # another member
        src.noise(1, 0, "model.layers.0.self_attn.q_proj.weight", x.shape),
    ):  # another iteration
        assert abs(_corr(x, other.double())) < 0.005
        assert float((x == other.double()).double().mean()) < 1e-3


@pytest.mark.parametrize("kind", ["counter", "table", "per_tensor"])
def test_noise_slices_concatenate_to_the_whole_tensor(kind):
    src = NoiseSource(6, kind=kind, table_size=1 << 14)
    for shape in (torch.Size([37, 13]), torch.Size([9, 4, 5]), torch.Size([50])):
        whole = src.noise(3, 2, "w", shape)
        cuts = sorted([0, 1, 5, shape[0] // 2, shape[0]])  # an empty slice among them
        parts = [src.noise_slice(3, 2, "w", shape, slice(a, b)) for a, b in zip(cuts, cuts[1:])]
        assert [p.shape[0] for p in parts] == [b - a for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(_bits(torch.cat(parts)), _bits(whole))
    out = torch.full((3, 13), float("nan"))
    got = src.noise_slice(3, 2, "w", torch.Size([37, 13]), slice(30, 33), out=out if kind != "table" else None)
    assert torch.equal(got, src.noise(3, 2, "w", torch.Size([37, 13]))[30:33])
    with pytest.raises(ValueError, match="step 1"):
        src.noise_slice(3, 2, "w", torch.Size([37, 13]), slice(0, 10, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_counter_is_bit_equal_on_cpu_and_cuda():
    for kind_chunk in (None, 7, 1 << 16):
        for shape in (torch.Size([1000, 37]), torch.Size([5]), torch.Size([3, 4, 1025])):
            cpu = NoiseSource(11, kind="counter", chunk=kind_chunk).noise(4, 2, "w", shape)
            gpu = NoiseSource(11, kind="counter", chunk=kind_chunk, device="cuda").noise(4, 2, "w", shape)
            assert torch.equal(_bits(gpu.cpu()), _bits(cpu))
    src = NoiseSource(11, kind="counter", device="cuda")
    part = src.noise_slice(4, 2, "w", torch.Size([1000, 37]), slice(100, 300))
    assert torch.equal(_bits(part.cpu()), _bits(NoiseSource(11, kind="counter").noise(4, 2, "w", (1000, 37))[100:300]))
    assert np.array_equal(
        counter_noise(77, 5, torch.empty(64, device="cuda")).cpu().numpy().view(np.int32),
        np.array([_counter_ref(77, 5 + e) for e in range(64)], dtype=np.float32).view(np.int32),
    )


# -- auto, and the driver's device check --------------------------------------------------------------------


def test_auto_resolves_per_device_and_explicit_kinds_stay():
    assert resolve_kind("auto", "cpu") == "table"
    assert resolve_kind("auto", "cuda") == "per_tensor"
    for kind in NOISE_KINDS.names():
        assert resolve_kind(kind, "cuda") == kind and resolve_kind(kind, "cpu") == kind
    assert "counter" in PORTABLE_KINDS and "per_tensor" not in PORTABLE_KINDS


def _infos(noise: str, *devices: tuple[str, int]) -> list[dict]:
    return [{"device": name, "sm_count": sm, "noise": noise} for name, sm in devices]


def test_driver_refuses_device_dependent_noise_on_mixed_gpus():
    from es_ray.es.config import ESTrainConfig
    from es_ray.core.config import ConfigError
    from es_ray.es.driver import check_noise_devices

    cfg = ESTrainConfig()
    h100, a100, mig = ("NVIDIA H100 80GB HBM3", 132), ("NVIDIA A100-SXM4-80GB", 108), ("NVIDIA A100 MIG 3g.40gb", 42)
    for kind in ("per_tensor", "table"):
        with pytest.raises(ConfigError, match="es.noise=counter") as info:
            check_noise_devices(cfg, _infos(kind, h100, a100, h100))
        assert "NVIDIA H100 80GB HBM3 (132 SMs)" in str(info.value)
        assert "NVIDIA A100-SXM4-80GB (108 SMs)" in str(info.value)
    with pytest.raises(ConfigError, match="A100 MIG 3g.40gb"):
        check_noise_devices(cfg, _infos("per_tensor", a100, mig))
    with pytest.raises(ConfigError, match="cpu"):  # auto: table on the CPU actor, per_tensor on the GPU one
        check_noise_devices(cfg, _infos("table", ("cpu", 0)) + _infos("per_tensor", h100))
    check_noise_devices(cfg, _infos("counter", h100, a100, mig, ("cpu", 0)))  # portable: any mix
    check_noise_devices(cfg, _infos("per_tensor", h100, h100))  # one GPU model
    check_noise_devices(cfg, _infos("table", ("cpu", 0), ("cpu", 0)))


def test_driver_refuses_lowrank_on_mixed_gpus_whatever_the_noise():
    """Low rank's update is one matmul of the factors, whose rounding depends on the device's GEMM kernels: counter
    noise does not make it portable."""
    import dataclasses

    from es_ray.es.config import ESTrainConfig
    from es_ray.core.config import ConfigError
    from es_ray.es.driver import check_noise_devices

    cfg = ESTrainConfig()
    cfg.es = dataclasses.replace(cfg.es, perturbation="lowrank")
    h100, a100 = ("NVIDIA H100 80GB HBM3", 132), ("NVIDIA A100-SXM4-80GB", 108)
    with pytest.raises(ConfigError, match=r"es\.perturbation=lowrank applies its update .* NVIDIA A100-SXM4-80GB"):
        check_noise_devices(cfg, _infos("counter", h100, a100))
    with pytest.raises(ConfigError, match=r"set es\.noise=counter .* and es\.perturbation=full"):
        check_noise_devices(cfg, _infos("per_tensor", h100, a100))
    with pytest.raises(ConfigError, match="es.perturbation=lowrank"):
        check_noise_devices(cfg, _infos("counter", ("cpu", 0), h100))
    check_noise_devices(cfg, _infos("counter", h100, h100))  # one GPU model
    check_noise_devices(cfg, _infos("per_tensor", h100, h100))


@pytest.mark.parametrize("kind", ["per_tensor", "table", "counter"])
def test_reference_scope_gives_equal_shaped_tensors_the_same_noise(kind):
    """The reference implementation's noise (es.noise_scope=reference): one seed for every tensor of a member, so
    equal shapes share noise; the default gives every tensor its own stream."""
    from es_ray.noise import NoiseSource

    shape = torch.Size([4, 8])
    ref = NoiseSource(3, kind, table_size=1 << 12, scope="reference")
    own = NoiseSource(3, kind, table_size=1 << 12)
    q, k = ref.noise(0, 1, "q_proj.weight", shape).clone(), ref.noise(0, 1, "k_proj.weight", shape).clone()
    assert torch.equal(q, k)
    assert not torch.equal(ref.noise(0, 2, "q_proj.weight", shape), q)  # members still differ
    assert not torch.equal(own.noise(0, 1, "q_proj.weight", shape).clone(), own.noise(0, 1, "k_proj.weight", shape))
    torch.testing.assert_close(ref.noise_slice(0, 1, "v_proj.weight", shape, slice(1, 3)), q[1:3], rtol=0, atol=0)


# -- compiled counter noise (torch.compile: C++ on a CPU, Triton on a GPU) ----------------------------------------


def test_compiled_counter_noise_equals_the_eager_reference_bit_for_bit(monkeypatch):
    """ES_RAY_NOISE_COMPILE=1 on the CPU: the default step runs ``counter_block`` compiled (one compile per process);
    every run, at odd offsets, across chunk seams and past 2^32 blocks, equals the eager reference (an explicit chunk
    runs eager) bit for bit."""
    from es_ray import noise

    monkeypatch.setenv(noise.COMPILE_ENV, "1")
    monkeypatch.setattr(noise, "_COMPILED", {})
    monkeypatch.setattr(noise, "_COMPILE_FAILED", {})
    device, step = torch.device("cpu"), noise.counter_chunk(torch.device("cpu"))
    cases = [(12345, 0, 3 * step), (2**63 - 25, 3, 2 * step + 5), (7, 8 * 2**32 - 13, step + 999), (1, 77, step // 7)]
    for seed, start, numel in cases:
        compiled = noise.counter_noise(seed, start, torch.empty(numel))
        eager = noise.counter_noise(seed, start, torch.empty(numel), chunk=step)
        assert torch.equal(compiled.view(torch.int32), eager.view(torch.int32)), (seed, start, numel)
    if noise._COMPILE_FAILED:
        pytest.skip(f"torch.compile is not usable here: {noise._COMPILE_FAILED}")
    assert list(noise._COMPILED) == [(str(device), (step + 7) // 8 + 1)]  # compiled once, and used


def test_counter_noise_falls_back_to_eager_when_compiling_fails(monkeypatch, caplog):
    from es_ray import noise

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setenv(noise.COMPILE_ENV, "1")
    monkeypatch.setattr(noise, "_COMPILED", {})
    monkeypatch.setattr(noise, "_COMPILE_FAILED", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: broken)
    step = noise.counter_chunk(torch.device("cpu"))
    with caplog.at_level("WARNING", logger="es_ray.noise"):
        got = noise.counter_noise(5, 11, torch.empty(step + 3))
    assert torch.equal(got, noise.counter_noise(5, 11, torch.empty(step + 3), chunk=step))
    assert noise._COMPILE_FAILED == {"cpu": "RuntimeError: no C++ compiler found"}
    assert "counter noise on cpu runs eager: torch.compile failed (RuntimeError: no C++ compiler found)" in caplog.text
    monkeypatch.setenv(noise.COMPILE_ENV, "auto")
    assert noise.compiled_block(torch.device("cpu"), 9) is None  # auto: CUDA only


def test_the_memory_plan_reads_the_same_behaviour_the_sources_have():
    """NOISE_MEMORY's lines (the memory plan) and NOISE_DRAWS's sources (the replica's buffers and row draws) agree
    for every es.noise source: a table needs no noise buffer, only per_tensor draws a tensor whole for a part."""
    from es_ray.noise import NOISE_DRAWS, NOISE_KINDS, NOISE_MEMORY

    for kind in NOISE_KINDS:
        draw, memory = NOISE_DRAWS.get(kind), NOISE_MEMORY.get(kind)
        assert (draw.views, draw.whole_tensor) == (memory.table, memory.whole_tensor), kind
        src = NoiseSource(0, kind, table_size=64)
        assert (src.views, src.whole_tensor) == (draw.views, draw.whole_tensor)
        assert (src.table is not None) == draw.views
