"""Noise identity (DESIGN "ES, precisely" 1): a pure function of (run seed, iteration, noise id, tensor name)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from es_ray.noise import NoiseSource, derive_seed, table_seed

SHAPE = torch.Size([64, 48])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(np.corrcoef(a.reshape(-1).double().numpy(), b.reshape(-1).double().numpy())[0, 1])


# -- seeds ------------------------------------------------------------------------------------------------


def test_derive_seed_is_deterministic_and_63_bit():
    seeds = [derive_seed(s, t, i, n) for s in (0, 1, 2**40) for t in (-1, 0, 7) for i in (0, 3)
             for n in ("a", "model.layers.0.mlp.up_proj.weight")]
    assert seeds == [derive_seed(s, t, i, n) for s in (0, 1, 2**40) for t in (-1, 0, 7) for i in (0, 3)
                     for n in ("a", "model.layers.0.mlp.up_proj.weight")]
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
    assert torch.isnan(flat[SHAPE.numel():]).all()  # nothing written past the view


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
    with pytest.raises(ValueError, match="per_tensor"):
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
