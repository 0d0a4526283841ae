"""The acquisition loop: keeps the rollout pipeline full (docs/architecture.md, steps 1-4).

It leases tasks from the data layer and submits `rollout -> score -> admit` chains with resource requirements, so Dask
places them on workers labelled for the policies involved, balances load, and resubmits work from workers that die.
It keeps `max_inflight_chunks` chains per rollout worker in flight, and re-counts workers every 2 s, so workers that
join or leave change the target without any system code. A chain that fails releases its leases for re-issue; a lost
worker's leases expire and are re-issued by the data layer.

Per-service metrics: every admitted chunk reports which service (worker) rolled it out and on which hardware class;
`ServiceStats` turns that into throughput (tasks/s and tokens/s while busy) and version lag (the policy's version at
admission minus the group's version), per service and per hardware class. `task_accounting` states, from the data
layer's counters, that no leased task was lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import CancelledError
from typing import Any

from astratk.dataflow.client import DataLayerClient
from astratk.records import RunContext
from astratk.rollout.tasks import admit_task, rollout_task, score_task
from astratk.runtime.cluster import count_workers
from astratk.spec import SCORE_LABEL

log = logging.getLogger(__name__)
SCORE_RESOURCES = {SCORE_LABEL: 1}  # what a score task asks for (astratk.spec.SCORE_LABEL)


class Acquisition:
    def __init__(self, client: Any, datalayer: DataLayerClient, ctx: RunContext) -> None:
        self.client = client
        self.datalayer = datalayer
        self.ctx = ctx
        self.spec = ctx.spec
        self.counts: Counter[str] = Counter()
        self.services = ServiceStats()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="astratk-acquisition", daemon=True)
        self._inflight: dict[Any, list[tuple[str, int]]] = {}  # admit future -> its (lease id, attempt) pairs
        self._policies = sorted(self.spec.served_ids())  # each needs its label on the worker (frozen models too)
        self._workers_checked = 0.0
        self._n_workers = 1

    def start(self) -> Acquisition:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        for future in list(self._inflight):
            future.cancel()
        self._inflight.clear()

    def pause(self) -> None:
        """Lease nothing new; chunks in flight still finish and are admitted."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    @property
    def paused(self) -> bool:
        return self._paused.is_set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _rollout_workers(self) -> int:
        """Workers that carry every rollout label this run needs (re-counted every 2 s: pools are elastic)."""
        now = time.monotonic()
        if now - self._workers_checked > 2.0:
            self._n_workers = count_workers(self.client, [f"rollout_{p}" for p in self._policies])
            self._workers_checked = now
        return self._n_workers

    def _submit(self, chunks: int) -> None:
        """Lease up to `chunks` chunks' worth of tasks in one data-layer call (an actor round trip per chunk capped
        the loop at ~35 chunks/s on 2 cores: bench/scaling.py) and submit a chain per chunk."""
        per_chunk = self.spec.rollout.tasks_per_chunk
        leases = self.datalayer.lease(chunks * per_chunk)
        resources = {f"rollout_{p}": 1 for p in self._policies}
        for i in range(0, len(leases), per_chunk):
            chunk = leases[i:i + per_chunk]
            rolled = self.client.submit(rollout_task, self.ctx, chunk, resources=resources, pure=False,
                                        key=f"rollout-{self.ctx.run_id}-{chunk[0].lease_id}-{chunk[0].attempt}")
            scored = self.client.submit(score_task, self.ctx, rolled, resources=SCORE_RESOURCES, pure=False)
            admitted = self.client.submit(admit_task, scored, self.datalayer, pure=False)
            self._inflight[admitted] = [(lease.lease_id, lease.attempt) for lease in chunk]
            self.counts["acquisition/chunks_submitted"] += 1

    def _loop(self) -> None:
        # `distributed.wait` waits through the process's default client: another run's, or none (a run's client is
        # not the default: astratk.runtime.session). `_wait` is what it runs, here on this run's client.
        from distributed.client import _wait

        def wait(futures: list[Any], timeout: float, return_when: str) -> Any:
            return self.client.sync(_wait, futures, timeout=timeout, return_when=return_when)

        while not self._stop.is_set():
            try:
                r = self.spec.rollout
                target = max(r.max_inflight_chunks, r.concurrent_chunks + 1) * max(1, self._rollout_workers())
                if len(self._inflight) < target and not self._paused.is_set():
                    self._submit(target - len(self._inflight))
                if not self._inflight:
                    time.sleep(0.2)  # back-pressure: the buffer is full
                    continue
                try:
                    done, _ = wait(list(self._inflight), timeout=0.5, return_when="FIRST_COMPLETED")
                except TimeoutError:
                    continue
                except CancelledError:  # Dask's wait raises while any future is cancelled (e.g. "lost dependencies")
                    done = [f for f in self._inflight if f.status in ("cancelled", "error", "finished")]
                self._collect(done)
            except Exception as e:  # keep acquiring: one bad chunk must not stop the run; errors are reported
                if self._stop.is_set():
                    break
                self.counts["acquisition/loop_errors"] += 1
                self.errors.append(repr(e))
                log.exception("acquisition loop error")
                time.sleep(1.0)

    def _collect(self, done: Any) -> None:
        """Count finished chains (their small results fetched in one gather, not a round trip each: see `_submit`)
        and release the leases of failed ones for re-issue."""
        finished = [f for f in done if f.status == "finished"]
        try:
            results = self.client.gather(finished) if finished else []
        except Exception:  # noqa: BLE001 - a result was lost since the status check: fetch them one at a time
            results = None
        for i, future in enumerate(finished):
            try:
                result = dict(results[i] if results is not None else future.result(timeout=10))
            except Exception:  # noqa: BLE001, S112 - not collectable now; still in flight, the next pass looks again
                continue
            self._inflight.pop(future, None)
            self.services.add(result.pop("services", {}))
            for k, v in result.items():
                self.counts[f"acquisition/{k}"] += v
        for future in done:
            if future in self._inflight and future.status in ("error", "cancelled"):
                self._failed(future)

    def _failed(self, future: Any) -> None:
        leases = self._inflight.pop(future)
        self.counts["acquisition/chunks_failed"] += 1
        exc = future.exception() if future.status == "error" else future.status
        self.errors.append(f"rollout chunk {leases[0][0]}..: {exc!r}")
        log.warning("rollout chunk failed (%s); releasing %d leases for re-issue", exc, len(leases))
        self.datalayer.release(leases, "error")


