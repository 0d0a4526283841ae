"""Serving stages: how a step's batch is drawn from a policy's buffer (the third stage point).

A batch of n groups is assembled in this order (`DataLayer._take`):
1. staleness — a buffered group is dropped (counted) iff current - group.version > max_staleness (a gap equal to the
   bound is kept); `Staleness`, built from `DataflowSpec.max_staleness` and `lag_decay`;
2. replay — ⌊n × ratio⌋ groups are taken first from the replay buffer (groups served fresh before), by the
   selector (`recent`: most recent first, AstraFlow's `latest`); fewer when it holds fewer, and fresh groups fill
   the rest (counted as `short`). Replayed groups are not re-added (AstraFlow's rule: a group can be replayed again
   while it stays in the last `capacity` served), but they obey the staleness bound like fresh ones: before each
   batch the replay buffer evicts groups that would be stale at the version the batch is trained from (counted as
   `stale_evicted`; AstraFlow does not re-check them, we do, so no token is ever trained beyond its bound);
3. order — the fresh groups are ranked: `fifo` by arrival, `edf` by version ascending, ties by arrival;
4. mixing — the fresh slots are shared across envs (`group.task.env`) in proportion to `ratios`, by smooth weighted
   round-robin whose credits carry over between batches (so rounding is fair over time); each env's slots take its
   first groups in serving order. Slots an env cannot fill go to the earliest remaining groups of any env (counted
   as `short_<env>` and `filled_from_<env>`), and the short env is charged as if served: a source that dries up
   never blocks training, and does not get a burst later. (Waiting instead could deadlock: back-pressure stops
   leasing once the buffer is full of the other envs' groups, so the missing env's groups would never come.)
5. weights — each served group (fresh or replayed) gets `weight = lag_decay ** (current - version)`, which the
   collate multiplies into `TrainBatch.weights` (1 everywhere when lag_decay is 1).
A batch is assembled only when enough fresh groups are buffered; until then nothing but stale drops changes.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from typing import Any

from astratk.dataflow.stages.base import ServingOrder, Stage, rng_state, set_rng_state
from astratk.records import Group


class Staleness(Stage):
    """Max-staleness drop and lag-decay weighting, from `DataflowSpec.max_staleness` and `lag_decay`.

    >>> s = Staleness(max_staleness=2, lag_decay=0.5)
    >>> s.is_stale(version=1, current=3), s.is_stale(version=0, current=3), s.weight(version=1, current=3)
    (False, True, 0.25)
    """

    name = "staleness"

    def __init__(self, max_staleness: int = 4, lag_decay: float = 1.0) -> None:
        if max_staleness < 0 or not 0.0 < lag_decay <= 1.0:
            raise ValueError(f"staleness: need max_staleness >= 0 and 0 < lag_decay <= 1, got {max_staleness}, "
                             f"{lag_decay}")
        self.max_staleness, self.lag_decay = int(max_staleness), float(lag_decay)

    def is_stale(self, version: int, current: int) -> bool:
        return current - version > self.max_staleness

    def fresh(self, groups: Iterable[Group], current: int) -> list[Group]:
        """The groups that are not stale, in their order (`is_stale` over a whole buffer, without a call per group)."""
        oldest = current - self.max_staleness
        return [g for g in groups if g.version >= oldest]

    def weight(self, version: int, current: int) -> float:
        return self.lag_decay ** max(0, current - version) if self.lag_decay != 1.0 else 1.0


# ---------------------------------------------------------------------------------------------------------- order
class FIFO(ServingOrder):
    """Serve in arrival order (AstraFlow's `fifo`)."""

    name = "fifo"


class EDF(ServingOrder):
    """Earliest deadline first: the lowest version (the group closest to expiring) first, ties by arrival
    (AstraFlow's `edf`). Long generations span more versions, so FIFO lets them expire more often than short ones;
    EDF uses them before they do."""

    name = "edf"

    def order(self, groups: Sequence[Group]) -> list[Group]:
        return sorted(groups, key=lambda g: g.version)  # sorted() is stable: ties keep arrival order


# --------------------------------------------------------------------------------------------------------- replay
class Replay(Stage):
    """A replay share in every batch: ⌊n × ratio⌋ groups re-served from the last `capacity` groups served fresh.

    Selectors: `recent` (most recent first; AstraFlow's `latest`), `high_advantage` (largest mean |advantage| first,
    ties most recent first), `uniform` (seeded draw without replacement).

    >>> r = Replay(ratio=0.25)
    >>> r.share(16)  # nothing served yet: the replay buffer is empty
    0
    """

    name = "replay"
    SELECTORS = ("recent", "high_advantage", "uniform")

    def __init__(self, ratio: float = 0.25, selector: str = "recent", capacity: int = 1024, seed: int = 0) -> None:
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"replay: ratio must be in [0, 1) (1 would never serve a fresh group), got {ratio}")
        if selector not in self.SELECTORS:
            raise ValueError(f"replay: unknown selector {selector!r}; choose one of {sorted(self.SELECTORS)}")
        if capacity < 1:
            raise ValueError(f"replay: capacity must be >= 1, got {capacity}")
        self.ratio, self.selector, self.capacity, self.seed = float(ratio), selector, int(capacity), int(seed)
        self._buffer: deque[Group] = deque()
        self._rng = random.Random(self.seed)
        self._counts: Counter[str] = Counter()

    def wanted(self, n: int) -> int:
        """⌊n × ratio⌋ (+ 1e-9: 0.29 * 100 is 28.999999999999996 in floating point)."""
        return math.floor(n * self.ratio + 1e-9)

    def share(self, n: int) -> int:
        """Groups of an n-group batch to take from replay: ⌊n × ratio⌋, at most what the buffer holds."""
        return min(self.wanted(n), len(self._buffer))

    def select(self, n: int) -> list[Group]:
        """The replay share of an n-group batch (`share(n)` groups; the buffer keeps them). Counts the groups
        replayed and those wanted but missing (`short`: the fresh share grows by as many)."""
        buf, k = self._buffer, self.share(n)
        self._counts["short"] += self.wanted(n) - k
        if k <= 0:
            return []
        if self.selector == "recent":
            chosen = [buf[-1 - i] for i in range(k)]
        elif self.selector == "high_advantage":
            ranked = sorted(range(len(buf)), key=lambda i: (-_mean_abs_advantage(buf[i]), -i))
            chosen = [buf[i] for i in ranked[:k]]
        else:
            chosen = [buf[i] for i in self._rng.sample(range(len(buf)), k)]
        self._counts["replayed"] += k
        return chosen

    def evict_older_than(self, oldest: int) -> None:
        """Evict groups whose version is below `oldest` (counted `stale_evicted`): they would be stale."""
        kept = deque(g for g in self._buffer if g.version >= oldest)
        if len(kept) < len(self._buffer):
            self._counts["stale_evicted"] += len(self._buffer) - len(kept)
            self._buffer = kept

    def add(self, groups: Iterable[Group]) -> None:
        for g in groups:
            self._buffer.append(g)
            if len(self._buffer) > self.capacity:
                self._buffer.popleft()
                self._counts["evicted"] += 1

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": list(self._buffer), "rng": rng_state(self._rng), "counts": dict(self._counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._buffer = deque(state["buffer"])
        set_rng_state(self._rng, state["rng"])
        self._counts = Counter(state["counts"])

    def metrics(self) -> dict[str, float]:
        return {"size": float(len(self._buffer)), **{k: float(v) for k, v in self._counts.items()}}


