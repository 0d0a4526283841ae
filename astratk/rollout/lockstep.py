"""`Lockstep`: engine batches that do not depend on timing, for the synchronous deterministic mode.

Why: an engine's log-probs for a sequence depend, by float rounding (~1e-6 measured on the TorchEngine), on which
other sequences share its batch, and an engine batches whatever requests arrive within a short window, so batch
composition follows how fast episodes tokenise their prompts. That is harmless for training, but it breaks "a resumed
run sees exactly the batches of the uninterrupted one".

How: a rollout chunk's episodes run under one `Lockstep`; their engines are wrapped (`engine()`), and a wrapped
`generate` call waits until *every* live episode of the chunk is blocked on an engine (or done). Then each engine
gets all waiting requests in one call, ordered by (episode key, call order): the same batches in every run. The
chunk's episode keys are announced first (`expect`), so the first episode to call cannot run alone. Episodes
that await something other than an engine (none of astratk's envs do) would stall the chunk; a stall longer than
`stall_s` flushes anyway and is counted (`stalls`), so a run is never stuck.

Example:
    >>> import asyncio
    >>> from astratk.engines.scripted import ScriptedEngine
    >>> lock = Lockstep()
    >>> eng = lock.engine(ScriptedEngine(script=[(5,), (5, 6)]))
    >>> async def episode(i):
    ...     from astratk.contracts import GenerationRequest, SamplingParams
    ...     [c] = await eng.generate([GenerationRequest((1, 2), SamplingParams(max_tokens=4))])
    ...     return len(c.token_ids)
    >>> async def main():
    ...     lock.expect([(0, 0), (0, 1)])  # every episode of the chunk, before any starts
    ...     return await asyncio.gather(*(lock.run((0, i), episode(i)) for i in range(2)))
    >>> asyncio.run(main()), lock.batches
    ([1, 2], 1)
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
_EPISODE: contextvars.ContextVar[tuple] = contextvars.ContextVar("astratk_lockstep_episode")


class Lockstep:
    def __init__(self, stall_s: float = 30.0) -> None:
        self.stall_s = stall_s
        self.batches = 0  # flushes (one engine call per engine involved)
        self.stalls = 0
        self._live: set[tuple] = set()
        self._waiting: list[tuple[tuple, int, Any, Sequence[Any], asyncio.Future]] = []
        self._seq = 0
        self._timer: asyncio.TimerHandle | None = None
        self._serving: set[asyncio.Future] = set()  # batches being served (kept referenced until done)

    def engine(self, engine: Any) -> _LockstepEngine:
        return _LockstepEngine(self, engine)

    def expect(self, keys: Sequence[tuple]) -> None:
        """Announce episodes that will `run`: batches wait for them from now on."""
        self._live.update(keys)

    async def run(self, key: tuple, episode: Awaitable[T]) -> T:
        """Run one episode (a coroutine) as a member of the chunk; `key` orders its requests in batches."""
        self._live.add(key)
        token = _EPISODE.set(key)
        try:
            return await episode
        finally:
            _EPISODE.reset(token)
            self._live.discard(key)
            self._maybe_flush()

    async def _generate(self, engine: Any, requests: Sequence[Any]) -> list[Any]:
        key = _EPISODE.get(None)
        if key is None or key not in self._live:  # not inside `run`: nothing to wait for
            return await engine.generate(requests)
        future = asyncio.get_running_loop().create_future()
        self._seq += 1
        self._waiting.append((key, self._seq, engine, list(requests), future))
        self._maybe_flush()
        if self._timer is None and self._waiting:
            self._timer = asyncio.get_running_loop().call_later(self.stall_s, self._stalled)
        return await future

    def _stalled(self) -> None:
        self._timer = None
        if self._waiting:
            self.stalls += 1
            self._flush()

    def _maybe_flush(self) -> None:
        blocked = {key for key, *_ in self._waiting}
        if self._waiting and blocked >= self._live:
            self._flush()

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting, self._waiting = sorted(self._waiting, key=lambda w: (w[0], w[1])), []
        by_engine: dict[int, list] = {}
        for item in waiting:
            by_engine.setdefault(id(item[2]), []).append(item)
        self.batches += 1
        for items in by_engine.values():
            task = asyncio.ensure_future(_serve(items))
            self._serving.add(task)  # a task only weakly referenced by the loop may be collected mid-flight
            task.add_done_callback(self._serving.discard)


async def _serve(items: list[tuple[tuple, int, Any, Sequence[Any], asyncio.Future]]) -> None:
    engine = items[0][2]
    flat = [r for *_, requests, _ in items for r in requests]
    try:
        completions = await engine.generate(flat)
    except Exception as e:  # noqa: BLE001 - every caller of the batch gets the error
        for *_, future in items:
            if not future.done():
                future.set_exception(e)
        return
    at = 0
    for *_, requests, future in items:
        n = sum(r.params.n for r in requests)  # an engine returns n completions per request (`expand_samples`)
        if not future.done():
            future.set_result(list(completions[at:at + n]))
        at += n


class _LockstepEngine:
    """An engine whose `generate` joins the chunk's lock-step batches; everything else is the engine's."""

    def __init__(self, lockstep: Lockstep, engine: Any) -> None:
        self._lockstep = lockstep
        self._engine = engine

    async def generate(self, requests: Sequence[Any]) -> list[Any]:
        return await self._lockstep._generate(self._engine, requests)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)
