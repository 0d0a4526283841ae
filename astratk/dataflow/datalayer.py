"""`DataLayer`: the one stateful coordinator between rollout services and trainers (DESIGN §3, ALGORITHMS §5).

It owns task leasing, admission and per-policy buffers, and serves each trainer step's batch. Every method is
synchronous, short and non-blocking, because Dask runs an actor's synchronous methods one at a time in one thread:
waiting for data happens client-side (`DataLayerHandle.wait_batch`), never inside the actor.

Semantics (AstraFlow's, ALGORITHMS §5):
- A lease is one task to roll out, with a deadline. A lease not admitted by its deadline is re-issued with the same
  lease id (so a slow original and its re-issue cannot both be admitted: admission is idempotent by lease id).
  A task whose rollout failed `max_task_attempts` times is dropped (counted).
- Admission: unscored trajectories are dropped (counted); advantages are computed per group and fixed;
  zero-variance groups are dropped when the filter is on (counted); the rest join their policy's buffer.
- Serving: a group is stale, and dropped (counted), iff current_version - group.version > max_staleness (a gap equal
  to the bound is kept). A step's batch is assembled once (FIFO), cached, and sharded `groups[rank::world_size]`,
  so every rank and every retry of the same (policy, step) sees the same groups.

Metric keys are `"data/{policy_id}/{name}"` for per-policy counters and `"data/{name}"` for task-level ones.
Extending: serving stages (EDF, replay, mixing) and curators plug in at `_take` and `lease` in issue 6.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from astratk.dataflow.advantages import get_advantage
from astratk.records import Group, Task, WeightRef
from astratk.spec import RunSpec


@dataclass(frozen=True)
class Lease:
    lease_id: str
    task: Task
    routes: dict[str, str]  # env role -> policy_id
    deadline: float  # on the data layer's clock
    attempt: int = 1


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
        env = spec.env
        self._tasks = iter(env.tasks("train"))
        self._routes = spec.role_routes()
        self._advantage = get_advantage(spec.dataflow.advantage)
        self._lease_ids = itertools.count()
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
        while len(out) < n:
            task = next(self._tasks, None)
            if task is None:
                break
            out.append(Lease(f"L{next(self._lease_ids)}", task, dict(self._routes), deadline))
        for lease in out:
            self._outstanding[lease.lease_id] = lease
        self._counts["data/leases_issued"] += len(out)
        return out

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
        if self.spec.dataflow.filter_zero_variance and (len(set(rewards)) == 1):
            self._counts[key + "groups_dropped_zero_variance"] += 1
            return 0
        group = dataclasses.replace(group, trajectories=scored, advantages=tuple(self._advantage(rewards)))
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
        self._versions[ref.policy_id] = ref.version
        self._refs[ref.policy_id] = ref

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
        buf = self._buffers[policy_id]
        current = self._versions[policy_id]
        fresh = deque()
        for g in buf:
            if current - g.version > self.spec.dataflow.max_staleness:
                self._counts[f"data/{policy_id}/groups_dropped_stale"] += 1
            else:
                fresh.append(g)
        self._buffers[policy_id] = fresh
        if len(fresh) < n:
            return None
        batch = [fresh.popleft() for _ in range(n)]
        self._counts[f"data/{policy_id}/groups_served"] += n
        return batch

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
        return out

    def status(self) -> str:
        m = self.metrics()
        return ", ".join(f"{k}={v:g}" for k, v in sorted(m.items()))