def _mean_abs_advantage(group: Group) -> float:
    adv = group.advantages or ()
    return sum(abs(a) for a in adv) / len(adv) if adv else 0.0


# --------------------------------------------------------------------------------------------------------- mixing
class Mixing(Stage):
    """Share each batch's fresh slots across envs (`group.task.env`, e.g. the sources of a `MixtureEnv`) in
    proportion to `ratios` (normalised; they need not sum to 1). Groups of envs not listed are served only to fill
    a slot whose env is short.

    >>> m = Mixing(ratios={"arithmetic": 3, "math_word": 1})
    >>> m.slot_envs(8)
    ['arithmetic', 'arithmetic', 'math_word', 'arithmetic', 'arithmetic', 'arithmetic', 'math_word', 'arithmetic']
    """

    name = "mixing"

    def __init__(self, ratios: dict[str, float]) -> None:
        if not ratios or any(not w > 0 for w in ratios.values()):
            raise ValueError(f"mixing: ratios must name at least one env, each with a weight > 0; got {ratios}")
        self.ratios = {str(k): float(v) for k, v in ratios.items()}
        total = sum(self.ratios.values())
        self._share = {k: v / total for k, v in self.ratios.items()}
        self._credit = {k: 0.0 for k in self.ratios}
        self._counts: Counter[str] = Counter()

    def slot_envs(self, m: int) -> list[str]:
        """The env of each of the next m slots (smooth weighted round-robin; advances the credits)."""
        out = []
        for _ in range(m):
            for k, s in self._share.items():
                self._credit[k] += s
            pick = max(self._credit, key=self._credit.__getitem__)  # ties: the first listed
            self._credit[pick] -= 1.0
            out.append(pick)
        return out

    def pick(self, ordered: Sequence[Group], m: int) -> list[Group]:
        """m groups from `ordered` (serving order, at least m of them), shared by env; see the module docstring.
        One pass reserves each env's quota (its first groups in serving order); slots an env cannot fill then take
        the earliest groups nobody reserved."""
        slots = self.slot_envs(m)
        quota = Counter(slots)
        reserved: dict[str, list[int]] = {env: [] for env in quota}
        missing = m
        for i, g in enumerate(ordered):  # stops as soon as every quota is met: a long backlog is not scanned
            mine = reserved.get(g.task.env)
            if mine is not None and len(mine) < quota[g.task.env]:
                mine.append(i)
                missing -= 1
                if not missing:
                    break
        taken = {i for idx in reserved.values() for i in idx}
        spare = (i for i in range(len(ordered)) if i not in taken)
        used: Counter[str] = Counter()
        out: list[Group] = []
        for env in slots:
            if used[env] < len(reserved[env]):
                i = reserved[env][used[env]]
                used[env] += 1
                self._counts[f"served_{env}"] += 1
            else:
                i = next(spare)
                self._counts[f"short_{env}"] += 1
                self._counts[f"filled_from_{ordered[i].task.env}"] += 1
            out.append(ordered[i])
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"credit": dict(self._credit), "counts": dict(self._counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state["credit"]) != set(self.ratios):
            raise ValueError(f"mixing: state is for envs {sorted(state['credit'])}, this stage mixes "
                             f"{sorted(self.ratios)}")
        self._credit = {k: float(v) for k, v in state["credit"].items()}
        self._counts = Counter(state["counts"])

    def metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in self._counts.items()}
