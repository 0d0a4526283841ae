"""`WeightPublisher`: every k optimiser steps, publish the policy's weights and tell the data layer.

Under data parallelism only global rank 0 writes and tells the data layer; every rank moves its `policy_version`.
Under FSDP every rank joins the gather of the full state (`PolicyModule.weights`), which only rank 0 receives.
The trainer blocks only while it copies the weights out and writes them to the store (a full snapshot, or a sparse
delta against the previous publication: `astratk.weights.store`); rollout services pull them at their next safe point
(data path step 6). On a publishing step the step's metrics gain `weights/<policy>/publish_s` (seconds the trainer
was blocked), `publish_mb` (bytes written) and `publish_delta` (1 for a delta version, 0 for a full snapshot).

A step the divergence guard skipped (`PolicyModule.step_skipped`: no update) is not published. Versions still count
steps: a publication is version `global_step // every`, so a version number skipped marks a skipped step, and a
resumed run's checkpoint step, the data layer's staleness and the last version (`max_steps // every`) mean what
they did. Two exceptions publish the unchanged weights under the step's version, because something waits for it: the
synchronous mode (the data layer serves step k only once version k exists) and the last step (trainer jobs'
deployments and version barriers wait for the last version).

In the background (`background=True`, `trainer.publish_in_background`, the default): the trainer only copies the
weights out (`PolicyModule.weights`, on the training thread, so the next optimiser step cannot tear them) and a
publishing thread writes them and tells the data layer, while the next step computes. One publication is in flight
at a time: a step that finishes before the previous write waits for it, so versions reach the store in order and
memory holds at most one extra copy. The trainer's own version moves at once. A write that failed raises on the
training thread at the next publication or at the end of training; the end of training, a checkpoint and an
exception all wait for the write in flight, so a checkpoint of step k never precedes version k in the store.
`publish_s` is then the time the trainer was blocked (the copy, plus any wait), and `publish_mb` / `publish_delta`
describe the latest publication that had finished by then. The synchronous mode publishes inline: its next batch
waits for the version anyway.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from astratk.dataflow.client import DataLayerClient
from astratk.records import WeightRef
from astratk.training._pl import pl
from astratk.weights.store import WeightStore


class WeightPublisher(pl.Callback):
    def __init__(self, store: WeightStore, datalayer: DataLayerClient, policy_id: str, every: int = 1,
                 publish_skipped: bool = False, background: bool = False) -> None:
        if every < 1:
            raise ValueError(f"publish every must be >= 1 step, got {every}")
        self.store = store
        self.datalayer = datalayer
        self.policy_id = policy_id
        self.every = every
        self.publish_skipped = publish_skipped  # the synchronous mode waits for every version (module docstring)
        self.background = background and not publish_skipped
        self.refs: list[WeightRef] = []
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._in_flight: concurrent.futures.Future | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx
                           ) -> None:
        if trainer.global_step % self.every != 0:
            return
        last = trainer.max_steps is not None and 0 < trainer.max_steps <= trainer.global_step
        if getattr(pl_module, "step_skipped", False) and not (self.publish_skipped or last):
            return
        version = max(pl_module.policy_version + 1, trainer.global_step // self.every)
        if trainer.is_global_zero:
            self.publish(pl_module, version)
            return
        # Data-parallel ranks hold the same weights: one writer; the others only move their version. Under FSDP
        # each rank holds a shard, and the gather that gives rank 0 the whole state is a collective they join.
        if pl_module._sharded_root() is not None:
            pl_module.weights()
        pl_module.policy_version = version

    def publish(self, pl_module: pl.LightningModule, version: int | None = None) -> WeightRef | None:
        """Publish the module's weights as `version` (default: the one after its own). Returns the reference, or
        None when the write went to the background (it lands in `refs` when done; `flush` waits for it)."""
        version = pl_module.policy_version + 1 if version is None else version
        start = time.perf_counter()
        state = pl_module.weights()
        if not self.background:
            ref = self._write(version, state)
            self._record(pl_module, time.perf_counter() - start, ref)
            pl_module.policy_version = version
            return ref
        self.flush()  # one write in flight: the previous one, in order; its failure raises here
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"publish-{self.policy_id}")
        self._in_flight = self._executor.submit(self._write, version, state)
        pl_module.policy_version = version
        self._record(pl_module, time.perf_counter() - start, self.refs[-1] if self.refs else None)
        return None

    def flush(self, timeout_s: float = 600.0) -> None:
        """Wait for the write in flight; raise its error, if it failed."""
        pending, self._in_flight = self._in_flight, None
        if pending is None:
            return
        try:
            pending.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"publishing {self.policy_id}'s weights to {self.store.url} took more than "
                               f"{timeout_s:.0f}s") from None

    def _write(self, version: int, state: dict[str, Any]) -> WeightRef:
        ref = self.store.publish(self.policy_id, version, state)
        self.datalayer.publish_version(ref)
        self.refs.append(ref)
        return ref

    def _record(self, pl_module: pl.LightningModule, blocked_s: float, ref: WeightRef | None) -> None:
        prefix = f"weights/{self.policy_id}/"
        metrics = {prefix + "publish_s": blocked_s}
        if ref is not None:
            metrics.update({prefix + "publish_mb": ref.nbytes / 1e6, prefix + "publish_delta": float(ref.kind == "delta")})
        pl_module.step_metrics.update(metrics)

    # the write in flight finishes before training ends, a checkpoint is saved, or an exception propagates
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.flush()

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self.flush()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:
            self.flush()
        except Exception:  # noqa: BLE001, S110 - the fit's own exception is the one to report
            pass

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
