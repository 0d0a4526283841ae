"""`ContextLimit`: the engines an episode sees, with every request fitted into the model's context.

Why here, once: envs build their prompts (chat templates, tools, multi-turn histories) and engines differ in what
they do past their position limit (TorchEngine cuts the budget, vLLM refuses the request, a user's engine may not
know). The rollout service hands envs engines wrapped in this, so for every env and engine a request's token
budget is cut to the room its prompt leaves (the completion then ends as "length" at the last position), and a
prompt that leaves no room raises `PromptTooLong` in the episode that made it, before it joins any batch: the
service drops that task, counted with its id (`prompt_too_long`), instead of generating past the limit or failing
the other episodes of its chunk. Multi-turn conversations read `max_model_len` to stop when the context is full,
as their own token budget stops them (`astratk.envs.multiturn.Conversation`).

Example:
    >>> import asyncio
    >>> from astratk.contracts import GenerationRequest, SamplingParams
    >>> from astratk.engines.scripted import ScriptedEngine
    >>> engine = ContextLimit(ScriptedEngine(None, [[5] * 10]), max_model_len=8)
    >>> [c] = asyncio.run(engine.generate([GenerationRequest((1, 2, 3), SamplingParams(max_tokens=10))]))
    >>> len(c.token_ids), c.finish_reason
    (5, 'length')
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from astratk.contracts import Completion, GenerationRequest, fit_context


class ContextLimit:
    """`engine` with its requests fitted into `max_model_len` positions (default: the engine's own
    `max_model_len`; None: no limit known, requests pass unchanged). Everything else is the engine's."""

    def __init__(self, engine: Any, max_model_len: int | None = None) -> None:
        self._engine = engine
        self.max_model_len = max_model_len if max_model_len is not None else getattr(engine, "max_model_len", None)

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        fitted = [fit_context(r, self.max_model_len) for r in requests]  # PromptTooLong before anything is queued
        return await self._engine.generate(fitted)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def limit_engines(engines: dict[str, Any]) -> dict[str, Any]:
    """Each role's engine wrapped in a `ContextLimit` (one wrapper per engine object)."""
    wrapped: dict[int, ContextLimit] = {}
    return {role: wrapped.setdefault(id(e), ContextLimit(e)) for role, e in engines.items()}