class ServiceStats:
    """Per-service and per-hardware-class counters from admitted chunks (thread-safe; the acquisition thread adds,
    anyone reads).

    - tasks, groups, samples, tokens (policy-generated completion tokens), duplicates (admissions ignored because
      the lease was already admitted: a re-run chunk);
    - busy_s: summed chunk time (a chunk's leases run concurrently, so a chunk counts its longest lease);
    - lent_s: the part of busy_s in which the service's engines also ran on threads that a waiting trainer on its
      host lent (`astratk.idle_cores`);
      tasks_per_s, tokens_per_s = tasks / busy_s, tokens / busy_s: the service's speed while it works;
    - version_lag_mean / _max: the policy's version at admission minus the group's version;
    - first_version: the lowest version in the service's first admitted chunk; first_synced_version: the version its
      engines held when that chunk started generating (a joining worker catches up first, so these are equal and
      recent, not 0).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[str, dict[str, Any]] = {}

    def add(self, chunk: Mapping[str, Mapping[str, Any]]) -> None:
        with self._lock:
            for name, c in chunk.items():
                row = self._rows.get(name)
                if row is None:
                    synced = c.get("synced_versions") or {}
                    row = self._rows[name] = {
                        "hardware": str(c.get("hardware", "default")), "tasks": 0.0, "groups_admitted": 0.0,
                        "duplicates": 0.0, "samples": 0.0, "tokens": 0.0, "busy_s": 0.0, "lent_s": 0.0,
                        "lag_sum": 0.0,
                        "lag_n": 0.0, "version_lag_max": 0.0,
                        "first_version": float(min(c["versions"])) if c.get("versions") else -1.0,
                        "first_synced_version": float(min(synced.values())) if synced else -1.0}
                row["tasks"] += c["leases"]
                row["groups_admitted"] += c["groups_admitted"]
                row["duplicates"] += c["duplicates"]
                row["samples"] += c["samples"]
                row["tokens"] += c["tokens"]
                row["busy_s"] += c["seconds"]
                row["lent_s"] += c.get("lent_s", 0.0)
                lags = c.get("lags") or []
                row["lag_sum"] += sum(lags)
                row["lag_n"] += len(lags)
                row["version_lag_max"] = max([row["version_lag_max"], *lags])

    def by_service(self) -> dict[str, dict[str, Any]]:
        """service name -> its metrics (floats, plus "hardware": its class)."""
        with self._lock:
            rows = {k: dict(v) for k, v in self._rows.items()}
        for row in rows.values():
            busy = row["busy_s"]
            row["tasks_per_s"] = row["tasks"] / busy if busy > 0 else 0.0
            row["tokens_per_s"] = row["tokens"] / busy if busy > 0 else 0.0
            row["version_lag_mean"] = row.pop("lag_sum") / row["lag_n"] if row["lag_n"] else 0.0
            del row["lag_n"]
        return rows

    def by_hardware(self) -> dict[str, dict[str, float]]:
        """hardware class -> services, tasks, and the mean per-service tasks/s and tokens/s of that class."""
        out: dict[str, dict[str, float]] = {}
        for row in self.by_service().values():
            h = out.setdefault(row["hardware"], {"services": 0.0, "tasks": 0.0, "tasks_per_s": 0.0,
                                                 "tokens_per_s": 0.0, "version_lag_max": 0.0})
            h["services"] += 1
            h["tasks"] += row["tasks"]
            h["tasks_per_s"] += row["tasks_per_s"]
            h["tokens_per_s"] += row["tokens_per_s"]
            h["version_lag_max"] = max(h["version_lag_max"], row["version_lag_max"])
        for h in out.values():
            h["tasks_per_s"] /= h["services"]
            h["tokens_per_s"] /= h["services"]
        return out


def task_accounting(data: Mapping[str, float]) -> dict[str, float]:
    """Where every leased task went, from the data layer's counters (`DataLayer.metrics()`).

    A lease id is created once per task (`leases_issued` counts re-issues too, `leases_reissued` only those). Each id
    ends in exactly one place (`astratk.dataflow.leases`): admitted (`tasks_completed`, once: later results are
    `duplicates_ignored`; a result arriving after its lease was dropped is admitted and the drop taken back), dropped
    after `max_task_attempts` failed or expired attempts (`tasks_dropped_failed`), or still open when the run stopped
    (`leases_outstanding` + `leases_waiting_reissue`). So

        tasks_lost = (leases_issued - leases_reissued) - tasks_completed - tasks_dropped_failed - open

    is exactly 0 unless the data layer lost a lease (the model checker, tests/unit/test_datalayer_model.py, checks it
    after every step).
    """
    def get(k: str) -> float:
        return float(data.get(f"data/{k}", 0.0))

    leased = get("leases_issued") - get("leases_reissued")
    still_open = get("leases_outstanding") + get("leases_waiting_reissue")
    lost = leased - get("tasks_completed") - get("tasks_dropped_failed") - still_open
    return {"tasks_leased": leased, "tasks_completed": get("tasks_completed"),
            "tasks_dropped_failed": get("tasks_dropped_failed"), "tasks_open": still_open, "tasks_lost": lost,
            "duplicates_ignored": get("duplicates_ignored")}
