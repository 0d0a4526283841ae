"""`DataLayer`: the one stateful coordinator between rollout services and trainers (DESIGN §3, ALGORITHMS §5).

It owns task leasing, admission and per-policy buffers, and serves each trainer step's batch. Every method is
synchronous, short and non-blocking, because Dask runs an actor's synchronous methods one at a time in one thread:
waiting for data happens client-side (`DataLayerHandle.wait_batch`), never inside the actor.

Semantics (AstraFlow's, ALGORITHMS §5):
- Back-pressure: tasks are leased while any policy's buffered groups plus leases in flight are below
  `prefetch_steps` steps' worth; a policy that is not consuming keeps at most 4x that (oldest dropped, counted).
- A lease is one task to roll out, with a deadline. A lease not admitted by its deadline is re-issued with the same
  lease id (so a slow original and its re-issue cannot both be admitted: admission is idempotent by lease id).
  A task whose rollout failed `max_task_attempts` times is dropped (counted).
- Curation: a new task is leased only if every curator accepts it (refusals counted per curator); re-issues are not
  curated again. Curators learn from the curated role's rewards at admission (`astratk.dataflow.stages`).
- Admission: unscored trajectories are dropped (counted); advantages are computed per group and fixed; filters
  (zero-variance by default, length, format) drop groups, counted by reason; the rest join their policy's buffer.
- Serving: a group is stale, and dropped (counted), iff current_version - group.version > max_staleness (a gap equal
  to the bound is kept); then replay share, order (FIFO / EDF), mixing across envs and lag-decay weights
  (`astratk.dataflow.stages.serving`). A step's batch is assembled once, cached, and sharded
  `groups[rank::world_size]`, so every rank and every retry of the same (policy, step) sees the same groups.
- Multi-policy: each policy has its own buffer, staleness bound (`trainer.max_staleness`, default
  `dataflow.max_staleness`) and version stream; with `dataflow.version_barrier` b, a policy's step-k batch is served
  only once every other policy has published version >= k - b (b = 0: versions move in lock-step, so multi-policy
  evaluations pair equal versions).
- Synchronous mode (`dataflow.synchronous`): new tasks are leased in rounds, only when every policy has published
  the version of every batch served so far (acquisition in lock-step with training); a round's admissions are held
  until the whole round is in (or dropped after failures), then admitted in lease order. With rollouts seeded per
  lease and episode (the rollout service does this), the batches a run sees are then a function of the seed alone;
  staleness is 0. With several policies, a round's batches are trained one policy after the other, in the spec's
  order (generate, train A, train B: the synchronous baseline of AstraFlow's comparison).
- Snapshot: `state_dict()` holds everything above (leases with their remaining time, buffers, cached batches,
  versions, counters, every stage's state, and how many tasks the train stream has yielded: envs' train streams are
  deterministic, so a restored layer re-creates the stream and skips that many). It pickles. With a snapshot store
  (`astratk.dataflow.snapshots`) the layer writes it when a policy publishes a trainer-checkpoint version (before any
  lease of that version: the pair a resumed run needs), when every `snapshot.every_steps`-th batch is served, and on
  demand.
  `restore` builds a layer from a snapshot for a resumed run or a replacement actor: leases that were out are
  re-issued at once (their results, if they ever arrive, went to the lost layer).

Metric keys are `"data/{policy_id}/{name}"` for per-policy counters and `"data/{name}"` for task-level ones; stage
metrics are `"data/stage/{stage}/{name}"` (curators, filters) and `"data/{policy_id}/stage/{stage}/{name}"` (serving).
Extending: write a stage (`astratk.dataflow.stages`), not a branch here.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from astratk.dataflow.advantages import get_advantage
from astratk.dataflow.snapshots import SnapshotEntry, SnapshotStore
from astratk.dataflow.stages.base import Curator, GroupFilter, ServingOrder, Stage
from astratk.dataflow.stages.filters import ZeroVariance
from astratk.dataflow.stages.serving import Mixing, Replay, Staleness
from astratk.records import Group, Task, WeightRef

if TYPE_CHECKING:  # the spec imports the stage contracts, which import this package: no import cycle at run time
    from astratk.spec import RunSpec

STATE_FORMAT = 2  # bump when state_dict() changes shape


@dataclass(frozen=True)
class Lease:
    lease_id: str
    task: Task
    routes: dict[str, str]  # env role -> policy_id
    deadline: float  # on the data layer's clock
    attempt: int = 1


@dataclass
class _Serving:
    """One policy's serving stages: copies of the spec's templates (a replay buffer is per policy)."""

    staleness: Staleness
    order: ServingOrder
    replay: Replay | None
    mixing: Mixing | None

    def stages(self) -> dict[str, Stage]:
        named = {"staleness": self.staleness, "order": self.order, "replay": self.replay, "mixing": self.mixing}
        return {k: v for k, v in named.items() if v is not None}


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
        self.spec = spec
        self._clock = clock
        d = spec.dataflow
        self._sync = d.synchronous
        url = snapshot_url or d.snapshot.url
        self._snapshots = SnapshotStore(url, d.snapshot.keep_last) if url else None
        self._checkpoint_every = {p.policy_id: p.trainer.checkpoint_every for p in spec.policies}
        self._tasks = iter(spec.env.tasks("train"))
        self._tasks_drawn = 0  # how far the train stream has been read (the snapshot re-reads it to here)
        self._routes = spec.role_routes()
        self._curated_role = spec.env.roles[0]  # curators learn from the first role's rewards (the solver's)
        self._curated_policy = self._routes.get(self._curated_role)
        self._advantage = get_advantage(d.advantage)
        # Stages are deep-copied: the spec holds templates, and may be reused or shared with another data layer.
        self._curators: dict[str, Curator] = _named(copy.deepcopy(d.curators))  # type: ignore[assignment]
        filters = list(d.filters)
        if d.filter_zero_variance and not any(isinstance(f, ZeroVariance) for f in filters):
            filters.insert(0, ZeroVariance())
        self._filters: dict[str, GroupFilter] = _named(copy.deepcopy(filters))  # type: ignore[assignment]
        self._serving = {p.policy_id: _Serving(Staleness(_staleness_bound(spec, p.policy_id), d.lag_decay),
                                               copy.deepcopy(d.order), copy.deepcopy(d.replay),
                                               copy.deepcopy(d.mixing))
                         for p in spec.policies}
        self._next_lease = 0
        self._outstanding: dict[str, Lease] = {}
        self._retry: deque[Lease] = deque()
        self._closed: set[str] = set()  # lease ids admitted or dropped: admission is idempotent
        self._buffers: dict[str, deque[Group]] = {p.policy_id: deque() for p in spec.policies}
        self._batches: OrderedDict[tuple[str, int], list[Group]] = OrderedDict()
        self._versions: dict[str, int] = {p.policy_id: 0 for p in spec.policies}
        self._served: dict[str, int] = {p.policy_id: 0 for p in spec.policies}  # steps whose batch was assembled
        self._round: dict[str, list[Group]] = {}  # synchronous mode: admissions held until the round is complete
        self._paused = False  # a paused run serves no new batch (cached ones still, for retries)
        self._refs: dict[str, WeightRef] = {}
        self._counts: Counter[str] = Counter()
        self._reward_sum: Counter[str] = Counter()
        self._traj_sums: Counter[str] = Counter()  # "<pid>/<role>/<metric>" -> sum over received trajectories
        self._traj_counts: Counter[str] = Counter()

    # --------------------------------------------------------------------------------------------- leasing
    def lease(self, n: int) -> list[Lease]:
        """Up to `n` task leases: expired leases first, then new tasks. Fewer (or none) under back-pressure:
        leasing stops once buffered groups plus leases in flight reach `prefetch_steps` steps' worth for every policy
        (rolling out further ahead only produces samples that go stale)."""
        self._expire()
        if self._sync:  # a whole round at once, whatever was asked: chunks, hence engine batches, are then cut
            #   from the round the same way in every run (batching moves log-probs); mid-round only its retries
            in_round = bool(self._outstanding or self._round or self._retry)
            n = len(self._retry) if in_round else self._round_room()
            new_room = 0 if in_round else n
        else:  # while any policy wants data: one whose trainer waits (slower, or held by the version barrier) must
            #   not starve the others, which would deadlock the barrier; its surplus is capped instead
            new_room = max(self._prefetch_target(pid) - len(self._cap_buffer(pid)) for pid in self._buffers) \
                - len(self._outstanding) - len(self._retry)
        n = max(0, n)
        out: list[Lease] = []
        deadline = self._clock() + self.spec.dataflow.lease_timeout_s
        while self._retry and len(out) < n:  # re-issues are work already counted: the room never holds them back
            old = self._retry.popleft()
            if old.lease_id in self._closed:  # its slow original was admitted after it expired: nothing to redo
                continue
            out.append(dataclasses.replace(old, deadline=deadline, attempt=old.attempt + 1))
            self._counts["data/leases_reissued"] += 1
        n = len(out) + max(0, min(n - len(out), new_room))
        skipped = 0
        while len(out) < n:
            task = next(self._tasks, None)
            if task is None:
                break
            self._tasks_drawn += 1
            refused_by = self._curate(task)
            if refused_by is not None:
                self._counts[f"data/tasks_skipped_{refused_by}"] += 1
                skipped += 1
                if skipped >= self.spec.dataflow.max_curator_skips:
                    if not out:  # nothing to hand out: fail loudly (leases already built are returned instead)
                        self._too_many_skips(skipped)
                    break
                continue
            out.append(Lease(f"L{self._next_lease}", task, dict(self._routes), deadline))
            self._next_lease += 1
        for lease in out:
            self._outstanding[lease.lease_id] = lease
        self._counts["data/leases_issued"] += len(out)
        return out

    def _prefetch_target(self, policy_id: str) -> int:
        return int(self.spec.dataflow.prefetch_steps * self.spec.policy(policy_id).trainer.groups_per_step)

    def _cap_buffer(self, policy_id: str) -> deque[Group]:
        """Drop (counted as `groups_dropped_overflow`) the oldest groups beyond 4x the prefetch target: a policy
        whose trainer is not taking data keeps its freshest groups, and memory stays bounded."""
        buf = self._drop_stale(policy_id)
        cap = 4 * max(1, self._prefetch_target(policy_id))
        if len(buf) > cap:
            self._counts[f"data/{policy_id}/groups_dropped_overflow"] += len(buf) - cap
            for _ in range(len(buf) - cap):
                buf.popleft()
        return buf

    def _round_room(self) -> int:
        """Synchronous mode, between rounds: once every policy has published the version of every batch served, a
        new round of the largest shortfall of fresh groups over the policies."""
        if any(self._versions[pid] < self._served[pid] for pid in self._buffers):
            return 0  # the trainer has not published the weights of the last batch yet
        room = 0
        for pid in self._buffers:
            short = self._fresh_needed(pid) - len(self._drop_stale(pid))  # not when the trainer happens to poll
            if short > 0:  # over-lease by the inverse of the share of tasks that kept a group (at most 4x): filters
                tasks = self._counts["data/tasks_completed"]  # drop groups, and a round per drop would crawl
                kept = self._counts[f"data/{pid}/groups_admitted"]
                room = max(room, math.ceil(short * min(4.0, tasks / kept if kept else (4.0 if tasks else 1.0))))
        return room

    def _fresh_needed(self, policy_id: str) -> int:
        n = self.spec.policy(policy_id).trainer.groups_per_step
        replay = self._serving[policy_id].replay
        return n - (replay.share(n) if replay else 0)

    def _curate(self, task: Task) -> str | None:
        """The name of the first curator that refuses `task`, or None when all accept it."""
        version = self._versions.get(self._curated_policy, 0) if self._curated_policy else 0
        for name, curator in self._curators.items():
            if not curator.should_submit(task, version):
                return name
        return None

    def _too_many_skips(self, skipped: int) -> None:
        counts = {k.removeprefix("data/tasks_skipped_"): int(v) for k, v in self._counts.items()
                  if k.startswith("data/tasks_skipped_")}
        raise RuntimeError(f"curators refused {skipped} tasks in a row (refusals so far: {counts}): they reject what "
                           "the train stream offers. Loosen them (greso min_submit_easy/min_submit_hard, "
                           "filter_solved threshold, curriculum explore) or raise dataflow.max_curator_skips")

    def _expire(self) -> None:
        now = self._clock()
        for lease_id, lease in list(self._outstanding.items()):
            if lease.deadline < now:
                del self._outstanding[lease_id]
                self._counts["data/leases_expired"] += 1
                self._requeue(lease)

    def _requeue(self, lease: Lease) -> None:
        if lease.attempt >= self.spec.dataflow.max_task_attempts:
            self._closed.add(lease.lease_id)
            self._counts["data/tasks_dropped_failed"] += 1
            self._maybe_flush_round()
        else:
            self._retry.append(lease)

    def release(self, leases: Sequence[tuple[str, int]], reason: str = "error") -> None:
        """A rollout for these (lease id, attempt) pairs failed: re-issue them now instead of at their deadline.
        Only the attempt that failed is released: if the lease already expired and was re-issued, the newer attempt
        is still running and is left alone."""
        for lease_id, attempt in leases:
            lease = self._outstanding.get(lease_id)
            if lease is not None and lease.attempt == attempt:
                del self._outstanding[lease_id]
                self._counts[f"data/leases_released_{reason}"] += 1
                self._requeue(lease)
        self._maybe_flush_round()

    # ------------------------------------------------------------------------------------------- admission
    def admit(self, lease_id: str, groups: Sequence[Group]) -> dict[str, int]:
        """Admit the groups rolled out for one lease (one group per role). Idempotent by lease id."""
        if lease_id in self._closed:
            self._counts["data/duplicates_ignored"] += 1
            return {"admitted": 0, "duplicate": 1}
        self._outstanding.pop(lease_id, None)
        self._closed.add(lease_id)
        self._counts["data/tasks_completed"] += 1
        if self._sync:
            self._round[lease_id] = list(groups)
            return {"admitted": self._maybe_flush_round(), "duplicate": 0}
        admitted = 0
        for group in groups:
            admitted += self._admit_group(group)
        return {"admitted": admitted, "duplicate": 0}

    def admit_many(self, items: Sequence[tuple[str, Sequence[Group]]]) -> dict[str, Any]:
        """`admit` for several leases in one call (one actor round trip per rollout chunk, not one per lease), plus
        the policies' versions after admission (the "current" of version-lag metrics)."""
        outcomes = [self.admit(lease_id, groups) for lease_id, groups in items]
        return {"outcomes": outcomes, "versions": dict(self._versions)}

    def _maybe_flush_round(self) -> int:
        """Synchronous mode: once nothing of the round is out or waiting for re-issue, admit its groups in lease
        order (so buffer order, curator updates and counters do not depend on which rollout finished first)."""
        if not self._round or self._outstanding or self._retry:
            return 0
        admitted = 0
        for lease_id in sorted(self._round, key=_lease_number):
            for group in self._round[lease_id]:
                admitted += self._admit_group(group)
        self._round.clear()
        return admitted

    def _admit_group(self, group: Group) -> int:
        pid = group.policy_id
        if pid not in self._buffers:
            raise ValueError(f"group {group.group_id} is for unknown policy {pid!r}; policies: {list(self._buffers)}")
        key = f"data/{pid}/"
        scored = tuple(t for t in group.trajectories if t.reward is not None)
        self._counts[key + "trajectories_unscored_dropped"] += len(group.trajectories) - len(scored)
        self._counts[key + "groups_received"] += 1
        self._counts[key + "samples_received"] += len(scored)
        for t in group.trajectories:  # env metrics (turns, tool calls, tests passed, isolation...) per policy and role
            for name, value in t.metrics.items():
                k = f"{pid}/{t.role}/{name}"
                self._traj_sums[k] += float(value)
                self._traj_counts[k] += 1
        if not scored:
            self._counts[key + "groups_dropped_empty"] += 1
            return 0
        rewards = [float(t.reward) for t in scored]  # type: ignore[arg-type]
        self._reward_sum[key + "reward_sum"] += sum(rewards)
        group = dataclasses.replace(group, trajectories=scored, advantages=tuple(self._advantage(rewards)))
        if self._curators and group.role == self._curated_role:  # before filters: GRESO learns from what they drop
            for curator in self._curators.values():
                curator.update(group.task, rewards, group.version)
        for f in self._filters.values():
            reason = f.check(group)
            if reason is not None:
                self._counts[key + f"groups_dropped_{reason}"] += 1
                return 0
        group.version  # noqa: B018 - computed (and cached) on admission, not while the trainer waits for a batch
        self._buffers[pid].append(group)
        self._counts[key + "groups_admitted"] += 1
        return 1

    # --------------------------------------------------------------------------------------------- weights
    def publish_version(self, ref: WeightRef) -> None:
        if ref.policy_id not in self._versions:
            raise ValueError(f"unknown policy {ref.policy_id!r}; policies: {list(self._versions)}")
        if ref.version < self._versions[ref.policy_id]:
            raise ValueError(f"policy {ref.policy_id!r}: version {ref.version} published after "
                             f"{self._versions[ref.policy_id]}; versions must not go back")
        moved = ref.version > self._versions[ref.policy_id]
        self._versions[ref.policy_id] = ref.version
        self._refs[ref.policy_id] = ref
        if moved and ref.policy_id == self._curated_policy:
            for curator in self._curators.values():
                curator.on_version(ref.version)
        every = self._checkpoint_every.get(ref.policy_id)
        if moved and every and ref.version % every == 0 and self._snapshots is not None:
            self.snapshot("checkpoint")  # the trainer checkpoints this step: the matching state, before any lease

    def latest(self, policy_id: str) -> WeightRef | None:
        return self._refs.get(policy_id)

    def version(self, policy_id: str) -> int:
        return self._versions[policy_id]

    # --------------------------------------------------------------------------------------------- serving
    def next_batch(self, policy_id: str, step: int, rank: int = 0, world_size: int = 1) -> list[Group] | None:
        """This rank's share of `step`'s batch, or None if not enough fresh groups are buffered yet."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        key = (policy_id, step)
        if key not in self._batches:
            if self._paused:
                return None
            if self._behind_barrier(policy_id, step):
                self._counts[f"data/{policy_id}/barrier_waits"] += 1
                return None
            if self._sync and (self._versions[policy_id] < step or self._earlier_policy_training(policy_id, step)):
                return None  # synchronous: step k trains on version k's rollouts, one policy after the other
            groups = self._take(policy_id, self.spec.policy(policy_id).trainer.groups_per_step)
            if groups is None:
                return None
            self._batches[key] = groups
            self._served[policy_id] = max(self._served[policy_id], step + 1)
            while len(self._batches) > 64 * len(self._buffers):  # keep recent steps for retries only
                self._batches.popitem(last=False)
            every = self.spec.dataflow.snapshot.every_steps
            if self._snapshots is not None and every and (step + 1) % every == 0:
                self.snapshot("periodic")  # the state with this batch served (and cached for its retries)
        return self._batches[key][rank::world_size]

    def _earlier_policy_training(self, policy_id: str, step: int) -> bool:
        """Synchronous mode trains the policies of a round one after the other, in `spec.policies` order (the classic
        loop: generate, train A, train B): a policy's step-k batch waits until every earlier policy has published
        version k + 1."""
        for pid in self._versions:
            if pid == policy_id:
                return False
            if self._versions[pid] < step + 1:
                return True
        return False

    def set_paused(self, paused: bool) -> None:
        """Pause (or resume) serving new batches: trainers wait, and their batch timeout stops while paused."""
        self._paused = bool(paused)

    def is_paused(self) -> bool:
        return self._paused

    def _behind_barrier(self, policy_id: str, step: int) -> bool:
        barrier = self.spec.dataflow.version_barrier
        if barrier is None or len(self._versions) < 2:
            return False
        return min(v for pid, v in self._versions.items() if pid != policy_id) < step - barrier

    def _take(self, policy_id: str, n: int) -> list[Group] | None:
        """Assemble one n-group batch (`astratk.dataflow.stages.serving` gives the order of the steps), or None when
        too few fresh groups are buffered; then nothing changes but stale drops."""
        s = self._serving[policy_id]
        current = self._versions[policy_id]
        fresh = list(self._drop_stale(policy_id))
        n_fresh = n - (s.replay.share(n) if s.replay else 0)
        if len(fresh) < n_fresh:
            return None
        replayed = s.replay.select(n) if s.replay else []
        ordered = s.order.order(fresh)
        chosen = s.mixing.pick(ordered, n_fresh) if s.mixing else ordered[:n_fresh]
        taken = {id(g) for g in chosen}
        self._buffers[policy_id] = deque(g for g in fresh if id(g) not in taken)
        if s.replay:
            s.replay.add(chosen)
        self._counts[f"data/{policy_id}/groups_served"] += n
        self._counts[f"data/{policy_id}/groups_replayed"] += len(replayed)
        return [self._weighted(g, s.staleness, current) for g in [*replayed, *chosen]]

    def _drop_stale(self, policy_id: str) -> deque[Group]:
        """Drop (counted) the policy's stale buffered groups; returns the buffer."""
        buf = self._buffers[policy_id]
        fresh = self._serving[policy_id].staleness.fresh(buf, self._versions[policy_id])
        if len(fresh) < len(buf):
            self._counts[f"data/{policy_id}/groups_dropped_stale"] += len(buf) - len(fresh)
            buf = self._buffers[policy_id] = deque(fresh)
        return buf

    @staticmethod
    def _weighted(group: Group, staleness: Staleness, current: int) -> Group:
        weight = staleness.weight(group.version, current)
        return group if weight == group.weight else dataclasses.replace(group, weight=weight)

    # --------------------------------------------------------------------------------------------- metrics
    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {k: float(v) for k, v in self._counts.items()}
        for pid, buf in self._buffers.items():
            out[f"data/{pid}/buffer_groups"] = float(len(buf))
            out[f"data/{pid}/version"] = float(self._versions[pid])
            received = self._counts[f"data/{pid}/samples_received"]
            if received:
                out[f"data/{pid}/reward_mean_received"] = self._reward_sum[f"data/{pid}/reward_sum"] / received
        for k, total in self._traj_sums.items():  # data/<pid>/traj/<role>/<metric>_mean
            pid, role, name = k.split("/", 2)
            out[f"data/{pid}/traj/{role}/{name.replace('/', '_')}_mean"] = total / self._traj_counts[k]
        out["data/leases_outstanding"] = float(len(self._outstanding))
        out["data/round_pending"] = float(len(self._round))
        out["data/leases_waiting_reissue"] = float(len(self._retry))
        for name, st in {**self._curators, **self._filters}.items():
            out.update({f"data/stage/{name}/{k}": v for k, v in st.metrics().items()})
        for pid, serving in self._serving.items():
            for name, st in serving.stages().items():
                out.update({f"data/{pid}/stage/{name}/{k}": v for k, v in st.metrics().items()})
        return out

    def status(self) -> str:
        m = self.metrics()
        return ", ".join(f"{k}={v:g}" for k, v in sorted(m.items()))

    # -------------------------------------------------------------------------------------------- snapshot
    def _stage_states(self) -> dict[str, Any]:
        return {"curators": {k: st.state_dict() for k, st in self._curators.items()},
                "filters": {k: st.state_dict() for k, st in self._filters.items()},
                "serving": {pid: {k: st.state_dict() for k, st in s.stages().items()}
                            for pid, s in self._serving.items()}}

    def state_dict(self, batches_kept: int | None = None) -> dict[str, Any]:
        """Everything needed to continue where this layer stands (see the module docstring); picklable. With
        `batches_kept`, only each policy's newest `batches_kept` served batches are included (a retry only ever asks
        for the current step's)."""
        now = self._clock()
        batches = list(self._batches.items())
        if batches_kept is not None:
            newest: dict[str, list[int]] = {}
            for pid, step in self._batches:
                newest.setdefault(pid, []).append(step)
            keep = {(pid, st) for pid, steps in newest.items() for st in sorted(steps)[-batches_kept:]}
            batches = [(k, g) for k, g in batches if k in keep]
        return {
            "format": STATE_FORMAT,
            "tasks_drawn": self._tasks_drawn,
            "next_lease": self._next_lease,
            "outstanding": [(lease, lease.deadline - now) for lease in self._outstanding.values()],  # time left
            "retry": list(self._retry),
            "closed": sorted(self._closed),
            "buffers": {pid: list(buf) for pid, buf in self._buffers.items()},
            "batches": [(pid, step, list(groups)) for (pid, step), groups in batches],
            "versions": dict(self._versions),
            "served": dict(self._served),
            "round": {lid: list(groups) for lid, groups in self._round.items()},
            "refs": dict(self._refs),
            "counts": dict(self._counts),
            "reward_sum": dict(self._reward_sum),
            "traj_sums": dict(self._traj_sums),
            "traj_counts": dict(self._traj_counts),
            "stages": self._stage_states(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()` taken from a data layer built from the same spec (same policies and stages)."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"data layer state has format {state.get('format')!r}; this version reads "
                             f"{STATE_FORMAT}")
        _same_keys("policies", state["buffers"], self._buffers)
        stages = state["stages"]
        _same_keys("curators", stages["curators"], self._curators)
        _same_keys("filters", stages["filters"], self._filters)
        for pid, serving in self._serving.items():
            _same_keys(f"serving stages of policy {pid!r}", stages["serving"][pid], serving.stages())
        self._tasks = iter(self.spec.env.tasks("train"))
        self._tasks_drawn = int(state["tasks_drawn"])
        next(itertools.islice(self._tasks, self._tasks_drawn, self._tasks_drawn), None)  # skip what was read
        self._next_lease = int(state["next_lease"])
        now = self._clock()
        self._outstanding = {lease.lease_id: dataclasses.replace(lease, deadline=now + left)
                             for lease, left in state["outstanding"]}
        self._retry = deque(state["retry"])
        self._closed = set(state["closed"])
        self._buffers = {pid: deque(groups) for pid, groups in state["buffers"].items()}
        self._batches = OrderedDict(((pid, step), list(groups)) for pid, step, groups in state["batches"])
        self._versions = dict(state["versions"])
        self._served = dict(state["served"])
        self._round = {lid: list(groups) for lid, groups in state["round"].items()}
        self._refs = dict(state["refs"])
        self._counts = Counter(state["counts"])
        self._reward_sum = Counter(state["reward_sum"])
        self._traj_sums = Counter(state["traj_sums"])
        self._traj_counts = Counter(state["traj_counts"])
        for name, st in self._curators.items():
            st.load_state_dict(stages["curators"][name])
        for name, st in self._filters.items():
            st.load_state_dict(stages["filters"][name])
        for pid, serving in self._serving.items():
            for name, st in serving.stages().items():
                st.load_state_dict(stages["serving"][pid][name])


    def snapshot(self, kind: str = "on_demand") -> SnapshotEntry:
        """Write the state to the snapshot store now (`kind`: on_demand, periodic, checkpoint, final)."""
        if self._snapshots is None:
            raise RuntimeError("this data layer has no snapshot store; give dataflow.snapshot.url (a run sets "
                               "<run dir>/datalayer)")
        start = time.perf_counter()
        entry = self._snapshots.write(self.state_dict(batches_kept=2), kind=kind, versions=self._versions,
                                      served=self._served)
        self._counts[f"data/snapshots_{kind}"] += 1
        self._counts["data/snapshot_seconds"] += time.perf_counter() - start
        return entry

    @classmethod
    def restore(cls, spec: RunSpec, state: dict[str, Any], clock: Callable[[], float] = time.monotonic,
                snapshot_url: str | None = None) -> DataLayer:
        """A layer that continues from `state` (a snapshot) in a new process: leases that were out are queued for
        re-issue at once, keeping their lease ids (so a late admission of the lost layer's work cannot double them
        here, and synchronous rounds re-create the same rollouts)."""
        layer = cls(spec, clock, snapshot_url)
        layer._resume(state)
        return layer

    def load_snapshot(self, url: str, name: str | None = None) -> dict[str, Any]:
        """`restore` in place, from snapshot `name` (default: the newest intact one) of the store at `url`: how a
        fresh data-layer actor takes over. Returns the snapshot's index row."""
        store = SnapshotStore(url)
        entry = store.latest() if name is None else next((e for e in store.entries() if e.name == name), None)
        if entry is None:
            raise FileNotFoundError(f"no data-layer snapshot {name or ''} in {url}")
        self._resume(store.read(entry))
        return dataclasses.asdict(entry)

    def _resume(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state)
        out = sorted(self._outstanding.values(), key=lambda lease: _lease_number(lease.lease_id))
        self._outstanding.clear()
        for lease in reversed(out):  # ahead of older re-issues, in lease order; re-issue counts the attempt again
            self._retry.appendleft(dataclasses.replace(lease, attempt=max(0, lease.attempt - 1)))
        self._counts["data/leases_restored"] += len(out)
        self._counts["data/restores"] += 1


def _lease_number(lease_id: str) -> int:
    return int(lease_id[1:])


def _staleness_bound(spec: RunSpec, policy_id: str) -> int:
    if spec.dataflow.synchronous:
        return 0
    own = spec.policy(policy_id).trainer.max_staleness
    return spec.dataflow.max_staleness if own is None else own


def _same_keys(what: str, saved: dict[str, Any], here: dict[str, Any]) -> None:
    if list(saved) != list(here):
        raise ValueError(f"data layer state has {what} {list(saved)}, but this spec configures {list(here)}; "
                         "restore with the spec the state was taken from")
