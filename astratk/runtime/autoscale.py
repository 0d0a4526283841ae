"""Auto-scaling the rollout pool with AstraFlow's wait-fraction rule (docs/architecture.md, "Auto-scaling rule").

    f = EWMA(trainer wait on next batch) / EWMA(step time), capped at 0.95
    f > 0.10  ->  G' = ceil(G / (1 - f))                          the trainer starves: add rollout capacity
    f < 0.05  ->  G' = min(G, ceil(G * consumed / produced * 1.10))  the trainer keeps up: shed surplus producers
    otherwise ->  G' = G

G is the rollout pool's size; consumed / produced are fresh groups the trainer took vs groups admitted over the window
since the last decision. Replayed groups (the replay stage) are not counted as consumed: no producer made them for
this batch, and with replay ratio r counting them would inflate the scale-down target by 1 / (1 - r). Step time is a
whole trainer step on the wall clock (the wait included), so f is the fraction of training time spent waiting. Our
choices where the paper is silent: EWMA decay 0.8 (`AutoscaleSpec.ewma_decay`); no decision until `cooldown_steps`
trainer steps have been observed since the last resize (workers take seconds to start and the EWMAs need steps to see
them; without it the rule would compound the same starvation every interval); no scale-down without production in
the window.

Three pieces: `decide` is the pure rule; `WaitFractionMonitor` keeps the EWMAs (fed by the trainer, read by the
scaler, thread-safe); `WaitFractionAdaptive` is a `distributed.deploy.Adaptive` whose target is the rule's, applied to
one worker class of a `PoolCluster` and never to `control` (which hosts the data layer) or other classes.

Example:
    >>> decide(4, wait_fraction=0.5, consumed=10, produced=10)   # ceil(4 / 0.5)
    8
    >>> decide(4, wait_fraction=0.0, consumed=5, produced=10)    # min(4, ceil(4 * 0.5 * 1.1)) = ceil(2.2)
    3
    >>> decide(4, wait_fraction=0.07, consumed=5, produced=10)   # between the thresholds: hold
    4

Extending: another policy is another `decide`-like function behind the same monitor; `Adaptive` does the rest.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from typing import Any

from distributed.deploy import Adaptive

from astratk.spec import AutoscaleSpec

__all__ = ["AutoscaleSpec", "WaitFractionAdaptive", "WaitFractionMonitor", "decide", "wait_fraction"]

log = logging.getLogger(__name__)

F_CAP = 0.95  # f is capped: at f -> 1, G / (1 - f) is unbounded
UP_ABOVE = 0.10
DOWN_BELOW = 0.05
HEADROOM = 1.10


def _ceil(x: float) -> int:
    """ceil that forgives float noise: 4 / (1 - 0.5) may come out as 8.000000000000002."""
    return math.ceil(x - 1e-9)


def wait_fraction(wait_s: float, step_s: float) -> float:
    """EWMA(wait) / EWMA(step time), capped at 0.95; 0 before any step."""
    if step_s <= 0:
        return 0.0
    return min(F_CAP, max(0.0, wait_s / step_s))


def decide(pool_size: int, *, wait_fraction: float, consumed: float, produced: float) -> int:
    """The rule's target pool size for the current size G = `pool_size` (see the module docstring)."""
    g = pool_size
    f = min(F_CAP, wait_fraction)
    if f > UP_ABOVE:
        return _ceil(g / (1.0 - f))
    if f < DOWN_BELOW and produced > 0:
        return min(g, max(1, _ceil(g * consumed / produced * HEADROOM)))
    return g


