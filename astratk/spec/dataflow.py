"""The data layer's settings (`DataflowSpec`, with its snapshots `SnapshotSpec`) and its stages at the three points
(`astratk.dataflow.stages`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from astratk.dataflow.stages.base import Curator, GroupFilter, ServingOrder
from astratk.dataflow.stages.serving import FIFO, Mixing, Replay
from astratk.spec.base import Section, positive


@dataclass
class SnapshotSpec(Section):
    """Where and how often the data layer writes its state (`astratk.dataflow.snapshots`). It also
    writes one at every trainer checkpoint step (`trainer.checkpoint_every`), which `resume_from`
    pairs with that checkpoint."""

    SPEC_KEY = "dataflow.snapshot"

    url: str | None = None
    """fsspec URL; None: <run dir>/datalayer"""
    every_steps: int | None = 1
    """periodic: when every k-th step's batch is served (the state a replacement actor continues from without serving a
    group twice); None: off"""
    keep_last: int = 3
    """periodic snapshots kept (checkpoint-paired ones are kept as long as their checkpoints)"""

    def validate(self, key: str = "dataflow.snapshot") -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError(f"{key}.every_steps must be >= 1 or null (no periodic snapshots), got "
                             f"{self.every_steps}")
        if self.keep_last < 1:
            raise ValueError(f"{key}.keep_last must be >= 1, got {self.keep_last}")


@dataclass
class DataflowSpec(Section):
    """The data layer's knobs and its stages at the three points (`astratk.dataflow.stages`
    documents each)."""

    SPEC_KEY = "dataflow"

    max_staleness: int = 4
    """drop groups whose oldest token is more than this many versions behind"""
    lease_timeout_s: float = 120.0
    """a leased task not admitted by then is re-issued"""
    advantage: str = "dr_grpo"
    """group advantage: dr_grpo | grpo | rloo (astratk.dataflow.advantages)"""
    filter_zero_variance: bool = True
    """drop groups whose rewards are all equal (no learning signal), counted; sugar for a `zero_variance` filter first
    in `filters`"""
    max_task_attempts: int = 3
    """a task whose rollout failed this many times is dropped, counted"""
    prefetch_steps: float = 2.0
    """back-pressure: lease only while buffered + in-flight tasks < this many steps' worth; >= 1 (a step is served
    only once a whole step's groups are buffered), 1 for the most on-policy pipeline"""
    curators: list[Curator] = field(default_factory=list)
    """before rollout: every curator must accept a new task (accept_all | filter_solved | greso | curriculum)"""
    max_curator_skips: int = 10_000
    """lease() raises after this many tasks in a row refused by curators"""
    filters: list[GroupFilter] = field(default_factory=list)
    """after rollout: groups a filter rejects are dropped, counted by reason (zero_variance | length_filter | ...)"""
    lag_decay: float = 1.0
    """at serving: a served group's weight is lag_decay ** (current version - its version); 1.0 = no decay"""
    order: ServingOrder = field(default_factory=FIFO)
    """fifo | edf"""
    replay: Replay | None = None
    """a replay share of every batch (class_path: replay)"""
    mixing: Mixing | None = None
    """per-env shares of every batch, by task.env (class_path: mixing)"""
    version_barrier: int | None = None
    """multi-policy: a policy's step-k batch is served only once every other policy has version >= k - version_barrier
    (0: lock-step versions, so evaluations pair equal versions); None: policies advance independently"""
    synchronous: bool = False
    """the switch for the synchronous deterministic mode (the benchmarks' baseline, and the mode in which resume is
    exact): rollouts for step k start only after version k is published, and a round of tasks is admitted in lease
    order once all of it is in; implies max_staleness 0, needs one rollout worker and publish_every 1"""
    snapshot: SnapshotSpec = field(default_factory=SnapshotSpec)
    """where and how often the data layer writes its state (restarts, resumes)"""

    def validate(self, key: str = "dataflow") -> None:
        """Ranges and stage types; `advantage` and `mixing` against the env are checked in
        `astratk.spec.rules`."""
        if self.max_staleness < 0:
            raise ValueError(f"{key}.max_staleness must be >= 0, got {self.max_staleness}")
        positive(key, lease_timeout_s=self.lease_timeout_s, prefetch_steps=self.prefetch_steps,
                  max_task_attempts=self.max_task_attempts,
                  max_curator_skips=self.max_curator_skips)
        if self.prefetch_steps < 1:
            raise ValueError(f"{key}.prefetch_steps must be >= 1, got {self.prefetch_steps}: a step is served only "
                             f"once groups_per_step groups are buffered, and leasing stops at prefetch_steps steps' "
                             f"worth, so step 0 would never come. Use 1 (lease one step ahead: the most on-policy) "
                             f"or more (2 is the default)")
        if self.version_barrier is not None and self.version_barrier < 0:
            raise ValueError(f"{key}.version_barrier must be >= 0 (0 = lock-step) or null (off), "
                             f"got {self.version_barrier}")
        self.snapshot.validate(f"{key}.snapshot")
        if not 0.0 < self.lag_decay <= 1.0:
            raise ValueError(f"{key}.lag_decay must be in (0, 1] (1 = no decay), got "
                             f"{self.lag_decay}")
        for name, items, kind in (("curators", self.curators, Curator),
                                  ("filters", self.filters, GroupFilter)):
            for i, stage in enumerate(items):
                if not isinstance(stage, kind):
                    raise ValueError(  # noqa: TRY004
                        f"{key}.{name}[{i}]: expected an astratk.dataflow.stages.{kind.__name__}, "
                        f"got {type(stage).__name__}")
        serving: tuple[tuple[str, object, type], ...] = (("order", self.order, ServingOrder),
                                                         ("replay", self.replay, Replay),
                                                         ("mixing", self.mixing, Mixing))
        for name, one, cls in serving:
            if one is not None and not isinstance(one, cls):
                raise ValueError(f"{key}.{name}: expected an "
                                 f"astratk.dataflow.stages.{cls.__name__}, got "
                                 f"{type(one).__name__}")
        if self.order is None:
            raise ValueError(f"{key}.order: required; use {{class_path: fifo}} (arrival order) or "
                             "{class_path: edf}")

