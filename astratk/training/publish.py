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
"""

from __future__ import annotations

import time

from astratk.dataflow.client import DataLayerClient
from astratk.records import WeightRef
from astratk.training._pl import pl
from astratk.weights.store import WeightStore


class WeightPublisher(pl.Callback):
    def __init__(self, store: WeightStore, datalayer: DataLayerClient, policy_id: str, every: int = 1,
                 publish_skipped: bool = False) -> None:
        if every < 1:
            raise ValueError(f"publish every must be >= 1 step, got {every}")
        self.store = store
        self.datalayer = datalayer
        self.policy_id = policy_id
        self.every = every
        self.publish_skipped = publish_skipped  # the synchronous mode waits for every version (module docstring)
        self.refs: list[WeightRef] = []

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

    def publish(self, pl_module: pl.LightningModule, version: int | None = None) -> WeightRef:
        """Publish the module's weights as `version` (default: the one after its own)."""
        version = pl_module.policy_version + 1 if version is None else version
        start = time.perf_counter()
        ref = self.store.publish(self.policy_id, version, pl_module.weights())
        seconds = time.perf_counter() - start
        self.datalayer.publish_version(ref)
        pl_module.policy_version = version
        self.refs.append(ref)
        prefix = f"weights/{self.policy_id}/"
        pl_module.step_metrics.update({prefix + "publish_s": seconds, prefix + "publish_mb": ref.nbytes / 1e6,
                                       prefix + "publish_delta": float(ref.kind == "delta")})
        return ref
