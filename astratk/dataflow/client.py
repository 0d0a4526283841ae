"""`DataLayerClient`: one way to talk to a `DataLayer`, whether it is a Dask actor or an in-process
object.

Every remote call has a timeout that names what it waited for. Waiting for a batch is client-side
polling, so the actor's single thread is never blocked (Dask actors run synchronous methods
one at a time).

Recovery: the actor dies with its worker ("Worker holding Actor was lost", or "Unable to contact
Actor's worker" for a call in flight). A client given `recover` (a callable that starts a
replacement actor from the newest snapshot and returns it: `astratk.runtime.deploy`) swaps it in and
retries the call; concurrent callers share one recovery. The deployment publishes its current actor
as a Dask dataset named `published`; pickled copies (inside rollout chains, on workers) have no
`recover` and follow that dataset instead: a lost actor's call waits for the replacement to appear
there and is retried on it.

A call to an actor whose worker died may never get an answer: distributed's actor then waits on the
actor's key, which never comes back. So a call is awaited in slices of `poll_s`, and between slices
the client looks whether its actor was lost (the scheduler says so) or replaced (by another thread,
or in the published dataset), and moves to the replacement as soon as it exists rather than at the
call's timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from astratk.records import AdmitOutcome, AdmitReport, Drop, Group, Lease, WeightRef

if TYPE_CHECKING:
    from astratk.dataflow.snapshots import SnapshotEntry


# How many replacements one call follows before it gives up (each is a lost control worker).
MAX_REPLACEMENTS = 3


class _Replaced(Exception):  # control flow inside `_call`, never raised to a caller
    """The actor a call was waiting on has been replaced: retry the call on the new one."""


def _is_lost(e: BaseException) -> bool:
    """Dask's words for an actor gone with its worker: "Worker holding Actor was lost" (RuntimeError)
    or, for a call in flight, "Unable to contact Actor's worker" (OSError)."""
    return isinstance(e, (RuntimeError, OSError)) and (
        "Actor was lost" in str(e) or "contact Actor's worker" in str(e))


def bind_actor(actor: Any, client: Any, future: Any = None) -> Any:
    """`actor` (a `distributed.Actor`), calling through `client`; `future` (the submission's, else a
    new reference to the actor's key) keeps the actor alive and tells when it is lost.

    distributed binds an actor unpickled outside a worker to the process's *default* client: to
    none when every client is private (each run's is: several runs share a notebook process, and a
    default client changes Dask's process-wide settings), to another run's when that one is the
    default. It has no public way to choose the client, hence the two attributes set here. An
    in-process (threads) worker hands over an actor that calls through that worker: it only needs
    the reference that keeps it alive."""
    from distributed import Future

    if getattr(actor, "_worker", None) is None:
        actor._client = client
    actor._future = future if future is not None else Future(actor.key, client)
    return actor


def _detach(actor: Any) -> None:
    """Stop `actor` from waiting on its key. distributed's actor, when a call cannot reach the
    actor's worker, waits for the actor's key to come back before answering; a lost actor's key
    never does, so the call would hang, and its callback would log a traceback when the client
    closes. Detached, such a call fails at once with "Unable to contact Actor's worker". Pickled
    copies (whose liveness this client follows through the published actor) and lost actors are
    detached."""
    if getattr(actor, "_future", None) is not None:
        actor._future = None


class DataLayerClient:
    """Wraps a `DataLayer` or a `distributed.Actor` of one; picklable when it wraps an actor.

    `recover`: starts (or finds) a replacement for a lost actor and returns it (the deploying process
    and attached trainer jobs). `published`: the Dask dataset holding the deployment's current actor,
    which pickled copies follow (`astratk.runtime.deploy` publishes every replacement there).
    `poll_s`: how often a call that has no answer yet looks for a lost or replaced actor."""

    def __init__(self, target: Any, call_timeout_s: float = 60.0,
                 recover: Callable[[], Any] | None = None, published: str | None = None,
                 poll_s: float = 0.5) -> None:
        self.target = target
        self.call_timeout_s = call_timeout_s
        self.is_actor = type(target).__name__ == "Actor"
        self.recover = recover
        self.published = published
        self.poll_s = poll_s
        self.recoveries = 0
        # An in-process DataLayer is shared by the trainer, acquisition and admit threads: serialise
        # calls, as the actor does.
        self._lock = threading.Lock()
        self._recover_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        if not self.is_actor:
            raise TypeError("an in-process DataLayer cannot cross processes; start it as an actor "
                            "(astratk.runtime)")
        return {"target": self.target, "call_timeout_s": self.call_timeout_s,
                "published": self.published, "poll_s": self.poll_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["target"], state["call_timeout_s"],  # type: ignore[misc]
                      published=state.get("published"), poll_s=state.get("poll_s", 0.5))
        if self.published is not None:
            _detach(self.target)

    def _call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        timeout = self.call_timeout_s if timeout is None else timeout
        if not self.is_actor:
            with self._lock:
                return getattr(self.target, method)(*args, **kwargs)
        deadline = time.monotonic() + timeout
        for _ in range(MAX_REPLACEMENTS + 1):
            target = self.target
            try:
                return self._await(getattr(target, method)(*args, **kwargs), target, method, timeout,
                                   deadline)
            except _Replaced:
                continue
            except (RuntimeError, OSError) as e:
                if not _is_lost(e) or (self.recover is None and self.published is None):
                    raise
                self._replace(target, deadline)
        raise RuntimeError(f"data layer call {method}(): the data-layer actor was lost "
                           f"{MAX_REPLACEMENTS + 1} times during one call; is the control worker "
                           "crashing? (see its log)")

    # ------------------------------------------------------- one typed method per data-layer method
    # (`astratk.dataflow.datalayer.DataLayer` documents each); `timeout` overrides `call_timeout_s`
    # for one call.
    def lease(self, n: int) -> list[Lease]:
        return self._call("lease", n)

    def release(self, leases: Sequence[tuple[str, int]], reason: str = "error") -> None:
        self._call("release", list(leases), reason)

    def admit(self, lease_id: str, groups: Sequence[Group]) -> AdmitOutcome:
        return self._call("admit", lease_id, list(groups))

    def drop_leases(self, items: Sequence[tuple[str, str]]) -> list[str]:
        return self._call("drop_leases", list(items))

    def admit_many(self, items: Sequence[tuple[str, Sequence[Group]]]) -> AdmitReport:
        return self._call("admit_many", [(lease_id, list(groups)) for lease_id, groups in items])

    def publish_version(self, ref: WeightRef) -> None:
        self._call("publish_version", ref)

    def latest(self, policy_id: str) -> WeightRef | None:
        return self._call("latest", policy_id)

    def version(self, policy_id: str) -> int:
        return self._call("version", policy_id)

    def versions(self) -> dict[str, int]:
        return self._call("versions")

    def next_batch(self, policy_id: str, step: int, rank: int = 0,
                   world_size: int = 1) -> list[Group] | None:
        return self._call("next_batch", policy_id, step, rank, world_size)

    def set_paused(self, paused: bool) -> None:
        self._call("set_paused", paused)

    def is_paused(self) -> bool:
        return self._call("is_paused")

    def trainer_attached(self, policy_id: str) -> None:
        self._call("trainer_attached", policy_id)

    def trainer_detached(self, policy_id: str, step: int) -> None:
        self._call("trainer_detached", policy_id, step)

    def metrics(self, timeout: float | None = None) -> dict[str, float]:
        return self._call("metrics", timeout=timeout)

    def drops(self, timeout: float | None = None) -> list[Drop]:
        return self._call("drops", timeout=timeout)

    def status(self) -> str:
        return self._call("status")

    def snapshot(self, kind: str = "on_demand", timeout: float | None = None) -> SnapshotEntry:
        return self._call("snapshot", kind, timeout=timeout)

    def load_snapshot(self, url: str, name: str | None = None) -> dict[str, Any]:
        return self._call("load_snapshot", url, name)

    def state_dict(self, batches_kept: int | None = None,
                   timeout: float | None = None) -> dict[str, Any]:
        return self._call("state_dict", batches_kept, timeout=timeout)

    # ------------------------------------------------------------------------------------- plumbing
    def _await(self, future: Any, target: Any, method: str, timeout: float, deadline: float) -> Any:
        """The answer of the call `future` made to `target`, awaited in slices of `poll_s`; between
        them, `_Replaced` when `target` was replaced and a lost-actor error when the scheduler says
        it was lost (both retried by `_call`)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"data layer call {method}() got no answer in {timeout:.0f}s; "
                                   "is the control worker alive? (the data-layer actor dies with "
                                   "its worker)")
            try:
                return future.result(timeout=min(self.poll_s, left))
            except TimeoutError:
                if future.done():  # the answer came as the slice ran out (or it is the data layer's own
                    return future.result()  # TimeoutError, which this raises): done, so this does not wait
            if self.target is not target:  # another caller replaced it meanwhile
                raise _Replaced
            # distributed raises "Worker holding Actor was lost" here when its scheduler says so
            getattr(target, method)
            if self.recover is None and self._newer_published(target) is not None:
                raise _Replaced

    def _newer_published(self, current: Any) -> Any:
        """The published actor when it is not `current` (now this client's target), else None."""
        actor = self._published_actor()
        if actor is None or actor.key == current.key:
            return None
        with self._recover_lock:
            if self.target is current:
                _detach(current)
                self.target = actor
                self.recoveries += 1
        return actor

    def _published_actor(self) -> Any:
        """The actor published as `published`, seen through this process's Dask client (a worker's
        own), or None (nothing published, no client)."""
        if self.published is None:
            return None
        from distributed import get_client

        try:
            actor = get_client().get_dataset(self.published, default=None,
                                             callback_timeout=max(1.0, 4 * self.poll_s))
        except (ValueError, OSError):  # no client in this process; the scheduler unreachable or slow
            return None
        if actor is not None:
            _detach(actor)
        return actor

    def _replace(self, lost: Any, deadline: float) -> None:
        """Replace the lost actor `lost`, unless another caller already has: `recover()`, else wait
        (until `deadline`) for a replacement to be published."""
        with self._recover_lock:
            if self.target is not lost:
                return
            _detach(lost)
            if self.recover is not None:
                self.target = self.recover()
                self.recoveries += 1
                return
        while time.monotonic() < deadline:
            if self._newer_published(lost) is not None or self.target is not lost:
                return
            time.sleep(self.poll_s)
        raise TimeoutError(f"the data-layer actor was lost with its worker and no replacement was "
                           f"published as {self.published!r} in time; is the deploying process (the "
                           "run, or `astratk deploy`) alive?")

    def wait_batch(self, policy_id: str, step: int, rank: int = 0, world_size: int = 1, *,
                   timeout: float = 300.0, poll_s: float = 0.02,
                   deadline: float | None = None,
                   stop: Callable[[], bool] | None = None) -> list[Group] | None:
        """Poll `next_batch` until it is ready. After `timeout` seconds raise `BatchTimeout` naming
        the wait (and the data layer's counters, to show where samples went); at `deadline` (a
        `time.monotonic()` value: the caller's own time limit, not a fault), or once `stop()` is
        true (checked about once a second: the run asked its trainers to stop), return None instead."""
        start = time.monotonic()
        delay = poll_s
        checked = start
        while True:
            groups = self.next_batch(policy_id, step, rank, world_size)
            if groups is not None:
                return groups
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return None
            # a paused run is not a stalled one: the timeout restarts after the pause
            if now - checked > 1.0:
                checked = now
                if stop is not None and stop():
                    return None
                if self.is_paused():
                    start = now
            waited = time.monotonic() - start
            if waited > timeout:
                status = self.status()
                raise BatchTimeout(f"waited {waited:.0f}s for policy {policy_id!r} step {step} "
                                   f"batch (rank {rank}/{world_size}); rollouts did not fill the "
                                   f"buffer. Data layer: {status}", waited)
            sleep = delay if deadline is None else max(0.0, min(delay, deadline - now))
            time.sleep(sleep)
            delay = min(delay * 1.5, 0.25)


class BatchTimeout(TimeoutError):
    """`wait_batch` waited its whole timeout for a step's batch (`waited`: seconds, pauses not
    counted)."""

    def __init__(self, message: str, waited: float) -> None:
        super().__init__(message)
        self.waited = waited
