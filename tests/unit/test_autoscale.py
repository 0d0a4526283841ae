"""The wait-fraction rule as golden values, the monitor's EWMAs, and the
adaptive policy on an in-process PoolCluster: it grows the rollout pool when the trainer waits and never retires
`control` (which hosts the data layer) or a worker of another class."""

from __future__ import annotations

import time

import pytest

from astratk.runtime.autoscale import WaitFractionAdaptive, WaitFractionMonitor, decide, wait_fraction
from astratk.spec import AutoscaleSpec, ClusterSpec, RunSpec, WorkerClass


# ----------------------------------------------------------------------------------------------- the pure rule
@pytest.mark.parametrize(("g", "f", "consumed", "produced", "expected"), [
    # f > 0.10: ceil(G / (1 - f))
    (4, 0.50, 1, 1, 8),      # 4 / 0.5 = 8 exactly (float noise must not make it 9)
    (4, 0.11, 1, 1, 5),      # 4 / 0.89 = 4.49 -> 5
    (1, 0.95, 1, 1, 20),     # the cap: 1 / 0.05 = 20
    (1, 0.99, 1, 1, 20),     # f above the cap is capped at 0.95 first
    (3, 0.75, 0, 0, 12),     # 3 / 0.25 = 12; consumption plays no part when scaling up
    # 0.05 <= f <= 0.10: hold
    (4, 0.10, 1, 9, 4),      # the bound itself holds (the rule says f > 0.10)
    (4, 0.05, 1, 9, 4),      # and f < 0.05 is strict
    (4, 0.07, 1, 9, 4),
    # f < 0.05: min(G, ceil(G * consumed / produced * 1.10))
    (4, 0.00, 5, 10, 3),     # 4 * 0.5 * 1.1 = 2.2 -> 3
    (8, 0.01, 1, 4, 3),      # 8 * 0.25 * 1.1 = 2.2 -> 3
    (10, 0.0, 10, 10, 10),   # balanced: 11 -> min(10, 11) = 10, never above G when scaling down
    (4, 0.0, 10, 5, 4),      # consumed > produced (a buffer built earlier drains): min(G, 8.8) = G
    (4, 0.0, 0, 10, 1),      # nothing consumed: at least one worker stays
    (4, 0.0, 5, 0, 4),       # nothing produced in the window: no information, hold
])
def test_rule_golden_values(g, f, consumed, produced, expected):
    assert decide(g, wait_fraction=f, consumed=consumed, produced=produced) == expected


def test_wait_fraction_is_capped_and_zero_before_any_step():
    assert wait_fraction(0.0, 0.0) == 0.0
    assert wait_fraction(3.0, 4.0) == 0.75
    assert wait_fraction(10.0, 10.0) == 0.95  # the whole step was waiting: capped


def test_monitor_ewma_cooldown_and_bounds():
    m = WaitFractionMonitor(AutoscaleSpec(ewma_decay=0.5, cooldown_steps=2, minimum=1, maximum=6))
    assert m.decision(2) == 2  # no step yet: hold
    m.observe_step(wait_s=4.0, step_s=5.0)  # first sample initialises: wait 4, step 5
    assert m.decision(2) == 2  # one step < cooldown 2: hold
    m.observe_step(wait_s=2.0, step_s=3.0)  # EWMA: wait 0.5*4 + 0.5*2 = 3, step 0.5*5 + 0.5*3 = 4 -> f = 0.75
    assert m.wait_ewma == 3.0 and m.step_ewma == 4.0 and m.fraction == 0.75
    assert m.decision(2) == 6  # ceil(2 / 0.25) = 8, clamped to maximum 6
    assert m.decision(6) == 6  # resized: cooling down for 2 steps
    m.observe_step(0.0, 4.0)
    m.observe_step(0.0, 4.0)  # wait EWMA 0.75, step 4 -> f = 0.1875: still starving
    assert m.decision(6) == 6  # ceil(6 / 0.8125) = 8 -> clamped to 6
    for _ in range(6):
        m.observe_step(0.0, 4.0)  # wait EWMA halves each step: 0.75 / 64 -> f ~ 0.003
    m.observe_counts(consumed=10, produced=20)
    assert m.decision(6) == 4  # ceil(6 * 0.5 * 1.1) = ceil(3.3) = 4
    assert [h["target"] for h in m.history][-1] == 4


def test_monitor_scales_down_on_the_window_not_the_totals():
    m = WaitFractionMonitor(AutoscaleSpec(ewma_decay=0.0, cooldown_steps=0))
    m.observe_step(0.0, 1.0)
    m.observe_counts(consumed=100, produced=100)
    assert m.decision(4) == 4  # balanced window: min(4, ceil(4.4)) = 4
    m.observe_counts(consumed=110, produced=140)  # this window: 10 consumed of 40 produced
    assert m.decision(4) == 2  # ceil(4 * 0.25 * 1.1) = ceil(1.1) = 2


