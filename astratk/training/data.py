"""Streaming data for the trainer: an `IterableDataset` over the data layer's per-step batches.

To the trainer the system is "a streaming corpus" (AstraFlow): step k's batch is pulled with
`next_batch(policy_id, k, rank, world_size)` (client-side polling with a timeout), collated to a `TrainBatch` here.
Keep `num_workers=0` (a forked loader worker would poll a copy of the handle's state).

Why tickets: Lightning's fit loop fetches one batch ahead of the step it runs (to detect the end of an iterable).
If the iterator itself waited for data, step k could not start until step k+1's rollouts had arrived: one version of
extra staleness and a misattributed wait. So the iterator yields a cheap `StepTicket`, and the data module resolves
it in `on_before_batch_transfer`, which Lightning calls right before the step that uses it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from astratk.dataflow.client import DataLayerClient
from astratk.records import TrainBatch
from astratk.training._pl import pl
from astratk.training.collate import collate


@dataclass(frozen=True)
class StepTicket:
    step: int


class GroupStream(IterableDataset):
    def __init__(self, datalayer: DataLayerClient, policy_id: str, pad_id: int, *, start_step: int = 0,
                 max_steps: int | None = None, timeout_s: float = 300.0, rank: int = 0, world_size: int = 1
                 ) -> None:
        self.datalayer = datalayer
        self.policy_id = policy_id
        self.pad_id = pad_id
        self.start_step = start_step
        self.max_steps = max_steps
        self.timeout_s = timeout_s
        self.rank, self.world_size = rank, world_size
        self.group_ids: list[str] = []  # every group this trainer trained on, in order (exactly-once checks)
        self.last_wait_s = 0.0  # time the trainer waited for the latest batch (the data-wait metric)
        self.total_wait_s = 0.0

    def __iter__(self) -> Iterator[StepTicket]:
        step = self.start_step
        while self.max_steps is None or step < self.max_steps:
            yield StepTicket(step)
            step += 1

    def resolve(self, ticket: StepTicket) -> TrainBatch:
        """Wait for the ticket's step batch (timeout names the wait) and collate it."""
        start = time.perf_counter()
        groups = self.datalayer.wait_batch(self.policy_id, ticket.step, self.rank, self.world_size,
                                           timeout=self.timeout_s)
        self.last_wait_s = time.perf_counter() - start
        self.total_wait_s += self.last_wait_s
        self.group_ids.extend(g.group_id for g in groups)
        return collate(groups, self.pad_id)


class RolloutDataModule(pl.LightningDataModule):
    def __init__(self, stream: GroupStream) -> None:
        super().__init__()
        self.stream = stream

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.stream, batch_size=None, num_workers=0, collate_fn=_identity)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if not isinstance(batch, StepTicket):
            return batch
        trainer = self.trainer
        if trainer is not None and batch.step != trainer.global_step:  # one batch per optimiser step
            raise RuntimeError(f"data stream is at step {batch.step} but the trainer at step {trainer.global_step}; "
                               "a checkpoint restore did not reach the data module")
        return self.stream.resolve(batch)

    def state_dict(self) -> dict[str, Any]:
        """Saved in trainer checkpoints: the step whose batch the stream asks for next."""
        trainer = self.trainer
        return {"next_step": trainer.global_step if trainer is not None else self.stream.start_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.start_step = int(state["next_step"])


def _identity(item: Any) -> Any:
    return item
