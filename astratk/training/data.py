"""Streaming data for the trainer: an `IterableDataset` over the data layer's per-step batches.

To the trainer the system is "a streaming corpus" (AstraFlow): step k's batch is pulled with
`next_batch(policy_id, k, rank, world_size)` (client-side polling with a timeout), collated to a `TrainBatch` here.
Keep `num_workers=0` (a forked loader worker would poll a copy of the handle's state).

Why tickets: Lightning's fit loop fetches one batch ahead of the step it runs (to detect the end of an iterable).
If the iterator itself waited for data, step k could not start until step k+1's rollouts had arrived: one version of
extra staleness and a misattributed wait. So the iterator yields a cheap `StepTicket`, and the data module resolves
it in `on_before_batch_transfer`, which Lightning calls right before the step that uses it.

When the batch will not come, the wait ends and so does the fit, cleanly (its hooks run, metrics are kept): at the
trainer's time limit (`trainer.max_time_s`, Lightning's `Timer`: a normal end), or after `trainer.batch_timeout_s`
(the stream is *starved*: `stop_reason` says why in words, from the data layer's drop counters). The data module then
hands the step an `EndOfStream` instead of a batch, and sets `trainer.should_stop`; `PolicyModule` ends the epoch on
it, so nothing trains or publishes for that step. Under data parallelism every rank ends if any rank does.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from astratk.dataflow.client import BatchTimeout, DataLayerClient
from astratk.dataflow.drops import starvation_reason
from astratk.idle_cores import IdleMarker
from astratk.records import TrainBatch
from astratk.training._pl import pl
from astratk.training.collate import collate


@dataclass(frozen=True)
class StepTicket:
    step: int


@dataclass(frozen=True)
class EndOfStream:
    """Given to a step instead of its batch when the batch will not come: the fit ends there. `reason` says why in
    words when the stream starved; None at the trainer's time limit (a normal end)."""

    step: int
    reason: str | None = None

    def to(self, *args: Any, **kwargs: Any) -> EndOfStream:
        """Lightning moves batches to the device with `.to`; there is nothing to move."""
        return self


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
        self.stop_reason: str | None = None  # why the stream starved, in words (None: it did not)
        self.waiting_since: float | None = None  # time.monotonic() when the current wait for a batch began
        # a file whose appearance ends a wait for a batch (the run asked its trainers to stop: `Run.stop()`, or a run
        # that found it has nothing to train); set by `build.callbacks` to the trainer's STOP file
        self.stop_file: Path | None = None
        # held while waiting for a batch: the rollout workers on this host may use this trainer's cores meanwhile
        # (`astratk.idle_cores`); set by the run that starts the trainer, None: lend nothing
        self.idle_marker: IdleMarker | None = None

    def __iter__(self) -> Iterator[StepTicket]:
        step = self.start_step
        while self.max_steps is None or step < self.max_steps:
            yield StepTicket(step)
            step += 1

    def resolve(self, ticket: StepTicket, time_left: float | None = None) -> TrainBatch | EndOfStream:
        """Wait for the ticket's step batch and collate it; or, when it does not come within `timeout_s` (the stream
        starved: `stop_reason` says why) or `time_left` seconds (the trainer's time limit), an `EndOfStream`."""
        start = time.perf_counter()
        self.waiting_since = time.monotonic()
        try:
            with self.idle_marker.waiting() if self.idle_marker is not None else contextlib.nullcontext():
                groups = self._wait(ticket.step, time_left)
        finally:
            self.waiting_since = None
            self.last_wait_s = time.perf_counter() - start
            self.total_wait_s += self.last_wait_s
        if isinstance(groups, EndOfStream):
            return groups
        self.group_ids.extend(g.group_id for g in groups)
        return collate(groups, self.pad_id)

    def _wait(self, step: int, time_left: float | None) -> list[Any] | EndOfStream:
        """The step's groups, polled; the data layer's counters are read only when the batch is not there at once, so
        that a starved wait can say what became of the data meanwhile (`starvation_reason`)."""
        dl, args = self.datalayer, (self.policy_id, step, self.rank, self.world_size)
        groups = dl.next_batch(*args)
        if groups is not None:
            return groups
        before = (dl.metrics(), dl.drops())
        deadline = None if time_left is None else time.monotonic() + max(0.0, time_left)
        try:
            stop = None if self.stop_file is None else self.stop_file.exists
            groups = dl.wait_batch(*args, timeout=self.timeout_s, deadline=deadline, stop=stop)
        except BatchTimeout as e:
            self.stop_reason = starvation_reason(self.policy_id, step, e.waited, before, (dl.metrics(), dl.drops()))
            return EndOfStream(step, self.stop_reason)
        return EndOfStream(step) if groups is None else groups


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
        if trainer is None:
            return self.stream.resolve(batch)
        if batch.step != trainer.global_step:  # one batch per optimiser step
            raise RuntimeError(f"data stream is at step {batch.step} but the trainer at step {trainer.global_step}; "
                               "a checkpoint restore did not reach the data module")
        out = self.stream.resolve(batch, _time_left(trainer))
        # every rank ends together (a rank that got its share drops it): DDP's collectives need them all
        if trainer.strategy.reduce_boolean_decision(isinstance(out, EndOfStream), all=False):
            trainer.should_stop = True
            if not isinstance(out, EndOfStream):  # not trained: not among the groups this trainer trained on
                del self.stream.group_ids[len(self.stream.group_ids) - out.n_groups:]
                out = EndOfStream(batch.step)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Saved in trainer checkpoints: the step whose batch the stream asks for next."""
        trainer = self.trainer
        return {"next_step": trainer.global_step if trainer is not None else self.stream.start_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.start_step = int(state["next_step"])


def _identity(item: Any) -> Any:
    return item


def _time_left(trainer: pl.Trainer) -> float | None:
    """Seconds before the trainer's time limit (its `Timer` callback: `max_time`, which counts a resumed fit's
    earlier time); None without one."""
    for cb in trainer.callbacks:
        if isinstance(cb, pl.callbacks.Timer) and (left := cb.time_remaining()) is not None:
            return left
    return None
