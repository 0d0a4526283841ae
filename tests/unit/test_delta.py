"""Sparse weight deltas: bit-exact round trips in fp32 and bf16 (signed zeros and NaN payloads included), unchanged
tensors omitted, bad deltas rejected before anything is written."""

from __future__ import annotations

import pytest
import torch

from astratk.weights import SparseDelta, apply_delta, make_delta


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def states(dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """old and new states: `a` changes in a few elements (one +0.0 -> -0.0, one NaN -> a NaN with another payload),
    `b` changes everywhere, `c` does not change."""
    g = torch.Generator().manual_seed(0)
    old = {"a": torch.randn(4, 5, generator=g).to(dtype), "b": torch.randn(3, generator=g).to(dtype),
           "c": torch.randn(2, 2, generator=g).to(dtype)}
    old["a"][0, 0], old["a"][1, 1] = 0.0, float("nan")
    new = {k: v.clone() for k, v in old.items()}
    new["a"][0, 0] = -0.0  # equal as floats, different bits
    other_nan = bits(new["a"])[1, 1] ^ 1  # flip the lowest mantissa bit: still NaN, another payload
    bits(new["a"])[1, 1] = other_nan
    new["a"][3, 4] += 1.0
    new["b"] = new["b"] + 1.0
    assert torch.isnan(new["a"][1, 1]) and not torch.equal(bits(new["a"]), bits(old["a"]))
    return old, new


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(dtype):
    old, new = states(dtype)
    delta = make_delta(old, new, base_version=4, version=5)
    assert (delta.base_version, delta.version) == (4, 5)
    assert set(delta.changes) == {"a", "b"}  # `c` is unchanged, so absent
    idx, values = delta.changes["a"]
    assert idx.tolist() == [0, 6, 19]  # flat positions of [0, 0] (signed zero), [1, 1] (NaN payload), [3, 4]
    assert values.dtype == dtype and idx.dtype == torch.int64
    assert delta.shapes == {"a": (4, 5), "b": (3,)}
    # 3 + 3 int64 indices and values of the dtype's width
    assert delta.nbytes() == 6 * 8 + 6 * torch.finfo(dtype).bits // 8
    assert delta.changed_fraction(20 + 3 + 4) == pytest.approx(6 / 27)

    target = {k: v.clone() for k, v in old.items()}
    assert sorted(apply_delta(target, delta)) == ["a", "b"]
    for name in new:
        assert torch.equal(bits(target[name]), bits(new[name])), name


def test_no_change_gives_an_empty_delta():
    old, _ = states(torch.float32)
    delta = make_delta(old, {k: v.clone() for k, v in old.items()}, base_version=0, version=1)
    assert delta.changes == {} and delta.nbytes() == 0 and "0 elements" in repr(delta)
    assert apply_delta(old, delta) == []


def test_make_delta_rejects_mismatched_states():
    old, new = states(torch.float32)
    with pytest.raises(ValueError, match="only in new"):
        make_delta(old, {**new, "d": torch.zeros(1)}, base_version=0, version=1)
    with pytest.raises(ValueError, match="'b'.*equal shapes"):
        make_delta(old, {**new, "b": torch.zeros(4)}, base_version=0, version=1)
    with pytest.raises(ValueError, match="'b'.*equal shapes and dtypes"):
        make_delta(old, {**new, "b": new["b"].double()}, base_version=0, version=1)


@pytest.mark.parametrize("corrupt", ["unknown name", "shape", "dtype", "index range"])
def test_bad_delta_changes_nothing(corrupt):
    old, new = states(torch.float32)
    delta = make_delta(old, new, base_version=0, version=1)
    changes, shapes = dict(delta.changes), dict(delta.shapes)
    idx, values = changes["b"]  # "a" is applied first (dict order), so a failure on "b" must not leave "a" written
    if corrupt == "unknown name":
        changes["zz"], shapes["zz"] = changes.pop("b"), shapes.pop("b")
    elif corrupt == "shape":
        shapes["b"] = (4,)
    elif corrupt == "dtype":
        changes["b"] = (idx, values.double())
    else:
        changes["b"] = (idx + 1, values)
    bad = SparseDelta(0, 1, changes, shapes)
    target = {k: v.clone() for k, v in old.items()}
    with pytest.raises(ValueError, match="'zz' is not in the state|'b'"):
        apply_delta(target, bad)
    for name in old:
        assert torch.equal(bits(target[name]), bits(old[name])), name


def test_delta_construction_checks_its_own_fields():
    with pytest.raises(ValueError, match="different tensors"):
        SparseDelta(0, 1, {"w": (torch.tensor([0]), torch.tensor([1.0]))}, {})
    with pytest.raises(ValueError, match="int64 indices"):
        SparseDelta(0, 1, {"w": (torch.tensor([0], dtype=torch.int32), torch.tensor([1.0]))}, {"w": (1,)})