def test_consumed_counts_fresh_groups_only_with_replay():
    """With replay, a served batch holds groups no producer made for it: counting them as consumed would inflate the
    scale-down target by 1 / (1 - ratio). A real data layer with replay ratio 0.5 serves 2 batches of 2 (the first
    all fresh, the second 1 replayed + 1 fresh) out of 8 admitted: 4 served, 1 replayed, so 3 fresh consumed."""
    from astratk.dataflow.stages import Replay
    from tests.unit.test_datalayer import admit_all, make

    dl = make(replay=Replay(ratio=0.5), prefetch_steps=4)
    admit_all(dl, dl.lease(8))
    assert dl.next_batch("main", 0) is not None and dl.next_batch("main", 1) is not None
    m = dl.metrics()
    assert (m["data/main/groups_served"], m["data/main/groups_replayed"], m["data/main/groups_admitted"]) == (4, 1, 8)
    monitor = WaitFractionMonitor(AutoscaleSpec(ewma_decay=0.0, cooldown_steps=0))
    monitor.observe_step(0.0, 1.0)  # f = 0: the trainer keeps up
    monitor.observe_datalayer(m, "main")
    # ceil(4 * 3 / 8 * 1.1) = ceil(1.65) = 2; served-based it would be ceil(4 * 4 / 8 * 1.1) = ceil(2.2) = 3
    assert monitor.decision(4) == 2
    assert (monitor.history[-1]["consumed"], monitor.history[-1]["produced"]) == (3.0, 8.0)


def test_the_session_feeds_the_monitor_fresh_counts():
    """The trainer's per-step feed reads the data layer's metrics and hands the monitor fresh groups, not served."""
    from types import SimpleNamespace

    from astratk.runtime.session import Session

    metrics = {"data/main/groups_served": 20.0, "data/main/groups_replayed": 10.0, "data/main/groups_admitted": 40.0}
    monitor = WaitFractionMonitor(AutoscaleSpec(ewma_decay=0.0, cooldown_steps=0))
    fake = SimpleNamespace(autoscale=monitor, cluster=SimpleNamespace(pool=lambda: ["rollout-0"]),
                           deployment=SimpleNamespace(datalayer=SimpleNamespace(metrics=lambda: metrics)))
    feed = Session._autoscale_feed(fake, "main", SimpleNamespace(last_wait_s=0.0))
    assert feed()["autoscale/main/rollout_workers"] == 1.0
    assert monitor.decision(4) == 2  # ceil(4 * (20 - 10) / 40 * 1.1) = ceil(1.1) = 2, not ceil(2.2) = 3
    assert monitor.history[-1]["consumed"] == 10.0


def test_cluster_autoscale_spec_is_validated():
    spec = RunSpec(cluster=ClusterSpec(autoscale=AutoscaleSpec(minimum=3, maximum=2)))
    with pytest.raises(ValueError, match="minimum <= maximum"):
        spec.validate()
    spec = RunSpec(cluster=ClusterSpec(autoscale=AutoscaleSpec(pool="nope")))
    with pytest.raises(ValueError, match="no worker class 'nope'"):
        spec.validate()
    spec = RunSpec(cluster=ClusterSpec(pools=[WorkerClass("gpu", 1, resources={"gpu": 1})]))
    with pytest.raises(ValueError, match="no worker carries"):
        spec.validate()
    with pytest.raises(ValueError, match="control"):
        RunSpec(cluster=ClusterSpec(pools=[WorkerClass("control", 1)])).validate()
    with pytest.raises(ValueError, match="slowdown"):
        RunSpec(cluster=ClusterSpec(pools=[WorkerClass("slow", 1, slowdown=0.5)])).validate()


