"""`DataLayer`: the one stateful coordinator between rollout services and trainers
(docs/architecture.md, "Data layer").

A facade over three parts, one per point of AstraFlow's data path, each with its own `state_dict`:
- `LeaseBook` (`astratk.dataflow.leases`): task leases, their deadlines, re-issues and drops; the
  train stream and curation (a new task is leased only if every curator accepts it; refusals
  counted per curator);
- `Admission` (`astratk.dataflow.admission`): scoring checks, advantages, curator feedback, filters;
- `BatchServer` (`astratk.dataflow.batches`): per-policy buffers and versions, staleness, the
  version barrier, replay, order, mixing, and each step's batch, assembled once and sharded per
  rank.
This class composes them and owns what spans them: back-pressure, synchronous rounds, and snapshots.

Every method is synchronous, short and non-blocking, because Dask runs an actor's synchronous
methods one at a time in one thread: waiting for data happens client-side
(`astratk.dataflow.client`), never inside the actor.

Back-pressure: new tasks are leased while any policy's buffered groups plus leases in flight are
below `prefetch_steps` steps' worth (rolling out further ahead only produces samples that go stale);
re-issues are never held back.

Synchronous mode (`dataflow.synchronous`): new tasks are leased in rounds, only when every policy
has published the version of every batch served so far (acquisition in lock-step with training); a
round's results are held until the whole round is in (or dropped after failures), then admitted in
lease order. With rollouts seeded per lease and episode (the rollout service does this), the batches
a run sees are then a function of the seed alone; staleness is 0. With several policies, a round's
batches are trained one policy after the other, in the spec's order.

Snapshot: `state_dict()` holds all three parts and every stage; it pickles. With a snapshot store
(`astratk.dataflow.snapshots`) the layer writes it when a policy publishes a trainer-checkpoint
version (before any lease of that version: the pair a resumed run needs), when every
`snapshot.every_steps`-th batch is served, and on demand. `restore` builds a layer from a snapshot
for a resumed run or a replacement actor: leases that were out are re-issued at once (their results,
if they ever arrive, went to the lost layer).

Metric keys are `"data/{policy_id}/{name}"` for per-policy counters and `"data/{name}"` for
task-level ones; stage metrics are `"data/stage/{stage}/{name}"` (curators, filters) and
`"data/{policy_id}/stage/{stage}/{name}"` (serving). Extending: write a stage
(`astratk.dataflow.stages`), not a branch here.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from astratk.dataflow.admission import Admission
from astratk.dataflow.advantages import get_advantage
from astratk.dataflow.batches import BatchServer, PolicyServing
from astratk.dataflow.leases import LeaseBook
from astratk.dataflow.snapshots import SnapshotEntry, SnapshotStore, same_keys
from astratk.dataflow.stages.base import Curator, Stage
from astratk.dataflow.stages.filters import ZeroVariance
from astratk.dataflow.stages.serving import Staleness
from astratk.records import (
    DROP_STAGES,
    AdmitOutcome,
    AdmitReport,
    Drop,
    Group,
    Lease,
    Task,
    WeightRef,
    opened,
)

if TYPE_CHECKING:
    from astratk.spec import PolicySpec, RunSpec

__all__ = ["DataLayer", "Lease"]

# bump when state_dict() changes shape
STATE_FORMAT = 3


def _named(stages: Iterable[Stage]) -> dict[str, Stage]:
    """Stages by metric name: their `name`, suffixed `_2`, `_3`... when a name repeats."""
    out: dict[str, Stage] = {}
    for st in stages:
        name, i = st.name, 1
        while name in out:
            i += 1
            name = f"{st.name}_{i}"
        out[name] = st
    return out


class DataLayer:
    """Example (in-process; `astratk.runtime` starts it as a Dask actor on a cluster):

    >>> from astratk.spec import RunSpec
    >>> dl = DataLayer(RunSpec())
    >>> [lease] = dl.lease(1)
    >>> dl.next_batch("main", step=0, rank=0, world_size=1) is None  # nothing admitted yet
    True
    """

    def __init__(self, spec: RunSpec, clock: Callable[[], float] = time.monotonic,
                 snapshot_url: str | None = None) -> None:
        spec = opened(spec)  # started as an actor, the spec arrives shipped (the scheduler saw bytes only)
        self.spec = spec
        self._clock = clock
        d = spec.dataflow
        self._sync = d.synchronous
        url = snapshot_url or d.snapshot.url
        self._snapshots = SnapshotStore(url, d.snapshot.keep_last) if url else None
        self._checkpoint_every = {p.policy_id: p.trainer.checkpoint_every for p in spec.policies}
        routes = spec.role_routes()
        # curators learn from the first role's rewards (the solver's)
        self._curated_role = spec.env.roles[0]
        self._curated_policy = routes.get(self._curated_role)
        # Stages are deep-copied: the spec holds templates, and may be reused or shared with another
        # data layer.
        self._curators: dict[str, Curator] = _named(  # type: ignore[assignment]
            copy.deepcopy(d.curators))
        filters = list(d.filters)
        if d.filter_zero_variance and not any(isinstance(f, ZeroVariance) for f in filters):
            filters.insert(0, ZeroVariance())
        self._server = BatchServer({p.policy_id: _policy_serving(spec, p) for p in spec.policies},
                                   synchronous=d.synchronous, version_barrier=d.version_barrier)
        self._book = LeaseBook(lambda: iter(spec.env.tasks("train")), routes,
                               timeout_s=d.lease_timeout_s, max_attempts=d.max_task_attempts,
                               clock=clock, max_curator_skips=d.max_curator_skips)
        self._admission = Admission([p.policy_id for p in spec.policies],
                                    get_advantage(d.advantage),
                                    _named(copy.deepcopy(filters)),  # type: ignore[arg-type]
                                    sink=self._server.add, curated_role=self._curated_role,
                                    learn=self._learn, frozen=[f.name for f in spec.frozen])
        # the facade's own: snapshots, restores
        self._counts: Counter[str] = Counter()
        self._trainers: dict[str, tuple[float, float]] = {}  # policy -> (attached 1/0, step at detaching)

    # -------------------------------------------------------------------------------------- leasing
    def lease(self, n: int) -> list[Lease]:
        """Up to `n` task leases: expired leases first, then new tasks. Fewer (or none) under
        back-pressure."""
        self._expire()
        # a whole round at once, whatever was asked: chunks, hence engine batches, are then cut from
        # the round the same way in every run (batching moves log-probs); mid-round only its retries
        if self._sync:
            in_round = bool(self._book.out or self._admission.held or self._book.waiting)
            n = self._book.waiting if in_round else self._round_room()
            new_room = 0 if in_round else n
        else:
            new_room = self._server.lease_room() - self._book.in_flight
        return self._book.lease(n, new_room, self._curate)

    def _round_room(self) -> int:
        """Synchronous mode, between rounds: once every policy has published the version of every
        batch served, a new round of the largest shortfall of fresh groups over the policies."""
        if not self._server.all_published():
            # the trainer has not published the weights of the last batch yet
            return 0
        room = 0
        tasks = self._book.counts["data/tasks_completed"]
        for pid in self._server.policies:
            short = self._server.round_short(pid)
            # over-lease by the inverse of the share of tasks that kept a group (at most 4x):
            # filters drop groups, and a round per drop would crawl
            if short > 0:
                kept = self._admission.admitted(pid)
                room = max(room, math.ceil(short * min(4.0, tasks / kept if kept
                                                        else (4.0 if tasks else 1.0))))
        return room

    def _curate(self, task: Task) -> str | None:
        """The name of the first curator that refuses `task`, or None when all accept it."""
        version = self._server.version(self._curated_policy) if self._curated_policy else 0
        for name, curator in self._curators.items():
            if not curator.should_submit(task, version):
                return name
        return None

    def _learn(self, task: Task, rewards: list[float], version: int) -> None:
        for curator in self._curators.values():
            curator.update(task, rewards, version)

    def _expire(self) -> None:
        if self._book.expire():
            self._maybe_flush_round()

    def release(self, leases: Sequence[tuple[str, int]], reason: str = "error") -> None:
        """A rollout for these (lease id, attempt) pairs failed: re-issue them now instead of at
        their deadline (only the attempt that failed: a newer re-issue still running is left
        alone)."""
        self._book.release(leases, reason)
        self._maybe_flush_round()

    # ------------------------------------------------------------------------------------ admission
    def admit(self, lease_id: str, groups: Sequence[Group]) -> AdmitOutcome:
        """Admit the groups rolled out for one lease (one group per role). Idempotent by lease id:
        see `astratk.dataflow.leases` for what a duplicate, late or unknown result is."""
        task_id = groups[0].task.task_id if groups else None
        status = self._book.close(lease_id, task_id, accept_late=not self._sync)
        if status not in ("new", "late"):
            return AdmitOutcome(lease_id, status)
        if self._sync:
            self._admission.hold(lease_id, groups)
            return AdmitOutcome(lease_id, "held", self._maybe_flush_round())
        return AdmitOutcome(lease_id, status, self._admission.admit(groups))

    def drop_leases(self, items: Sequence[tuple[str, str]]) -> list[str]:
        """Close leases whose task cannot be rolled out, (lease id, reason) each (the rollout service
        found e.g. `prompt_too_long` before generating): no group, the task counted dropped with its
        id (`LeaseBook.drop`), never re-issued. Idempotent by lease id, as `admit` is; returns each
        lease's close status."""
        statuses = [self._book.drop(lease_id, reason, accept_late=not self._sync)
                    for lease_id, reason in items]
        self._maybe_flush_round()
        return statuses

    def admit_many(self, items: Sequence[tuple[str, Sequence[Group]]]) -> AdmitReport:
        """`admit` for several leases in one call (one actor round trip per rollout chunk, not one
        per lease), plus the policies' versions after admission."""
        outcomes = tuple(self.admit(lease_id, groups) for lease_id, groups in items)
        return AdmitReport(outcomes, self._server.versions())

    def _maybe_flush_round(self) -> int:
        """Synchronous mode: once nothing of the round is out or waiting for re-issue, admit it in
        lease order."""
        if not self._admission.held or self._book.in_flight:
            return 0
        return self._admission.flush()

    # -------------------------------------------------------------------------------------- weights
    def publish_version(self, ref: WeightRef) -> None:
        moved = self._server.publish(ref)
        if moved and ref.policy_id == self._curated_policy:
            for curator in self._curators.values():
                curator.on_version(ref.version)
        every = self._checkpoint_every.get(ref.policy_id)
        if moved and every and ref.version % every == 0 and self._snapshots is not None:
            # the trainer checkpoints this step: the matching state, before any lease
            self.snapshot("checkpoint")

    def latest(self, policy_id: str) -> WeightRef | None:
        return self._server.latest(policy_id)

    def version(self, policy_id: str) -> int:
        return self._server.version(policy_id)

    def versions(self) -> dict[str, int]:
        return self._server.versions()

    # -------------------------------------------------------------------------------------- serving
    def next_batch(self, policy_id: str, step: int, rank: int = 0,
                   world_size: int = 1) -> list[Group] | None:
        """This rank's share of `step`'s batch, or None if not enough fresh groups are buffered yet
        (or the batch is held: paused, version barrier, synchronous order)."""
        cached = self._server.is_cached(policy_id, step)
        groups = self._server.next_batch(policy_id, step, rank, world_size)
        every = self.spec.dataflow.snapshot.every_steps
        if (groups is not None and not cached and self._snapshots is not None and every
                and (step + 1) % every == 0):
            # the state with this batch served (and cached for its retries)
            self.snapshot("periodic")
        return groups

    def set_paused(self, paused: bool) -> None:
        """Pause (or resume) serving new batches: trainers wait, and their batch timeout stops while
        paused."""
        self._server.paused = bool(paused)

    def is_paused(self) -> bool:
        return self._server.paused

    # ------------------------------------------------------------------------------------ trainers
    def trainer_attached(self, policy_id: str) -> None:
        """A trainer of `policy_id` attached (`astratk train fit` calls it): its metrics say so
        (`data/<policy>/trainer_attached` 1), and a deployment stops saying it waits for one."""
        self._trainers[policy_id] = (1.0, -1.0)

    def trainer_detached(self, policy_id: str, step: int) -> None:
        """The trainer of `policy_id` ended (finished, stopped or failed) after `step` optimiser steps: a deployment
        then says so once, instead of reporting a trainer starving for batches that no one asks for."""
        self._trainers[policy_id] = (0.0, float(step))

    # -------------------------------------------------------------------------------------- metrics
    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {k: float(v) for k, v in self._counts.items()}
        out.update(self._book.metrics())
        out.update(self._admission.metrics())
        out.update(self._server.metrics())
        for name, st in self._curators.items():
            out.update({f"data/stage/{name}/{k}": v for k, v in st.metrics().items()})
        for pid, (attached, step) in self._trainers.items():
            out[f"data/{pid}/trainer_attached"] = attached
            if not attached:
                out[f"data/{pid}/trainer_detached_step"] = step
        return out

    def drops(self) -> list[Drop]:
        """Every drop so far, as values, in data-path order (stage, then policy, then reason)."""
        rows = [*self._book.drops.records(), *self._admission.drops.records(),
                *self._server.drops.records()]
        return sorted(rows, key=lambda d: (DROP_STAGES.index(d.stage), d.policy, d.reason))

    def status(self) -> str:
        m = self.metrics()
        return ", ".join(f"{k}={v:g}" for k, v in sorted(m.items()))

    # ------------------------------------------------------------------------------------- snapshot
    def state_dict(self, batches_kept: int | None = None) -> dict[str, Any]:
        """Everything needed to continue where this layer stands; picklable. With `batches_kept`,
        only each policy's newest `batches_kept` served batches are included (a retry only ever asks
        for the current step's)."""
        return {"format": STATE_FORMAT, "leases": self._book.state_dict(),
                "admission": self._admission.state_dict(),
                "serving": self._server.state_dict(batches_kept), "counts": dict(self._counts),
                "curators": {k: st.state_dict() for k, st in self._curators.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()` taken from a data layer built from the same spec (same policies
        and stages)."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"data layer state has format {state.get('format')!r}; this version "
                             f"reads {STATE_FORMAT}")
        same_keys("curators", state["curators"], self._curators)
        self._server.load_state_dict(state["serving"])
        self._admission.load_state_dict(state["admission"])
        self._book.load_state_dict(state["leases"])
        self._counts = Counter(state["counts"])
        for name, st in self._curators.items():
            st.load_state_dict(state["curators"][name])

    def snapshot(self, kind: str = "on_demand") -> SnapshotEntry:
        """Write the state to the snapshot store now (`kind`: on_demand, periodic, checkpoint,
        final)."""
        if self._snapshots is None:
            raise RuntimeError("this data layer has no snapshot store; give dataflow.snapshot.url "
                               "(a run sets <run dir>/datalayer)")
        start = time.perf_counter()
        entry = self._snapshots.write(self.state_dict(batches_kept=2), kind=kind,
                                      versions=self._server.versions(),
                                      served=self._server.served())
        self._counts[f"data/snapshots_{kind}"] += 1
        self._counts["data/snapshot_seconds"] += time.perf_counter() - start
        return entry

    @classmethod
    def restore(cls, spec: RunSpec, state: dict[str, Any],
                clock: Callable[[], float] = time.monotonic,
                snapshot_url: str | None = None) -> DataLayer:
        """A layer that continues from `state` (a snapshot) in a new process: leases that were out
        are queued for re-issue at once, keeping their lease ids (so a late admission of the lost
        layer's work cannot double them here, and synchronous rounds re-create the same
        rollouts)."""
        layer = cls(spec, clock, snapshot_url)
        layer._resume(state)
        return layer

    def load_snapshot(self, url: str, name: str | None = None) -> dict[str, Any]:
        """`restore` in place, from snapshot `name` (default: the newest intact one) of the store at
        `url`: how a fresh data-layer actor takes over. Returns the snapshot's index row."""
        store = SnapshotStore(url)
        entry = store.latest() if name is None else next(
            (e for e in store.entries() if e.name == name), None)
        if entry is None:
            raise FileNotFoundError(f"no data-layer snapshot {name or ''} in {url}")
        self._resume(store.read(entry))
        return dataclasses.asdict(entry)

    def _resume(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state)
        self._book.requeue_out()
        self._counts["data/restores"] += 1


def _policy_serving(spec: RunSpec, p: PolicySpec) -> PolicyServing:
    d, t = spec.dataflow, p.trainer
    bound = 0 if d.synchronous else (d.max_staleness if t.max_staleness is None
                                     else t.max_staleness)
    return PolicyServing(groups_per_step=t.groups_per_step, publish_every=t.publish_every,
                         final_version=t.max_steps // t.publish_every,
                         prefetch_groups=int(d.prefetch_steps * t.groups_per_step),
                         staleness=Staleness(bound, d.lag_decay), order=copy.deepcopy(d.order),
                         replay=copy.deepcopy(d.replay), mixing=copy.deepcopy(d.mixing),
                         max_steps=t.max_steps)

