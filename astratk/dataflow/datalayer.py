"""`DataLayer`: the one stateful coordinator between rollout services and trainers (DESIGN §3, ALGORITHMS §5).

It owns task leasing, admission and per-policy buffers, and serves each trainer step's batch. Every method is
synchronous, short and non-blocking, because Dask runs an actor's synchronous methods one at a time in one thread:
waiting for data happens client-side (`DataLayerHandle.wait_batch`), never inside the actor.

Semantics (AstraFlow's, ALGORITHMS §5):
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
- Snapshot: `state_dict()` holds everything above (leases with their remaining time, buffers, cached batches,
  versions, counters, every stage's state, and how many tasks the train stream has yielded: envs' train streams are
  deterministic, so a restored layer re-creates the stream and skips that many). It pickles; the store format is
  the snapshot/resume code's business.

Metric keys are `"data/{policy_id}/{name}"` for per-policy counters and `"data/{name}"` for task-level ones; stage
metrics are `"data/stage/{stage}/{name}"` (curators, filters) and `"data/{policy_id}/stage/{stage}/{name}"` (serving).
Extending: write a stage (`astratk.dataflow.stages`), not a branch here.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from astratk.dataflow.advantages import get_advantage
from astratk.dataflow.stages.base import Curator, GroupFilter, ServingOrder, Stage
from astratk.dataflow.stages.filters import ZeroVariance
from astratk.dataflow.stages.serving import Mixing, Replay, Staleness
from astratk.records import Group, Task, WeightRef

if TYPE_CHECKING:  # the spec imports the stage contracts, which import this package: no import cycle at run time
    from astratk.spec import RunSpec

STATE_FORMAT = 1  # bump when state_dict() changes shape


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

    def __init__(self, spec: RunSpec, clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self._clock = clock
        d = spec.dataflow
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
        self._serving = {p.policy_id: _Serving(Staleness(d.max_staleness, d.lag_decay), copy.deepcopy(d.order),
                                               copy.deepcopy(d.replay), copy.deepcopy(d.mixing))
                         for p in spec.policies}
        self._next_lease = 0
        self._outstanding: dict[str, Lease] = {}
        self._retry: deque[Lease] = deque()
        self._closed: set[str] = set()  # lease ids admitted or dropped: admission is idempotent
        self._buffers: dict[str, deque[Group]] = {p.policy_id: deque() for p in spec.policies}
        self._batches: OrderedDict[tuple[str, int], list[Group]] = OrderedDict()
        self._versions: dict[str, int] = {p.policy_id: 0 for p in spec.policies}
        self._refs: dict[str, WeightRef] = {}
        self._counts: Counter[str] = Counter()
        self._reward_sum: Counter[str] = Counter()
        self._traj_sums: Counter[str] = Counter()  # "<pid>/<role>/<metric>" -> sum over received trajectories
        self._traj_counts: Counter[str] = Counter()

    # --------------------------------------------------------------------------------------------- leasing
    def lease(self, n: int) -> list[Lease]:
        """Up to `n` task leases: expired leases first, then new tasks. Fewer (or none) under back-pressure:
        leasing stops while buffered groups plus leases in flight reach `prefetch_steps` steps' worth for any policy
        (rolling out further ahead only produces samples that go stale)."""
        self._expire()
        room = min(int(self.spec.dataflow.prefetch_steps * self.spec.policy(pid).trainer.groups_per_step) - len(b)
                   for pid, b in self._buffers.items()) - len(self._outstanding) - len(self._retry)
        n = max(0, min(n, room))
        out: list[Lease] = []
        deadline = self._clock() + self.spec.dataflow.lease_timeout_s
        while self._retry and len(out) < n:
            old = self._retry.popleft()
            if old.lease_id in self._closed:  # its slow original was admitted after it expired: nothing to redo
                continue
            out.append(dataclasses.replace(old, deadline=deadline, attempt=old.attempt + 1))
            self._counts["data/leases_reissued"] += 1
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

    # ------------------------------------------------------------------------------------------- admission
    def admit(self, lease_id: str, groups: Sequence[Group]) -> dict[str, int]:
        """Admit the groups rolled out for one lease (one group per role). Idempotent by lease id."""
        if lease_id in self._closed:
            self._counts["data/duplicates_ignored"] += 1
            return {"admitted": 0, "duplicate": 1}
        self._outstanding.pop(lease_id, None)
        self._closed.add(lease_id)
        self._counts["data/tasks_completed"] += 1
        admitted = 0
        for group in groups:
            admitted += self._admit_group(group)
        return {"admitted": admitted, "duplicate": 0}

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
            groups = self._take(policy_id, self.spec.policy(policy_id).trainer.groups_per_step)
            if groups is None:
                return None
            self._batches[key] = groups
            while len(self._batches) > 64 * len(self._buffers):  # keep recent steps for retries only
                self._batches.popitem(last=False)
        return self._batches[key][rank::world_size]

    def _take(self, policy_id: str, n: int) -> list[Group] | None:
        """Assemble one n-group batch (`astratk.dataflow.stages.serving` gives the order of the steps), or None when
        too few fresh groups are buffered; then nothing changes but stale drops."""
        s = self._serving[policy_id]
        current = self._versions[policy_id]
        buf = self._buffers[policy_id]
        fresh = s.staleness.fresh(buf, current)
        if len(fresh) < len(buf):
            self._counts[f"data/{policy_id}/groups_dropped_stale"] += len(buf) - len(fresh)
            self._buffers[policy_id] = deque(fresh)
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

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue where this layer stands (see the module docstring); picklable."""
        now = self._clock()
        return {
            "format": STATE_FORMAT,
            "tasks_drawn": self._tasks_drawn,
            "next_lease": self._next_lease,
            "outstanding": [(lease, lease.deadline - now) for lease in self._outstanding.values()],  # time left
            "retry": list(self._retry),
            "closed": sorted(self._closed),
            "buffers": {pid: list(buf) for pid, buf in self._buffers.items()},
            "batches": [(pid, step, list(groups)) for (pid, step), groups in self._batches.items()],
            "versions": dict(self._versions),
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


def _same_keys(what: str, saved: dict[str, Any], here: dict[str, Any]) -> None:
    if list(saved) != list(here):
        raise ValueError(f"data layer state has {what} {list(saved)}, but this spec configures {list(here)}; "
                         "restore with the spec the state was taken from")
