"""A `generate` call as an engine queues it, and the checks every engine makes at the caller.

`_Call` holds one call's requests, their completions as they arrive and the caller's future; `_settle` resolves that
future once. `TorchEngine` and `VLLMEngine` both queue calls this way; an engine that batches calls itself can reuse
them, and a check every engine needs belongs beside `check_prompt`.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any

from astratk.contracts import Completion, GenerationRequest


@dataclass(eq=False)
class _Call:
    """One `generate` call: its requests, their completions as they arrive, and the caller's future."""

    requests: list[GenerationRequest]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    adapter: str | None = None  # the LoRA adapter its requests run with (None: the base model)

    def __post_init__(self) -> None:
        self.results: list[Completion | None] = [None] * len(self.requests)
        self.remaining = len(self.requests)


def check_prompt(r: GenerationRequest, vocab: int) -> None:
    """A request's prompt is non-empty and inside the vocabulary (every engine checks this at its caller)."""
    if not r.prompt_ids:
        raise ValueError("empty prompt: an engine needs at least one prompt token (prepend a BOS token)")
    if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= vocab:
        raise ValueError(f"prompt token ids must lie in [0, {vocab}), got {min(r.prompt_ids)}..{max(r.prompt_ids)}")


def _settle(future: concurrent.futures.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve a caller's future unless it is already done (failed earlier, or cancelled by its caller)."""
    try:
        future.set_exception(error) if error is not None else future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass
