"""`TorchEngine`'s request batcher: the queue of requests and the one worker thread that serves it, a batch at a time.

`Batcher.put` queues a call's requests from any thread; the worker takes a batch (`_take`: one adapter's rows, as many
as `max_batch` and the memory budget allow), runs it through the engine's `run` and resolves the callers' futures.
A new rule for which requests share a batch belongs in `_pick`.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from astratk.contracts import Completion, GenerationRequest
from astratk.engines.calls import _Call, _settle
from astratk.engines.torch_weights import WeightLoads

BATCH_WAIT_MAX_S = 0.05  # the longest a batch waits for requests still arriving (`_wait_for_arrivals`)

_Item = tuple[_Call, int]  # (call, request index)


class Batcher:
    """The queue and its worker. `run(requests, adapters)` decodes one batch (`adapters`: each row's);
    `fits(rows, prompt_width, new_tokens)` says whether a batch that size stays in the memory budget;
    `mixes(a, b)` whether rows of adapters `a` and `b` may share a batch; `stop(timeout_s=...)` is the engine's close,
    called when the worker ends; `stats` gets the `errors` and `budget_capped_batches` counts."""

    def __init__(self, *, max_batch: int, window_s: float, loads: WeightLoads,
                 run: Callable[[list[GenerationRequest], list[str | None]], list[Completion]],
                 fits: Callable[[int, int, int], bool], stop: Callable[..., None], stats: dict[str, Any],
                 mixes: Callable[[str | None, str | None], bool] = lambda a, b: a == b) -> None:
        self._max_batch, self._window, self._loads, self._mixes = max_batch, window_s, loads, mixes
        self._run, self._fits, self._stop, self._stats = run, fits, stop, stats
        self._cond = threading.Condition()  # guards the queue and `closed`
        self._pending: collections.deque[_Item] = collections.deque()
        self._closed, self._worker = False, None

    def put(self, call: _Call) -> None:
        """Queue `call`'s requests (starting the worker on the first); refused once closed or broken."""
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is closed")
            if (broken := self._loads.broken) is not None:
                raise RuntimeError(str(broken)) from broken.__cause__
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name="TorchEngine-batcher", daemon=True)
                self._worker.start()
            self._pending.extend((call, i) for i in range(len(call.requests)))
            self._cond.notify()

    def close(self, timeout_s: float) -> None:
        """Stop the worker after its current batch; queued calls fail with RuntimeError."""
        with self._cond:
            self._closed = True
            pending, self._pending = list(self._pending), collections.deque()
            self._cond.notify_all()
        for call, _ in pending:
            _settle(call.future, error=RuntimeError("engine closed before this request ran"))
        if self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join(timeout_s)
            if self._worker.is_alive():
                raise TimeoutError(f"TorchEngine worker still running its batch after {timeout_s}s at close()")

    def _serve(self) -> None:
        try:
            while (items := self._take()) is not None:
                if items:
                    self._serve_batch(items)
        finally:  # normally after close(); if the worker itself broke, nobody may wait forever
            self._stop(timeout_s=0)

    def _serve_batch(self, items: list[_Item]) -> None:
        """Run one batch; an exception goes to the calls in it, and the worker carries on."""
        try:
            completions = self._run([call.requests[i] for call, i in items], [call.adapter for call, _ in items])
        except Exception as e:  # noqa: BLE001 - the batch's callers get it; the worker keeps serving
            self._stats["errors"] += 1
            for call in {id(c): c for c, _ in items}.values():
                _settle(call.future, error=e)
            return
        for (call, i), completion in zip(items, completions, strict=True):
            call.results[i] = completion
            call.remaining -= 1
            if call.remaining == 0:
                _settle(call.future, result=call.results)

    def _take(self) -> list[_Item] | None:
        """The next batch (empty when every request taken was already done); None once closed."""
        with self._cond:
            if not self._wait_for_arrivals():
                return None
            items = self._pick()
        self._loads.let_go()  # a waiting load_weights takes the lock first
        return items

    def _wait_for_arrivals(self) -> bool:
        """Under the queue's lock: wait for a first request, then while more keep arriving, until none has arrived
        for `window_s` (at most `BATCH_WAIT_MAX_S` in all, or until `max_batch`); False once closed.

        Why wait for the arrivals to stop rather than for a fixed window: a rollout chunk's 64 episodes render their
        chat prompts before they call `generate`, so their requests trickle in over several milliseconds, and a fixed
        2 ms window cut them into a batch of 48 and one of 16 (measured: 1.3x fewer tokens/s than one batch). A lone
        request waits `window_s` only."""
        while not self._pending and not self._closed:
            self._cond.wait(timeout=1.0)  # idle: re-check `closed` every second
        if self._closed:
            return False
        give_up = time.monotonic() + BATCH_WAIT_MAX_S
        seen, quiet_until = len(self._pending), time.monotonic() + self._window
        while len(self._pending) < self._max_batch and (now := time.monotonic()) < give_up:
            if len(self._pending) != seen:  # another request arrived: wait a window more for the next
                seen, quiet_until = len(self._pending), now + self._window
            if now >= quiet_until:
                break
            self._cond.wait(timeout=min(quiet_until, give_up) - now)
        return True

    def _pick(self) -> list[_Item]:
        """Under the queue's lock: the batch, from the front of the queue. A batch runs rows of one adapter (or of the
        base alone): the oldest queued request's, and the queued requests of that adapter, so each adapter keeps its
        requests' order and none waits behind more than the batches ahead of it; adapters that `mixes` the first
        request's share its batch (`torch_lora_mix`). The rest goes back, in order."""
        items: list[_Item] = []
        others: collections.deque[_Item] = collections.deque()  # other adapters' requests
        full = False  # the memory budget holds no more rows: the rest waits for the next batch, in order
        width = new = 0  # the batch's longest prompt and largest token budget so far
        while self._pending and len(items) < self._max_batch:
            call, i = self._pending.popleft()
            if call.future.done():  # skip calls already failed or cancelled
                continue
            r = call.requests[i]
            wider, longer = max(width, len(r.prompt_ids)), max(new, r.params.max_tokens)
            if items and call.adapter != items[0][0].adapter and not self._mixes(items[0][0].adapter, call.adapter):
                others.append((call, i))
            elif items and (full or not self._fits(len(items) + 1, wider, longer)):
                full = True
                others.append((call, i))
            else:
                items.append((call, i))
                width, new = wider, longer
        self._stats["budget_capped_batches"] += full
        if others:  # back to the front, in their order
            others.extend(self._pending)
            self._pending = others
        return items
