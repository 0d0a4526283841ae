"""The acquisition loop (DESIGN §4 steps 1-4): keeps the rollout pipeline full.

It leases tasks from the data layer and submits `rollout -> score -> admit` chains with resource requirements, so Dask
places them on workers labelled for the policies involved, balances load, and resubmits work from workers that die.
It keeps `max_inflight_chunks` chains per rollout worker in flight, and counts workers on every pass, so workers that
join or leave change the target without any system code. A chain that fails releases its leases for re-issue; a lost
worker's leases expire and are re-issued by the data layer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any

from astratk.dataflow.handle import DataLayerHandle
from astratk.rollout.service import RunContext
from astratk.rollout.tasks import admit_task, rollout_task, score_task
from astratk.runtime.cluster import count_workers

log = logging.getLogger(__name__)


class Acquisition:
    def __init__(self, client: Any, datalayer: DataLayerHandle, ctx: RunContext) -> None:
        self.client = client
        self.datalayer = datalayer
        self.ctx = ctx
        self.spec = ctx.spec
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="astratk-acquisition", daemon=True)
        self._inflight: dict[Any, list[tuple[str, int]]] = {}  # admit future -> its (lease id, attempt) pairs
        self._policies = sorted({p.policy_id for p in self.spec.policies})
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

    def _submit(self) -> bool:
        leases = self.datalayer.call("lease", self.spec.rollout.tasks_per_chunk)
        if not leases:
            return False
        resources = {f"rollout_{p}": 1 for p in self._policies}
        rolled = self.client.submit(rollout_task, self.ctx, leases, resources=resources, pure=False,
                                    key=f"rollout-{self.ctx.run_id}-{leases[0].lease_id}-{leases[0].attempt}")
        scored = self.client.submit(score_task, self.ctx, rolled, resources={"score": 1}, pure=False)
        admitted = self.client.submit(admit_task, scored, self.datalayer, pure=False)
        self._inflight[admitted] = [(lease.lease_id, lease.attempt) for lease in leases]
        self.counts["acquisition/chunks_submitted"] += 1
        return True

    def _loop(self) -> None:
        from distributed import wait

        while not self._stop.is_set():
            try:
                target = self.spec.rollout.max_inflight_chunks * max(1, self._rollout_workers())
                while len(self._inflight) < target and self._submit():
                    pass
                if not self._inflight:
                    time.sleep(0.2)  # back-pressure: the buffer is full
                    continue
                try:
                    done, _ = wait(list(self._inflight), timeout=0.5, return_when="FIRST_COMPLETED")
                except TimeoutError:
                    continue
                for future in done:
                    self._collect(future)
            except Exception as e:  # keep acquiring: one bad chunk must not stop the run; errors are reported
                if self._stop.is_set():
                    break
                self.counts["acquisition/loop_errors"] += 1
                self.errors.append(repr(e))
                log.exception("acquisition loop error")
                time.sleep(1.0)

    def _collect(self, future: Any) -> None:
        leases = self._inflight.pop(future)
        if future.status == "finished":
            for k, v in future.result().items():
                self.counts[f"acquisition/{k}"] += v
            return
        self.counts["acquisition/chunks_failed"] += 1
        exc = future.exception() if future.status == "error" else future.status
        self.errors.append(f"rollout chunk {leases[0][0]}..: {exc!r}")
        log.warning("rollout chunk failed (%s); releasing %d leases for re-issue", exc, len(leases))
        self.datalayer.call("release", leases, "error")
