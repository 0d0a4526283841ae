"""Time bounds on user code in the data path: an episode (its turns and env steps), a scoring call.

Why: an env step or a reward function that hangs (a grader stuck on a pathological input, a tool waiting on a dead
server) is the most reported hang in RL toolkits; unbounded, it holds a rollout worker forever and its task is never
finished, re-issued or counted. Python cannot kill a thread, so a call that overruns is *abandoned*: the caller stops
waiting, the thread runs on as a daemon (it cannot keep a worker process alive at exit), and the overrun is counted
(`abandoned_threads`). Graders that can run away with a CPU (code, math) already run in child processes with their
own time limits; these bounds are the outer guarantee for everything else.

- `call_bounded(fn, timeout_s, what)`: a synchronous call, in a daemon thread; `BoundExceeded` naming `what` when it
  overruns.
- `run_episodes(coro)`: `asyncio.run` for rollout batches, except that the loop's default executor (where envs run
  blocking steps with `asyncio.to_thread`) does not wait for its threads at shutdown: `asyncio.run` would otherwise
  wait, unbounded, for a step that an episode timeout (`asyncio.wait_for`) already gave up on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
_abandoned = 0
_abandoned_lock = threading.Lock()


class BoundExceeded(TimeoutError):
    """A bounded call or episode overran its limit; the message names what and the config key."""


def abandoned_threads() -> int:
    """Calls abandoned in this process so far (their threads may still be running)."""
    return _abandoned


def _abandon() -> None:
    global _abandoned
    with _abandoned_lock:
        _abandoned += 1


def call_bounded(fn: Callable[[], T], timeout_s: float | None, what: str) -> T:
    """`fn()` if it returns within `timeout_s` seconds (None: no bound, called here); else `BoundExceeded`. An
    exception of `fn` is raised here as is."""
    if timeout_s is None:
        return fn()
    future: concurrent.futures.Future = concurrent.futures.Future()

    def target() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            future.set_exception(e)

    threading.Thread(target=target, name=f"astratk-bounded-{what[:40]}", daemon=True).start()
    try:
        return future.result(timeout_s)
    except concurrent.futures.TimeoutError:
        _abandon()
        raise BoundExceeded(f"{what} did not finish within {timeout_s:g}s") from None


class _DaemonExecutor(concurrent.futures.ThreadPoolExecutor):
    """A default executor whose shutdown does not wait: threads of abandoned steps are left to finish alone."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=False, cancel_futures=True)


def run_episodes(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion in a new event loop (as `asyncio.run`), without waiting at the end for executor
    threads that are still busy (see the module docstring)."""
    loop = asyncio.new_event_loop()
    loop.set_default_executor(_DaemonExecutor(thread_name_prefix="astratk-step"))
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()


async def bounded_episode(coro: Coroutine[Any, Any, T], timeout_s: float | None, what: str) -> T:
    """Await `coro` at most `timeout_s` seconds (None: no bound); `BoundExceeded` naming `what` when it overruns.
    The episode is cancelled; a blocking step it awaited through `asyncio.to_thread` is abandoned (counted)."""
    if timeout_s is None:
        return await coro
    try:
        return await asyncio.wait_for(coro, timeout_s)
    except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
        _abandon()
        raise BoundExceeded(f"{what} did not finish within {timeout_s:g}s") from None