class WaitFractionMonitor:
    """The EWMAs the rule reads. The trainer calls `observe_step` after every step (and `observe_datalayer` with the
    data layer's metrics, or `observe_counts` with cumulative consumed/produced groups); the scaler calls
    `decision(G)`.

    Example:
        >>> m = WaitFractionMonitor(AutoscaleSpec(cooldown_steps=1))
        >>> m.observe_step(wait_s=3.0, step_s=4.0); m.observe_counts(consumed=8, produced=8)
        >>> m.decision(2)   # f = 0.75 -> ceil(2 / 0.25)
        8
        >>> m.decision(8)   # no step observed since the resize: hold
        8
    """

    def __init__(self, spec: AutoscaleSpec | None = None) -> None:
        self.spec = spec or AutoscaleSpec()
        self._lock = threading.Lock()
        self.wait_ewma = 0.0
        self.step_ewma = 0.0
        self.steps = 0
        self._steps_at_change = 0
        self._consumed = self._produced = 0.0  # cumulative, as last observed
        self._window_start = (0.0, 0.0)  # cumulative (consumed, produced) at the last decision
        self.history: list[dict[str, float]] = []  # one row per decision (for metrics and tests)

    def observe_step(self, wait_s: float, step_s: float) -> None:
        d = self.spec.ewma_decay
        with self._lock:
            if self.steps == 0:
                self.wait_ewma, self.step_ewma = wait_s, step_s
            else:
                self.wait_ewma = d * self.wait_ewma + (1 - d) * wait_s
                self.step_ewma = d * self.step_ewma + (1 - d) * step_s
            self.steps += 1

    def observe_counts(self, consumed: float, produced: float) -> None:
        with self._lock:
            self._consumed, self._produced = float(consumed), float(produced)

    def observe_datalayer(self, metrics: Mapping[str, float], policy_id: str) -> None:
        """`observe_counts` from the data layer's cumulative counters for `policy_id`: consumed = fresh groups served
        (`groups_served` counts replayed ones too, so `groups_replayed` is taken off), produced = `groups_admitted`."""
        k = f"data/{policy_id}/"
        fresh = metrics.get(k + "groups_served", 0.0) - metrics.get(k + "groups_replayed", 0.0)
        self.observe_counts(consumed=fresh, produced=metrics.get(k + "groups_admitted", 0.0))

    @property
    def fraction(self) -> float:
        return wait_fraction(self.wait_ewma, self.step_ewma)

    def decision(self, pool_size: int) -> int:
        """The rule's target for the current pool size, or `pool_size` while cooling down (or before any step).
        Clamped to [minimum, maximum]."""
        with self._lock:
            if self.steps == 0 or self.steps - self._steps_at_change < self.spec.cooldown_steps:
                return pool_size
            consumed = self._consumed - self._window_start[0]
            produced = self._produced - self._window_start[1]
            f = self.fraction
            target = decide(pool_size, wait_fraction=f, consumed=consumed, produced=produced)
            target = max(self.spec.minimum, min(self.spec.maximum, target))
            self._window_start = (self._consumed, self._produced)
            if target != pool_size:
                self._steps_at_change = self.steps
            self.history.append({"steps": float(self.steps), "wait_fraction": f, "pool_size": float(pool_size),
                                 "target": float(target), "consumed": consumed, "produced": produced})
            return target


class WaitFractionAdaptive(Adaptive):
    """Dask adaptive scaling whose target is the wait-fraction rule, for one worker class of a `PoolCluster`.

    Dask's `Adaptive` counts every worker of the cluster, so the target it gets is (workers outside the pool) + the
    rule's pool size, and `workers_to_close` picks only from the pool: idle, low-memory workers first (Dask's own
    ordering), never `control` (it hosts the data-layer actor, which dies with its worker) nor another class.

    Example:
        >>> cluster = start_pool_cluster(spec)  # doctest: +SKIP
        >>> monitor = WaitFractionMonitor(spec.cluster.autoscale)  # doctest: +SKIP
        >>> adaptive = cluster.adapt(Adaptive=WaitFractionAdaptive, monitor=monitor, interval="5s")  # doctest: +SKIP
    """

    def __init__(self, cluster: Any, monitor: WaitFractionMonitor, pool: str | None = None, **kwargs: Any) -> None:
        self.monitor = monitor
        self.pool_name = pool or cluster.elastic
        kwargs.setdefault("wait_count", monitor.spec.wait_count)
        kwargs.setdefault("interval", monitor.spec.interval_s)
        # The pool's bounds are the monitor's; Dask's bounds count all workers, so leave them open.
        kwargs.update(minimum=0, maximum=math.inf)
        super().__init__(cluster, **kwargs)

    def _pool(self) -> list[str]:
        return self.cluster.pool(self.pool_name)

    async def target(self) -> int:
        pool = self._pool()
        fixed = len(self.cluster.worker_spec) - len(pool)
        new = self.monitor.decision(len(pool))
        if new != len(pool):
            log.info("wait-fraction %.2f: rollout pool %r %d -> %d", self.monitor.fraction, self.pool_name,
                     len(pool), new)
        return fixed + new

    async def scale_down(self, workers: Any) -> None:
        """Dask's `Adaptive.scale_down` retires on the scheduler *before* asking the cluster: filter here, so a worker
        outside the pool (e.g. `control`, listed by Dask as not yet arrived at start-up) is never retired."""
        pool = set(self._pool())
        refused = [w for w in workers if w not in pool]
        if refused:
            log.warning("not retiring %s: outside the rollout pool %r", refused, self.pool_name)
        await super().scale_down([w for w in workers if w in pool])

    async def workers_to_close(self, target: int) -> list[str]:
        n = len(self.cluster.worker_spec) - target
        if n <= 0:
            return []
        pool = set(self._pool())
        # Dask's ranking of every worker (idle and low-memory first); we keep the pool's members only.
        ranked = await self.scheduler.workers_to_close(n=len(self.cluster.scheduler_info.get("workers", {})),
                                                       attribute="name")
        chosen = [str(w) for w in ranked if str(w) in pool][:n]
        for w in reversed(self._pool()):  # a member Dask did not rank (not started, or long-running): newest first
            if len(chosen) >= n:
                break
            if w not in chosen:
                chosen.append(w)
        return chosen
