"""Held-out evaluation at regular wall-clock intervals, as Dask tasks on rollout workers.

Each evaluation runs the env's held-out tasks greedily at one published version on the service's separate eval
engine. Its record keeps the version's publication time, so "training time at which accuracy first reached X" is
measured from when those weights existed, not from when the evaluation happened to finish.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from astratk.rollout.service import RunContext
from astratk.rollout.tasks import evaluate_task
from astratk.weights.store import WeightStore


class Evaluator:
    def __init__(self, client: Any, ctx: RunContext, policy_id: str, store: WeightStore) -> None:
        self.client = client
        self.ctx = ctx
        self.policy_id = policy_id
        self.store = store
        self.espec = ctx.spec.eval
        self.records: list[dict[str, float]] = []
        self.train_t0: float | None = None  # time.time() when training started
        self.on_record = None  # optional callable(record) for live progress
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def evaluate(self, version: int | None = None) -> dict[str, float]:
        """Evaluate `version` now, blocking; the record is kept and returned. `None` evaluates whatever version is
        newest when the task starts on its worker (it may queue behind a rollout chunk meanwhile, and pinning a
        version at submission could see it pruned from the store by then)."""
        future = self.client.submit(evaluate_task, self.ctx, self.policy_id, version, self.espec.max_tasks,
                                    resources={f"rollout_{self.policy_id}": 1}, priority=100, pure=False)
        try:
            out = future.result(timeout=self.espec.timeout_s)
        except TimeoutError:
            future.cancel()
            which = "the newest version" if version is None else f"v{version}"
            raise TimeoutError(f"held-out evaluation of policy {self.policy_id!r} {which} took more than "
                               f"{self.espec.timeout_s:.0f}s (eval.timeout_s)") from None
        t0 = self.train_t0
        record = {**out, "evaluated_at": time.time(),
                  "train_time_s": (out["published_at"] - t0) if t0 is not None else float("nan")}
        with self._lock:
            self.records.append(record)
        if self.on_record is not None:
            self.on_record(record)
        return record

    def start(self) -> Evaluator:
        self._thread = threading.Thread(target=self._loop, name="astratk-eval", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        last = max((int(r["version"]) for r in self.records), default=-1)
        while not self._stop.wait(self.espec.interval_s):
            ref = self.store.latest(self.policy_id)
            if ref is None or ref.version == last:
                continue
            try:
                last = int(self.evaluate(None)["version"])
            except Exception as e:  # noqa: BLE001 - a failed periodic eval is reported, and the next interval tries again
                with self._lock:
                    self.records.append({"version": float(ref.version), "accuracy": float("nan"), "error": 1.0})
                print(f"held-out evaluation of v{ref.version} failed: {e!r}")
