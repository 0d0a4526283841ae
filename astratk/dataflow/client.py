"""`DataLayerClient`: one way to talk to a `DataLayer`, whether it is a Dask actor or an in-process
object.

Every remote call has a timeout that names what it waited for. Waiting for a batch is client-side
polling, so the actor's single thread is never blocked (Dask actors run synchronous methods
one at a time).

Recovery: the actor dies with its worker ("Worker holding Actor was lost", or "Unable to contact
Actor's worker" for a call in flight). A client given `recover` (a callable that starts a
replacement actor from the newest snapshot and returns it: `astratk.runtime.deploy`) swaps it in and
retries the call; concurrent callers share one recovery. Pickled copies (inside rollout chains) have
no `recover`: their calls fail, and the acquisition re-issues that work through its own client.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from astratk.records import AdmitOutcome, AdmitReport, Drop, Group, Lease, WeightRef

if TYPE_CHECKING:
    from astratk.dataflow.snapshots import SnapshotEntry


class DataLayerClient:
    """Wraps a `DataLayer` or a `distributed.Actor` of one; picklable when it wraps an actor."""

    def __init__(self, target: Any, call_timeout_s: float = 60.0,
                 recover: Callable[[], Any] | None = None) -> None:
        self.target = target
        self.call_timeout_s = call_timeout_s
        self.is_actor = type(target).__name__ == "Actor"
        self.recover = recover
        self.recoveries = 0
        # An in-process DataLayer is shared by the trainer, acquisition and admit threads: serialise
        # calls, as the actor does.
        self._lock = threading.Lock()
        self._recover_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        if not self.is_actor:
            raise TypeError("an in-process DataLayer cannot cross processes; start it as an actor "
                            "(astratk.runtime)")
        return {"target": self.target, "call_timeout_s": self.call_timeout_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["target"], state["call_timeout_s"])  # type: ignore[misc]

    def _call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        timeout = self.call_timeout_s if timeout is None else timeout
        if not self.is_actor:
            with self._lock:
                return getattr(self.target, method)(*args, **kwargs)
        for attempt in (0, 1):
            target = self.target
            try:
                return getattr(target, method)(*args, **kwargs).result(timeout=timeout)
            except TimeoutError:
                raise TimeoutError(f"data layer call {method}() got no answer in {timeout:.0f}s; "
                                   "is the control worker alive? (the data-layer actor dies with "
                                   "its worker)") from None
            # Dask says "Worker holding Actor was lost" (RuntimeError) or, mid-call, OSError
            except (RuntimeError, OSError) as e:
                lost = "Actor was lost" in str(e) or "contact Actor's worker" in str(e)
                if not lost or self.recover is None or attempt:
                    raise
                self._replace(target)
        raise AssertionError("unreachable")

    # ------------------------------------------------------- one typed method per data-layer method
    # (`astratk.dataflow.datalayer.DataLayer` documents each); `timeout` overrides `call_timeout_s`
    # for one call.
    def lease(self, n: int) -> list[Lease]:
        return self._call("lease", n)

    def release(self, leases: Sequence[tuple[str, int]], reason: str = "error") -> None:
        self._call("release", list(leases), reason)

    def admit(self, lease_id: str, groups: Sequence[Group]) -> AdmitOutcome:
        return self._call("admit", lease_id, list(groups))

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
    def _replace(self, lost: Any) -> None:
        """Start a replacement for the lost actor `lost`, unless another caller already has."""
        with self._recover_lock:
            if self.target is lost:
                self.target = self.recover()  # type: ignore[misc]
                self.recoveries += 1

    def wait_batch(self, policy_id: str, step: int, rank: int = 0, world_size: int = 1, *,
                   timeout: float = 300.0, poll_s: float = 0.02) -> list[Group]:
        """Poll `next_batch` until it is ready; after `timeout` seconds raise TimeoutError naming
        the wait (and the data layer's counters, to show where samples went)."""
        start = time.monotonic()
        delay = poll_s
        checked = start
        while True:
            groups = self.next_batch(policy_id, step, rank, world_size)
            if groups is not None:
                return groups
            now = time.monotonic()
            # a paused run is not a stalled one: the timeout restarts after the pause
            if now - checked > 1.0:
                checked = now
                if self.is_paused():
                    start = now
            waited = time.monotonic() - start
            if waited > timeout:
                status = self.status()
                raise TimeoutError(f"waited {waited:.0f}s for policy {policy_id!r} step {step} "
                                   f"batch (rank {rank}/{world_size}); rollouts did not fill the "
                                   f"buffer. Data layer: {status}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)
