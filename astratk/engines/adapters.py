"""`AdapterView`: one LoRA adapter of an engine that holds several on one copy of its base model.

Policies trained with LoRA on the same base model share one engine per process (`astratk.rollout.service`): the
engine holds the base once and one adapter per (purpose, policy), and a view is the `Engine` contract for one of
them. Its requests name the adapter, so the engine runs them with it (TorchEngine: a batch runs rows of one adapter;
VLLMEngine: each request carries its adapter's `LoRARequest`); its `version` and `load_weights` are the adapter's.
The engine's guarantees hold per adapter: a batch (TorchEngine) or a request (VLLMEngine) finishes on the adapter
weights it started with, and every token carries the version of its adapter.

An engine that hosts adapters implements `add_adapter(name, lora, state, version) -> AdapterView`,
`adapter_version(name)`, `submit(requests, adapter=name)` and `load_weights(state, version, adapter=name)`.

Example:
    >>> engine = TorchEngine("models/base")  # doctest: +SKIP
    >>> solver = engine.add_adapter("rollout/solver", LoraSpec(r=8), state_v0, version=0)  # doctest: +SKIP
    >>> [c] = await solver.generate([request])  # c.versions: the solver adapter's version  # doctest: +SKIP
    >>> solver.load_weights(delta, version=1)  # the adapter moves; the base and other adapters stay  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Mapping, Sequence
from typing import Any

from astratk.contracts import Completion, GenerationRequest


class AdapterView:
    """The Engine contract for adapter `name` of `engine` (module docstring). Closing a view closes nothing: the
    engine belongs to whoever built it."""

    def __init__(self, engine: Any, name: str) -> None:
        self.engine, self.name = engine, name

    @property
    def version(self) -> int:
        return self.engine.adapter_version(self.name)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int | None:
        return getattr(self.engine, "max_model_len", None)

    @property
    def broken(self) -> RuntimeError | None:
        return getattr(self.engine, "broken", None)

    @property
    def stats(self) -> dict[str, Any]:
        """The shared engine's counters (every adapter's batches)."""
        return self.engine.stats

    def submit(self, requests: Sequence[GenerationRequest]) -> concurrent.futures.Future:
        return self.engine.submit(requests, adapter=self.name)

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        return await asyncio.wrap_future(self.submit(requests))

    def load_weights(self, state: Mapping[str, Any] | Any, version: int) -> None:
        """The adapter's tensors (full, by saved name) or a `SparseDelta` from its version."""
        self.engine.load_weights(state, version, adapter=self.name)

    def close(self, timeout_s: float = 30.0) -> None:
        """Nothing to close: the shared engine outlives its views."""

    def __repr__(self) -> str:
        return f"AdapterView({self.name!r}, version={self.version}, on {self.engine!r})"