def test_pools_and_autoscale_parse_from_yaml(tmp_path):
    import yaml

    from astratk.config import dump_spec, parse

    cfg = {"cluster": {"pools": [{"name": "gpu_fast", "count": 1},
                                 {"name": "gpu_slow", "count": 2, "slowdown": 3.0,
                                  "resources": {"rollout_main": 1, "score": 1, "gpu_slow": 1}}],
                       "autoscale": {"pool": "gpu_slow", "maximum": 4}}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    spec = parse(["--config", str(path)])
    slow = spec.cluster.pools[1]
    assert isinstance(slow, WorkerClass) and slow.slowdown == 3.0 and slow.resources["gpu_slow"] == 1
    assert spec.cluster.pools[0].resources is None  # null: the rollout labels of every policy
    assert spec.cluster.autoscale.pool == "gpu_slow" and spec.cluster.autoscale.maximum == 4
    again = tmp_path / "again.yaml"
    again.write_text(dump_spec(spec))  # the saved config reads back
    assert parse(["--config", str(again)]).cluster == spec.cluster


def test_worker_specs_label_each_class():
    from astratk.runtime.pools import worker_specs

    spec = RunSpec(cluster=ClusterSpec(pools=[WorkerClass("gpu_fast", 1),
                                              WorkerClass("gpu_slow", 2, {"rollout_main": 1, "score": 1, "gpu_slow": 1},
                                                          slowdown=3.0, nthreads=2)]))
    specs = worker_specs(spec, processes=False)
    assert list(specs) == ["control", "gpu_fast-0", "gpu_slow-0", "gpu_slow-1"]
    assert specs["control"]["options"]["resources"] == {"control": 1}
    assert specs["gpu_fast-0"]["options"]["resources"] == {"rollout_main": 1, "score": 1}
    slow = specs["gpu_slow-1"]["options"]
    assert slow["resources"]["gpu_slow"] == 1 and slow["nthreads"] == 2
    [plugin] = slow["plugins"]
    assert (plugin.worker_class, plugin.slowdown) == ("gpu_slow", 3.0)


# ------------------------------------------------------------------------------- on an in-process PoolCluster
def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f}s for {what}")
        time.sleep(0.05)


def _names(cluster) -> set[str]:
    return {str(w["name"]) for w in cluster.scheduler_info["workers"].values()}


@pytest.fixture
def pool_cluster():
    from astratk.runtime.pools import start_pool_cluster

    spec = RunSpec(cluster=ClusterSpec(pools=[WorkerClass("rollout", 1), WorkerClass("judge", 1)]))
    cluster = start_pool_cluster(spec, processes=False)  # in-process workers: fine for a unit test
    yield cluster
    cluster.close()


def test_scale_touches_the_elastic_class_only(pool_cluster):
    c = pool_cluster
    assert c.elastic == "rollout" and c.protected() == {"control", "judge-0"}
    c.scale_pool(3)
    _wait_for(lambda: {"rollout-1", "rollout-2"} <= _names(c), 30, "two rollout workers to join")
    c.scale(1)  # Dask's meaning, total workers: the elastic class absorbs it, and cannot go below 0
    _wait_for(lambda: _names(c) == {"control", "judge-0"}, 30, "the rollout pool to empty")
    c.scale_pool(1)
    _wait_for(lambda: "rollout-3" in _names(c), 30, "a new rollout worker (names are never reused)")


def test_adaptive_grows_the_pool_when_the_trainer_waits_and_never_retires_control(pool_cluster):
    c = pool_cluster
    monitor = WaitFractionMonitor(AutoscaleSpec(cooldown_steps=0, minimum=1, maximum=3, wait_count=1))
    adaptive = c.adapt(Adaptive=WaitFractionAdaptive, monitor=monitor, interval=0.1)
    try:
        assert isinstance(adaptive, WaitFractionAdaptive)
        monitor.observe_step(wait_s=0.9, step_s=1.0)  # the trainer waits 90% of each step: f = 0.9
        _wait_for(lambda: len(c.pool()) == 3, 30, "the rollout pool to grow to its maximum")
        _wait_for(lambda: {"rollout-1", "rollout-2"} <= _names(c), 30, "the new workers to join")
        monitor.observe_step(0.0, 1.0)  # the trainer stopped waiting, and took a quarter of what was produced
        monitor.observe_step(0.0, 1.0)
        monitor.wait_ewma = 0.0
        monitor.observe_counts(consumed=10, produced=40)
        _wait_for(lambda: len(c.pool()) < 3, 30, "the pool to shrink")
        for _ in range(20):  # keep asking for less: the pool bottoms out at minimum, control and judge stay
            monitor.observe_counts(consumed=monitor._consumed + 1, produced=monitor._produced + 100)
            time.sleep(0.1)
        _wait_for(lambda: len(c.pool()) == 1, 30, "the pool to reach its minimum")
        assert {"control", "judge-0"} <= _names(c) and "control" in c.worker_spec
        assert all(h["target"] >= 1 for h in monitor.history)
    finally:
        adaptive.stop()


def test_closing_closes_every_class(pool_cluster):
    """SpecCluster closes with `scale(0)`: the pool-only `scale` must not keep control and the other classes (they
    would be left to die with the scheduler)."""
    pool_cluster.close()
    assert pool_cluster.worker_spec == {} and pool_cluster.workers == {}
