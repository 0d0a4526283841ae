"""Batches that mix LoRA adapters: one forward of the base for every row, each row's own adapter added on top.

Multi-LoRA servers (vLLM's punica kernels, S-LoRA) serve requests of many adapters in one batch: the base model's
matmuls, which cost nearly all of a forward, run once over all rows, and each adapter's two thin matmuls (r columns)
run over its own rows only. `MixedLora` does that for the PEFT adapters a `TorchEngine` attaches (`torch_lora`): the
model runs with no adapter active (every LoRA layer computes its base alone), and a forward hook on each LoRA linear
layer adds `B(A(x)) * scaling` of each adapter to the slice of rows that run it. A batch's rows are grouped by adapter
(`order`), so each adapter's rows are one contiguous slice: no gather, no copy. What a row computes equals what it
computes in a batch of its adapter alone, up to the rounding that any change of batch composition brings.

Only plain LoRA on linear layers is mixed (no DoRA, no embedding or convolution adapters): `mixable` says whether an
adapter qualifies, and the engine runs the others one adapter per batch as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch


def order(adapters: Sequence[str | None]) -> list[int]:
    """Row indices grouped by adapter (the base first, then adapters by name), each group in its rows' order."""
    return sorted(range(len(adapters)), key=lambda i: (adapters[i] is not None, adapters[i] or ""))


def runs(slots: Sequence[str | None]) -> list[tuple[str, int, int]]:
    """(slot, start, end) of each maximal run of equal slots; rows of the base (None) are left out."""
    out: list[tuple[str, int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[start]:
            if slots[start] is not None:
                out.append((slots[start], start, i))
            start = i
    return out


class MixedLora:
    """The forward hooks that add each row's adapter to `model`'s LoRA linear layers (module docstring). `segments`
    (set before each forward: `set_rows`) says which slice of the batch's rows runs which PEFT slot."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self.segments: list[tuple[str, int, int]] = []

    def mixable(self, slot: str) -> bool:
        """Whether every layer that holds PEFT slot `slot` is a plain LoRA linear layer (module docstring)."""
        from peft.tuners.lora.layer import Linear, LoraLayer

        for m in self._model.modules():
            if not isinstance(m, LoraLayer):
                continue
            holds = slot in m.lora_A or slot in getattr(m, "lora_embedding_A", {})
            if holds and (not isinstance(m, Linear) or slot in getattr(m, "lora_variant", {})
                          or m.use_dora.get(slot, False)):
                return False
        return True

    def set_rows(self, slots: Sequence[str | None]) -> None:
        """The PEFT slot of each row of the next forward's input (None: the base alone), grouped (`order`)."""
        self.segments = runs(slots)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The hooks on every LoRA linear layer for the duration of one batch."""
        from peft.tuners.lora.layer import Linear

        handles = [m.register_forward_hook(self._hook) for m in self._model.modules() if isinstance(m, Linear)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            self.segments = []

    def _hook(self, module: Any, args: tuple, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        for slot, start, end in self.segments:
            if slot not in module.lora_A:  # this layer is not targeted by that adapter
                continue
            a, rows = module.lora_A[slot], x[start:end]
            output[start:end] += module.lora_B[slot](a(rows.to(a.weight.dtype))).to(output.dtype) * module.scaling[slot]
        return output
