"""`BatchServer`: per-policy buffers, weight versions and step batches (AstraFlow's "at batch
serving" point).

Versions. A policy's *published* version moves when its trainer publishes (`publish`). The version a
trainer trains from at step k is `train_version(k) = max(published, k // publish_every)`: a
data-parallel rank > 0 may ask for step k before rank 0 has published the weights of step k - 1, and
the bound must hold at the step the batch is trained, on every rank.

Serving a step's batch (`next_batch`), in order:
- paused: nothing new is served (cached batches still are, for retries);
- version barrier b: a policy's step-k batch waits until every other policy has published version
  >= train_version(k) - b (versions compared with versions, each policy's own `publish_every`
  honoured; a policy that has published its last version, `max_steps // publish_every`, holds
  nobody back);
- synchronous mode: step k trains on version k's rollouts, and a round's policies train one after
  the other;
- staleness: a buffered group is dropped (counted `groups_dropped_stale`) iff
  train_version - group.version > max_staleness; replayed groups obey the same bound
  (`Replay.evict_older_than`);
- replay, order, mixing and lag-decay weights (`astratk.dataflow.stages.serving`).
A step's batch is assembled once, cached, and sharded `groups[rank::world_size]`, so every rank and
every retry of the same (policy, step) sees the same groups.

Back-pressure: the server says how many new leases would fill every policy's `prefetch_steps` worth
(`lease_room`), or what its trainer's remaining steps still need when that is less: a run near its
`max_steps` does not roll out groups no step will train on (they would take the cores from the last
steps and hold the final evaluation back behind a chunk nobody needs). A trainer that asks for a step
past `max_steps` (a Lightning CLI `--trainer.max_steps` above the spec's) lifts that bound for its
policy. A policy whose trainer is not consuming keeps at most 4x its prefetch (oldest dropped,
counted `groups_dropped_overflow`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from astratk.dataflow.drops import DropLedger
from astratk.dataflow.snapshots import same_keys
from astratk.dataflow.stages.base import ServingOrder, Stage
from astratk.dataflow.stages.serving import Mixing, Replay, Staleness
from astratk.records import Group, WeightRef

# served batches kept per policy for retries
CACHED_STEPS = 64


@dataclass
class PolicyServing:
    """One policy's serving configuration and stages (copies of the spec's templates: a replay
    buffer is per policy)."""

    groups_per_step: int
    publish_every: int
    # max_steps // publish_every: the last version its trainer publishes
    final_version: int
    prefetch_groups: int
    staleness: Staleness
    order: ServingOrder
    replay: Replay | None = None
    mixing: Mixing | None = None
    # the trainer's max_steps: leasing stops once the groups its remaining steps need are buffered or in
    # flight; None: no bound (lifted when a step past it is asked for)
    max_steps: int | None = None

    def __post_init__(self) -> None:
        if self.prefetch_groups < self.groups_per_step:
            raise ValueError(f"prefetch_groups ({self.prefetch_groups}) must be >= groups_per_step "
                             f"({self.groups_per_step}): leasing stops at prefetch_groups buffered or in flight, so no "
                             "step would ever be served (dataflow.prefetch_steps >= 1)")

    def stages(self) -> dict[str, Stage]:
        named = {"staleness": self.staleness, "order": self.order, "replay": self.replay,
                 "mixing": self.mixing}
        return {k: v for k, v in named.items() if v is not None}

    def fresh_needed(self) -> int:
        return self.groups_per_step - (self.replay.share(self.groups_per_step) if self.replay
                                       else 0)


class BatchServer:
    def __init__(self, policies: dict[str, PolicyServing], *, synchronous: bool = False,
                 version_barrier: int | None = None) -> None:
        # in the spec's order (synchronous rounds train them in this order)
        self.policies = policies
        self._sync = synchronous
        self._barrier = version_barrier
        self._buffers: dict[str, deque[Group]] = {pid: deque() for pid in policies}
        self._versions: dict[str, int] = {pid: 0 for pid in policies}
        self._refs: dict[str, WeightRef] = {}
        # steps whose batch was assembled
        self._served: dict[str, int] = {pid: 0 for pid in policies}
        self._batches: OrderedDict[tuple[str, int], list[Group]] = OrderedDict()
        self.paused = False
        self.counts: Counter[str] = Counter()
        self.drops = DropLedger()

    # ------------------------------------------------------------------------------------- versions
    def publish(self, ref: WeightRef) -> bool:
        """Record a published version; True when it moved."""
        pid = ref.policy_id
        if pid not in self._versions:
            raise ValueError(f"unknown policy {pid!r}; policies: {list(self._versions)}")
        if ref.version < self._versions[pid]:
            raise ValueError(f"policy {pid!r}: version {ref.version} published after "
                             f"{self._versions[pid]}; versions must not go back")
        moved = ref.version > self._versions[pid]
        self._versions[pid] = ref.version
        self._refs[pid] = ref
        return moved

    def version(self, policy_id: str) -> int:
        return self._versions[policy_id]

    def versions(self) -> dict[str, int]:
        return dict(self._versions)

    def served(self) -> dict[str, int]:
        return dict(self._served)

    def latest(self, policy_id: str) -> WeightRef | None:
        return self._refs.get(policy_id)

    def train_version(self, policy_id: str, step: int) -> int:
        """The version of the weights policy `policy_id` trains from at `step`."""
        return max(self._versions[policy_id], step // self.policies[policy_id].publish_every)

    # -------------------------------------------------------------------------------------- buffers
    def add(self, group: Group) -> None:
        self._buffers[group.policy_id].append(group)

    def buffered(self, policy_id: str) -> int:
        return len(self._buffers[policy_id])

    def lease_room(self) -> int:
        """New leases (before those in flight are subtracted) that would bring the policy that wants
        data the most to its prefetch target. While any policy wants data: one whose trainer waits
        (slower, or held by the barrier) must not starve the others, which would deadlock the
        barrier; its surplus is capped instead."""
        return max(self.wanted(pid) - len(self._cap_buffer(pid)) for pid in self.policies)

    def wanted(self, policy_id: str) -> int:
        """Groups the policy's buffer should hold (buffered plus in flight): its prefetch target, or
        the fresh groups its trainer's remaining steps need when that is less (0 once every step up
        to `max_steps` has been served)."""
        p = self.policies[policy_id]
        if p.max_steps is None:
            return p.prefetch_groups
        return min(p.prefetch_groups, max(0, p.max_steps - self._served[policy_id]) * p.fresh_needed())

    def round_short(self, policy_id: str) -> int:
        """Synchronous mode: fresh groups the policy's next step still lacks (none once its last step is
        served, as `wanted` says for leasing)."""
        need = min(self.policies[policy_id].fresh_needed(), self.wanted(policy_id))
        return need - len(self._drop_stale(policy_id))

    def all_published(self) -> bool:
        """Synchronous mode: every policy has published the version of every batch served so far."""
        return all(self._versions[pid] >= self._served[pid] for pid in self.policies)

    def _cap_buffer(self, policy_id: str) -> deque[Group]:
        buf = self._drop_stale(policy_id)
        cap = 4 * max(1, self.policies[policy_id].prefetch_groups)
        if len(buf) > cap:
            self.counts[f"data/{policy_id}/groups_dropped_overflow"] += len(buf) - cap
            self.drops.add("serving", "overflow", "groups", policy_id, len(buf) - cap)
            for _ in range(len(buf) - cap):
                buf.popleft()
        return buf

    def _drop_stale(self, policy_id: str, current: int | None = None) -> deque[Group]:
        """Drop (counted) the policy's buffered groups that are stale at `current` (default: the
        published version)."""
        buf = self._buffers[policy_id]
        current = self._versions[policy_id] if current is None else current
        fresh = self.policies[policy_id].staleness.fresh(buf, current)
        if len(fresh) < len(buf):
            self.counts[f"data/{policy_id}/groups_dropped_stale"] += len(buf) - len(fresh)
            self.drops.add("serving", "stale", "groups", policy_id, len(buf) - len(fresh))
            buf = self._buffers[policy_id] = deque(fresh)
        return buf

    # -------------------------------------------------------------------------------------- serving
    def next_batch(self, policy_id: str, step: int, rank: int = 0,
                   world_size: int = 1) -> list[Group] | None:
        """This rank's share of `step`'s batch, or None if it cannot be served yet."""
        if policy_id not in self.policies:
            raise ValueError(f"unknown policy {policy_id!r}; policies: {list(self.policies)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        key = (policy_id, step)
        if key not in self._batches:
            groups = self._assemble(policy_id, step)
            if groups is None:
                limit = self.policies[policy_id].max_steps
                if limit is not None and step >= limit:  # its trainer runs longer than the spec said
                    self.policies[policy_id].max_steps = None
                    self.counts[f"data/{policy_id}/max_steps_lifted"] += 1
                return None
            self._batches[key] = groups
            self._served[policy_id] = max(self._served[policy_id], step + 1)
            # recent steps only, for retries
            while len(self._batches) > CACHED_STEPS * len(self.policies):
                self._batches.popitem(last=False)
        return self._batches[key][rank::world_size]

    def is_cached(self, policy_id: str, step: int) -> bool:
        return (policy_id, step) in self._batches

    def _assemble(self, policy_id: str, step: int) -> list[Group] | None:
        if self.paused:
            return None
        if self.behind_barrier(policy_id, step):
            self.counts[f"data/{policy_id}/barrier_waits"] += 1
            return None
        if self._sync and (self._versions[policy_id] < step
                           or self._earlier_policy_training(policy_id, step)):
            # synchronous: step k trains on version k's rollouts, one policy after the other
            return None
        return self._take(policy_id, self.train_version(policy_id, step))

    def behind_barrier(self, policy_id: str, step: int) -> bool:
        if self._barrier is None or len(self.policies) < 2:
            return False
        need = self.train_version(policy_id, step) - self._barrier
        return any(v < min(need, self.policies[pid].final_version)
                   for pid, v in self._versions.items() if pid != policy_id)

    def _earlier_policy_training(self, policy_id: str, step: int) -> bool:
        """Synchronous mode trains the policies of a round one after the other, in the spec's order
        (generate, train A, train B): a policy's step-k batch waits until every earlier policy has
        published version k + 1."""
        for pid in self._versions:
            if pid == policy_id:
                return False
            if self._versions[pid] < min(step + 1, self.policies[pid].final_version):
                return True
        return False

    def _take(self, policy_id: str, current: int) -> list[Group] | None:
        """Assemble one batch trained at version `current`, or None when too few fresh groups are
        buffered; then nothing changes but stale drops."""
        s = self.policies[policy_id]
        n = s.groups_per_step
        fresh = list(self._drop_stale(policy_id, current))
        # replayed groups are trained at `current` too: the staleness bound holds for them
        if s.replay:
            s.replay.evict_older_than(current - s.staleness.max_staleness)
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
        self.counts[f"data/{policy_id}/groups_served"] += n
        self.counts[f"data/{policy_id}/groups_served_fresh"] += len(chosen)
        self.counts[f"data/{policy_id}/groups_replayed"] += len(replayed)
        return [self._weighted(g, s.staleness, current) for g in [*replayed, *chosen]]

    @staticmethod
    def _weighted(group: Group, staleness: Staleness, current: int) -> Group:
        weight = staleness.weight(group.version, current)
        return group if weight == group.weight else dataclasses.replace(group, weight=weight)

    # ---------------------------------------------------------------------------- metrics, snapshot
    def metrics(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.counts.items()}
        for pid, buf in self._buffers.items():
            out[f"data/{pid}/buffer_groups"] = float(len(buf))
            out[f"data/{pid}/version"] = float(self._versions[pid])
        for pid, serving in self.policies.items():
            for name, st in serving.stages().items():
                out.update({f"data/{pid}/stage/{name}/{k}": v for k, v in st.metrics().items()})
        return out

    def state_dict(self, batches_kept: int | None = None) -> dict[str, Any]:
        """With `batches_kept`, only each policy's newest `batches_kept` served batches (a retry
        only ever asks for the current step's)."""
        batches = list(self._batches.items())
        if batches_kept is not None:
            steps: dict[str, list[int]] = {}
            for pid, step in self._batches:
                steps.setdefault(pid, []).append(step)
            keep = {(pid, st) for pid, s in steps.items() for st in sorted(s)[-batches_kept:]}
            batches = [(k, g) for k, g in batches if k in keep]
        return {"buffers": {pid: list(buf) for pid, buf in self._buffers.items()},
                "batches": [(pid, step, list(groups)) for (pid, step), groups in batches],
                "versions": dict(self._versions), "served": dict(self._served),
                "refs": dict(self._refs), "paused": self.paused, "counts": dict(self.counts),
                "max_steps": {pid: s.max_steps for pid, s in self.policies.items()},
                "drops": self.drops.state_dict(),
                "stages": {pid: {k: st.state_dict() for k, st in s.stages().items()}
                           for pid, s in self.policies.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        same_keys("policies", state["buffers"], self._buffers)
        for pid, serving in self.policies.items():
            same_keys(f"serving stages of policy {pid!r}", state["stages"][pid], serving.stages())
        self._buffers = {pid: deque(groups) for pid, groups in state["buffers"].items()}
        self._batches = OrderedDict(((pid, step), list(groups))
                                    for pid, step, groups in state["batches"])
        self._versions = dict(state["versions"])
        self._served = dict(state["served"])
        for pid, limit in state.get("max_steps", {}).items():  # a bound lifted before the snapshot stays lifted
            if limit is None:
                self.policies[pid].max_steps = None
        self._refs = dict(state["refs"])
        self.paused = bool(state["paused"])
        self.counts = Counter(state["counts"])
        self.drops.load_state_dict(state["drops"])
        for pid, serving in self.policies.items():
            for name, st in serving.stages().items():
                st.load_state_dict(state["stages"][pid][name])
