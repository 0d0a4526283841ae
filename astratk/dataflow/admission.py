"""`Admission`: what happens to a lease's groups when they arrive (AstraFlow's "after rollout"
point; step 4 of the data path in docs/architecture.md).

For each group: unscored trajectories are dropped (counted); a group with none left is dropped as
`empty`; advantages are computed once and fixed; curators learn from the curated role's rewards
(before filters, so GRESO learns from what they drop); filters (zero-variance by default, length,
format) drop groups, counted by their reason as `data/<policy>/groups_dropped_<reason>`; the rest go
to their policy's buffer (`sink`).

Synchronous mode holds a round's results until the whole round is in (`hold`), then admits them in
lease order (`flush`), so buffer order, curator updates and counters do not depend on which rollout
finished first.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from astratk.dataflow.drops import DropLedger
from astratk.dataflow.learning_signal import agent_counts, episode_totals
from astratk.dataflow.snapshots import same_keys
from astratk.dataflow.stages.base import GroupFilter
from astratk.records import Group, Task

Sink = Callable[[Group], None]
Learn = Callable[[Task, list[float], int], None]


class Admission:
    def __init__(self, policies: Iterable[str], advantage: Callable[[list[float]], Sequence[float]],
                 filters: dict[str, GroupFilter], sink: Sink, curated_role: str,
                 learn: Learn | None = None, frozen: Iterable[str] = ()) -> None:
        self._policies = tuple(policies)
        self._frozen = frozenset(frozen)  # frozen models' names: their groups are counted, never admitted
        self._advantage = advantage
        self.filters = filters
        self._sink = sink
        self._curated_role = curated_role
        self._learn = learn
        # synchronous mode: results held until the round is complete
        self._round: dict[str, list[Group]] = {}
        self.counts: Counter[str] = Counter()
        self.drops = DropLedger()
        self._reward_sum: Counter[str] = Counter()
        # "<pid>/<role>/<metric>" -> sum over received trajectories
        self._traj_sums: Counter[str] = Counter()
        self._traj_counts: Counter[str] = Counter()

    def admit(self, groups: Iterable[Group]) -> int:
        """Admit groups now; returns how many joined a buffer."""
        return sum(self._admit_group(g) for g in groups)

    def hold(self, lease_id: str, groups: Sequence[Group]) -> None:
        self._round[lease_id] = list(groups)

    @property
    def held(self) -> int:
        return len(self._round)

    def flush(self) -> int:
        """Admit the held round in lease order; returns how many groups joined a buffer."""
        admitted = 0
        for lease_id in sorted(self._round, key=lambda lid: int(lid[1:])):
            admitted += self.admit(self._round[lease_id])
        self._round.clear()
        return admitted

    def _admit_group(self, group: Group) -> int:
        pid = group.policy_id
        if pid in self._frozen:
            self._count_frozen(group)
            return 0
        if pid not in self._policies:
            raise ValueError(f"group {group.group_id} is for unknown policy {pid!r}; policies: "
                             f"{list(self._policies)}")
        key = f"data/{pid}/"
        scored = tuple(t for t in group.trajectories if t.reward is not None)
        self.counts[key + "trajectories_unscored_dropped"] += len(group.trajectories) - len(scored)
        if len(scored) < len(group.trajectories):
            self.drops.add("admission", "unscored", "trajectories", pid,
                           len(group.trajectories) - len(scored))
        self.counts[key + "groups_received"] += 1
        self.counts[key + "samples_received"] += len(scored)
        # env metrics (turns, tool calls, tests passed...) per policy and role
        for t in group.trajectories:
            for name, value in t.metrics.items():
                k = f"{pid}/{t.role}/{name}"
                self._traj_sums[k] += float(value)
                self._traj_counts[k] += 1
            agent = agent_counts(t.metrics)  # totals, so that a window's figures are differences of two readings
            if agent is not None:
                self.counts[key + "agent/episodes"] += 1
                for name, value in agent.items():
                    self.counts[key + f"agent/{name}"] += value
        if not scored:
            self.counts[key + "groups_dropped_empty"] += 1
            self.drops.add("admission", "empty", "groups", pid)
            return 0
        rewards = [float(t.reward) for t in scored]  # type: ignore[arg-type]
        self._reward_sum[pid] += sum(rewards)
        # what a starving run reports in words (`astratk.dataflow.learning_signal`): reward and truncation by window
        self.counts[key + "reward_sum_received"] += sum(rewards)
        self.counts[key + "samples_unfinished"] += sum(1 for t in scored if not t.finished)
        group = dataclasses.replace(group, trajectories=scored,
                                    advantages=tuple(self._advantage(rewards)))
        if self._learn is not None and group.role == self._curated_role:
            self._learn(group.task, rewards, group.version)
        for f in self.filters.values():
            reason = f.check(group)
            if reason is not None:
                self.counts[key + f"groups_dropped_{reason}"] += 1
                self.drops.add("admission", reason, "groups", pid)
                return 0
        # The version is computed (and cached) now, not while a trainer waits for its batch.
        group.version  # noqa: B018
        self._sink(group)
        self.counts[key + "groups_admitted"] += 1
        return 1

    def _count_frozen(self, group: Group) -> None:
        """A frozen model's trajectories (a simulated user's turns): what it generated is counted under
        `data/frozen/<name>/`, and nothing of it joins a batch (no trainer reads it; not a dropped sample)."""
        key = f"data/frozen/{group.policy_id}/"
        self.counts[key + "groups"] += 1
        self.counts[key + "trajectories"] += len(group.trajectories)
        self.counts[key + "tokens"] += sum(sum(t.loss_mask) for t in group.trajectories)
        # the episodes' calls to it (`astratk.rollout.frozen`), in whole units: the counters are integers
        totals = episode_totals(group.policy_id, group.trajectories)
        self.counts[key + "episodes"] += round(totals["episodes"])
        self.counts[key + "episode_calls"] += round(totals["calls"])
        self.counts[key + "episode_tokens"] += round(totals["tokens"])
        self.counts[key + "episode_ms"] += round(1000 * totals["seconds"])

    def admitted(self, policy_id: str) -> int:
        return self.counts[f"data/{policy_id}/groups_admitted"]

    # ---------------------------------------------------------------------------- metrics, snapshot
    def metrics(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.counts.items()}
        for pid in self._policies:
            received = self.counts[f"data/{pid}/samples_received"]
            if received:
                out[f"data/{pid}/reward_mean_received"] = self._reward_sum[pid] / received
        # data/<pid>/traj/<role>/<metric>_mean
        for k, total in self._traj_sums.items():
            pid, role, name = k.split("/", 2)
            out[f"data/{pid}/traj/{role}/{name.replace('/', '_')}_mean"] = (
                total / self._traj_counts[k])
        out["data/round_pending"] = float(len(self._round))
        for name, st in self.filters.items():
            out.update({f"data/stage/{name}/{k}": v for k, v in st.metrics().items()})
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"round": {lid: list(groups) for lid, groups in self._round.items()},
                "counts": dict(self.counts),
                "reward_sum": dict(self._reward_sum), "traj_sums": dict(self._traj_sums),
                "traj_counts": dict(self._traj_counts), "drops": self.drops.state_dict(),
                "filters": {k: st.state_dict() for k, st in self.filters.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        same_keys("filters", state["filters"], self.filters)
        self._round = {lid: list(groups) for lid, groups in state["round"].items()}
        self.counts = Counter(state["counts"])
        self._reward_sum = Counter(state["reward_sum"])
        self._traj_sums = Counter(state["traj_sums"])
        self._traj_counts = Counter(state["traj_counts"])
        self.drops.load_state_dict(state["drops"])
        for name, st in self.filters.items():
            st.load_state_dict(state["filters"][name])

