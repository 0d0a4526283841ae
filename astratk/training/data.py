"""Streaming data for the trainer: an `IterableDataset` over the data layer's per-step batches.

To the trainer the system is "a streaming corpus" (AstraFlow): step k's batch is pulled with
`next_batch(policy_id, k, rank, world_size)` (client-side polling with a timeout), collated to a `TrainBatch` here.
Keep `num_workers=0` (TRAPS: a forked loader worker would poll a copy of the handle's state).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import lightning.pytorch as pl
from torch.utils.data import DataLoader, IterableDataset

from astratk.dataflow.handle import DataLayerHandle
from astratk.records import TrainBatch
from astratk.training.collate import collate


class GroupStream(IterableDataset):
    def __init__(self, datalayer: DataLayerHandle, policy_id: str, pad_id: int, *, start_step: int = 0,
                 max_steps: int | None = None, timeout_s: float = 300.0, rank: int = 0, world_size: int = 1,
                 stop: threading.Event | None = None) -> None:
        self.datalayer = datalayer
        self.policy_id = policy_id
        self.pad_id = pad_id
        self.start_step = start_step
        self.max_steps = max_steps
        self.timeout_s = timeout_s
        self.rank, self.world_size = rank, world_size
        self.stop = stop
        self.last_wait_s = 0.0  # time the trainer waited for the latest batch (the data-wait metric)
        self.total_wait_s = 0.0

    def __iter__(self) -> Iterator[TrainBatch]:
        step = self.start_step
        while self.max_steps is None or step < self.max_steps:
            start = time.perf_counter()
            groups = self.datalayer.wait_batch(self.policy_id, step, self.rank, self.world_size,
                                               timeout=self.timeout_s, stop=self.stop)
            if groups is None:
                return
            self.last_wait_s = time.perf_counter() - start
            self.total_wait_s += self.last_wait_s
            yield collate(groups, self.pad_id)
            step += 1


class RolloutDataModule(pl.LightningDataModule):
    def __init__(self, stream: GroupStream) -> None:
        super().__init__()
        self.stream = stream

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.stream, batch_size=None, num_workers=0, collate_fn=_identity)


def _identity(batch: TrainBatch) -> TrainBatch:
    return batch
