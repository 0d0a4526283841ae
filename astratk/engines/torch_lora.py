"""The LoRA adapters a `TorchEngine` serves: PEFT adapters attached to its one copy of the base model.

`EngineAdapters` attaches an adapter under a slot of its own (`add`), finds one by name (`get`) and makes the model
apply a batch's adapter (`activate`), all under the engine's weights lock. The engine's batcher runs one adapter's
rows per batch (or mixes adapters' rows: `torch_lora_mix`) and its `load_weights` moves an adapter's tensors; a new per-adapter setting belongs on `_Adapter`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from astratk.engines.torch_lora_mix import MixedLora
from astratk.engines.torch_weights import check_state

_UNKNOWN = object()  # `active` after PEFT changed adapters itself: the next batch sets its own


@dataclass(eq=False)
class _Adapter:
    """One LoRA adapter of the engine: its PEFT slot name, its live tensors by saved name, its version."""

    slot: str
    tensors: dict[str, torch.Tensor]
    version: int
    mixable: bool = True  # plain LoRA on linear layers: its rows may share a batch with other adapters'


class EngineAdapters:
    """The adapters attached to `model`, by the user's name, and the one the model applies now."""

    def __init__(self, model: torch.nn.Module, params: Mapping[str, torch.Tensor], lock: threading.Lock) -> None:
        self._model, self._params, self._lock = model, params, lock
        self.slots: dict[str, _Adapter] = {}
        self.active: str | None | object = None  # the adapter the model applies now (None: the base alone)

    def __bool__(self) -> bool:
        return bool(self.slots)

    def add(self, name: str, lora: Any, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Attach adapter `name` (`lora`: its `LoraSpec`) with tensors `state` (by saved PEFT name, as the trainer
        publishes them) at `version`. Waits for the batch in flight."""
        from astratk.models.lora import inject_adapter, remove_adapter

        if name in self.slots:
            raise ValueError(f"add_adapter: the engine already has an adapter {name!r}; load_weights moves it")
        dtype = next(t for t in self._params.values() if t.is_floating_point()).dtype
        slot = f"astratk{len(self.slots)}"  # PEFT's module-dict key (no dots): the user's name may have any
        with self._lock, torch.no_grad():
            tensors = inject_adapter(self._model, lora, slot, dtype)
            try:
                check_state(state, tensors)
                if missing := sorted(set(tensors) - set(state)):
                    raise KeyError(f"add_adapter: {len(missing)} adapter tensors missing from the state, e.g. "
                                   f"{missing[:2]}")
                for key, tensor in state.items():
                    tensors[key].copy_(tensor)
            except BaseException:
                remove_adapter(self._model, slot)
                self.active = _UNKNOWN  # PEFT may have switched the active adapter
                raise
            self.active = _UNKNOWN
            self.slots[name] = _Adapter(slot, tensors, version, MixedLora(self._model).mixable(slot))

    def get(self, name: str) -> _Adapter:
        try:
            return self.slots[name]
        except KeyError:
            raise KeyError(f"the engine has no adapter {name!r} (adapters: {sorted(self.slots)}); attach it "
                           "with add_adapter") from None

    def activate(self, adapter: str | None, base_version: int) -> int:
        """Under the weights lock: make the model apply `adapter` (None: the base alone); returns its version
        (`base_version` for the base)."""
        if adapter != self.active:
            from astratk.models.lora import activate

            activate(self._model, None if adapter is None else self.slots[adapter].slot)
            self.active = adapter
        return base_version if adapter is None else self.slots[adapter].version

    def forget_active(self) -> None:
        """A load ran between two decode steps: the next `activate` applies its adapter again, whatever it was."""
        self.active = _UNKNOWN
