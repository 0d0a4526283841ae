"""Sparse weight deltas: only the elements whose bits changed between two versions (AstraFlow's sparse weight sync).

After one optimiser step most bf16 weights round back to the bits they had, so shipping the changed elements (flat
index + new value) is far smaller than a full state. Elements are compared bit for bit (through an integer view of
the same width), so -0.0 vs 0.0 and NaN payloads count as changes and a round trip is bit-exact in any dtype.

Example:
    >>> import torch
    >>> old = {"w": torch.zeros(4)}
    >>> new = {"w": torch.tensor([0.0, 1.5, 0.0, -0.0])}
    >>> delta = make_delta(old, new, base_version=3, version=4)
    >>> delta.changes["w"][0].tolist(), delta.changes["w"][1].tolist()
    ([1, 3], [1.5, -0.0])
    >>> apply_delta(old, delta), torch.equal(old["w"], new["w"])
    (['w'], True)

Extending: the store (`astratk.weights.store`) decides when to ship a delta or a full snapshot; a consumer applies a
delta only to the state of exactly `base_version` (engines check it in `load_weights`).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import torch

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, eq=False, repr=False)  # eq/repr of tensor dicts are useless (ambiguous bool, huge text)
class SparseDelta:
    """The changed elements of the tensors that changed from `base_version` to `version`.

    Example:
        >>> import torch
        >>> d = SparseDelta(0, 1, {"w": (torch.tensor([2]), torch.tensor([7.0]))}, {"w": (2, 2)})
        >>> d, d.nbytes(), d.changed_fraction(4)
        (SparseDelta(v0 -> v1, 1 tensors, 1 elements, 12 bytes), 12, 0.25)
    """

    base_version: int  # the version the delta applies to
    version: int  # the version it produces
    changes: dict[str, tuple[torch.Tensor, torch.Tensor]]  # name -> (flat indices [n] int64 ascending, new values
    #   [n] in the tensor's dtype); names without a change are absent
    shapes: dict[str, tuple[int, ...]]  # full shape of each changed tensor, checked when applied

    def __post_init__(self) -> None:
        if set(self.changes) != set(self.shapes):
            raise ValueError(f"SparseDelta: changes and shapes name different tensors: "
                             f"{sorted(set(self.changes) ^ set(self.shapes))[:3]}")
        for name, (idx, values) in self.changes.items():
            if idx.dtype != torch.int64 or idx.dim() != 1 or values.shape != idx.shape:
                raise ValueError(f"SparseDelta: {name!r} needs int64 indices [n] and values [n], got "
                                 f"{idx.dtype} {tuple(idx.shape)} and {tuple(values.shape)}")

    def num_changed(self) -> int:
        """Number of elements the delta sets, over all tensors."""
        return sum(idx.numel() for idx, _ in self.changes.values())

    def nbytes(self) -> int:
        """Bytes of indices plus values (what a transfer carries, before any framing)."""
        return sum(i.numel() * i.element_size() + v.numel() * v.element_size() for i, v in self.changes.values())

    def changed_fraction(self, total_elements: int) -> float:
        """Changed elements over `total_elements` (the model's element count: the delta only knows changed tensors)."""
        return self.num_changed() / total_elements if total_elements else 0.0

    def __repr__(self) -> str:
        return (f"SparseDelta(v{self.base_version} -> v{self.version}, {len(self.changes)} tensors, "
                f"{self.num_changed()} elements, {self.nbytes()} bytes)")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The elements of `t` as integers of the same width [numel], for bit-exact comparison."""
    width = t.element_size()
    if width not in _INT_OF_WIDTH or t.is_complex():
        raise ValueError(f"no integer view for dtype {t.dtype} ({width} bytes per element)")
    return t.detach().reshape(-1).view(_INT_OF_WIDTH[width])


def make_delta(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *, base_version: int,
               version: int) -> SparseDelta:
    """The elements of `new` whose bits differ from `old`. Both must name the same tensors with equal shapes and
    dtypes. Indices and values live on `new`'s devices (a transfer moves them)."""
    if set(old) != set(new):
        raise ValueError(f"make_delta: old and new name different tensors: only in old "
                         f"{sorted(set(old) - set(new))[:3]}, only in new {sorted(set(new) - set(old))[:3]}")
    changes, shapes = {}, {}
    for name, n in new.items():
        o = old[name]
        if o.shape != n.shape or o.dtype != n.dtype:
            raise ValueError(f"make_delta: {name!r} is {o.dtype} {tuple(o.shape)} in old but {n.dtype} "
                             f"{tuple(n.shape)} in new; a delta needs equal shapes and dtypes (publish a full state)")
        idx = (_bits(o).to(n.device) != _bits(n)).nonzero().squeeze(1)  # ascending
        if idx.numel():
            changes[name] = (idx, n.detach().reshape(-1)[idx])  # advanced indexing copies
            shapes[name] = tuple(n.shape)
    return SparseDelta(base_version, version, changes, shapes)


def apply_delta(state: MutableMapping[str, torch.Tensor], delta: SparseDelta) -> list[str]:
    """Write `delta`'s values into `state`'s tensors in place; returns the names changed. Every name, shape, dtype
    and index range is checked before the first write, so a bad delta changes nothing. Aliased tensors (tied
    weights under two names) are fine: both entries write the same values."""
    for name, (idx, values) in delta.changes.items():
        if name not in state:
            raise ValueError(f"apply_delta: {name!r} is not in the state (which has names like "
                             f"{sorted(state)[:3]}); the delta was made for another model")
        t = state[name]
        if tuple(t.shape) != delta.shapes[name] or t.dtype != values.dtype:
            raise ValueError(f"apply_delta: {name!r} is {t.dtype} {tuple(t.shape)} in the state but "
                             f"{values.dtype} {delta.shapes[name]} in the delta")
        if not t.is_contiguous():
            raise ValueError(f"apply_delta: {name!r} is not contiguous, so it cannot be updated in place")
        if idx.numel() and not 0 <= int(idx.min()) <= int(idx.max()) < t.numel():
            raise ValueError(f"apply_delta: {name!r} has indices outside [0, {t.numel()})")
    with torch.no_grad():  # parameters that require grad may be written in place here
        for name, (idx, values) in delta.changes.items():
            t = state[name]
            t.view(-1)[idx.to(t.device)] = values.to(t.device)
    return list(delta.changes)
