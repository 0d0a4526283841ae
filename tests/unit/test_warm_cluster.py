"""`astratk.runtime.warm`: which runs may share a kept local cluster, when a kept one is refused, and that a run's
rollout services are released from a worker that outlives it. The real reuse by consecutive runs is in
tests/integration/test_local_run.py."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from types import SimpleNamespace

import pytest

from astratk.runtime import warm
from astratk.spec import AutoscaleSpec, ClusterSpec, PolicySpec, RunSpec, WorkerClass


def spec(**cluster) -> RunSpec:
    return RunSpec(cluster=ClusterSpec(**cluster))


class FakeCluster:
    """What warm.py reads of a SpecCluster: status, planned workers, the scheduler's view; counts closes."""

    def __init__(self, names=("control", "rollout-0"), up=None):
        from distributed.core import Status

        self.status = Status.running
        self.worker_spec = dict.fromkeys(names)
        up = names if up is None else up
        self.scheduler_info = {"workers": {f"tcp://{n}": {"name": n} for n in up}}
        self.closed = 0

    def close(self):
        self.closed += 1


@pytest.fixture(autouse=True)
def nothing_kept():
    warm.close_kept()
    yield
    warm.close_kept()


def test_the_layout_decides_and_some_clusters_are_never_kept():
    base = warm.layout_key(spec())
    assert base is not None and base == warm.layout_key(spec())
    assert warm.layout_key(spec(startup_timeout_s=5, cpu_linear="torch")) == base  # not a worker property
    assert warm.layout_key(spec(rollout_workers=2)) != base
    assert warm.layout_key(spec(pools=[WorkerClass("fast", 1)])) != base
    two = dataclasses.replace(spec(), policies=[PolicySpec(policy_id="solver"), PolicySpec(policy_id="verifier")])
    assert warm.layout_key(two) != base  # the workers' resource labels name the policies
    assert warm.layout_key(spec(keep_warm_s=0)) == base  # it may take a kept one; it keeps none at its end
    assert warm.layout_key(spec(torch_threads=2)) == base  # set in the kept workers when taken (warm.rethread)
    pinned = os.sched_getaffinity(0)
    if len(pinned) > 1:  # workers spawned on other cores are other workers (what a waiting trainer lends counts them)
        try:
            os.sched_setaffinity(0, {min(pinned)})
            assert warm.layout_key(spec()) != base
        finally:
            os.sched_setaffinity(0, pinned)
        assert warm.layout_key(spec()) == base
    for never in (spec(processes=False), spec(autoscale=AutoscaleSpec()),
                  spec(scheduler_address="tcp://127.0.0.1:8786")):
        assert warm.layout_key(never) is None


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "5", True])
def test_keep_warm_s_must_be_seconds(bad):
    with pytest.raises(ValueError, match=r"cluster\.keep_warm_s"):
        ClusterSpec(keep_warm_s=bad).validate()


def test_a_kept_cluster_is_taken_once_and_only_for_its_layout():
    key, other = warm.layout_key(spec()), warm.layout_key(spec(rollout_workers=2))
    c = FakeCluster()
    assert "kept" in warm.give_back(c, key, 60, set(c.worker_spec), reusable=True)
    assert warm.take(other) is None and warm.take(None) is None
    assert warm.take(key) is c and c.closed == 0
    assert warm.take(key) is None  # the run that took it owns it


@pytest.mark.parametrize("why", ["unclean", "resized", "worker missing", "no layout", "keep 0"])
def test_a_cluster_that_cannot_serve_the_next_run_is_closed(why):
    key = warm.layout_key(spec())
    c = FakeCluster(up=("control",) if why == "worker missing" else None)
    planned = {"control", "rollout-0", "rollout-1"} if why == "resized" else set(c.worker_spec)
    outcome = warm.give_back(c, None if why == "no layout" else key, 0 if why == "keep 0" else 60, planned,
                             reusable=why != "unclean")
    assert outcome == "closed" and c.closed == 1 and warm.take(key) is None


def test_one_cluster_is_kept_the_newest_and_idle_ones_close():
    a, b = FakeCluster(), FakeCluster()
    warm.give_back(a, warm.layout_key(spec()), 60, set(a.worker_spec), reusable=True)
    warm.give_back(b, warm.layout_key(spec(rollout_workers=2)), 60, set(b.worker_spec), reusable=True)
    assert a.closed == 1 and b.closed == 0  # the older one made room
    c = FakeCluster()
    warm.give_back(c, warm.layout_key(spec()), 0.2, set(c.worker_spec), reusable=True)
    time.sleep(0.6)
    assert c.closed == 1 and warm.take(warm.layout_key(spec())) is None  # its idle time ran out
    d = FakeCluster()
    warm.give_back(d, warm.layout_key(spec()), 60, set(d.worker_spec), reusable=True)
    assert warm.close_kept() == 1 and d.closed == 1


def test_a_died_worker_makes_the_kept_cluster_unusable():
    key, c = warm.layout_key(spec()), FakeCluster()
    warm.give_back(c, key, 60, set(c.worker_spec), reusable=True)
    c.scheduler_info = {"workers": {"tcp://control": {"name": "control"}}}  # rollout-0 died while it waited
    assert warm.take(key) is None and c.closed == 1


def test_edited_code_is_not_run_by_kept_workers(tmp_path, monkeypatch):
    """Workers keep the modules they imported: a source file edited since the cluster was kept refuses it."""
    (tmp_path / "my_reward_mod.py").write_text("def reward(x):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_reward_mod  # noqa: F401 - loaded in this process, as a run's env would be

    key, c = warm.layout_key(spec()), FakeCluster()
    warm.give_back(c, key, 60, set(c.worker_spec), reusable=True)
    assert str(tmp_path / "my_reward_mod.py") in warm.source_stamp()
    path = tmp_path / "my_reward_mod.py"
    path.write_text("def reward(x):\n    return 0.0\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a later mtime, whatever the clock's resolution
    assert warm.take(key) is None and c.closed == 1
    sys.modules.pop("my_reward_mod", None)


def test_a_released_service_closes_its_engines_and_is_refused_after(tiny_ctx):
    from astratk.rollout import service as svc
    from astratk.rollout.services import SERVICES, release_service

    s = svc.get_service(tiny_ctx)
    closed = []
    s._engines[("rollout", "main")] = SimpleNamespace(close=lambda: closed.append("own"))
    shared = SimpleNamespace(close=lambda: closed.append("shared"))
    s._bases["/m"] = shared
    s._engines[("eval", "main")] = shared  # a view and its base: closed once
    assert release_service(tiny_ctx.run_id) is True
    assert sorted(closed) == ["own", "shared"] and tiny_ctx.run_id not in SERVICES
    with pytest.raises(RuntimeError, match="has ended: its rollout service on this worker was released"):
        svc.get_service(tiny_ctx)
    assert release_service(tiny_ctx.run_id) is False


@pytest.fixture
def tiny_ctx(tmp_path):
    import uuid

    from astratk.records import RunContext

    return RunContext(run_id=uuid.uuid4().hex[:12], spec=RunSpec(), model_paths={"main": str(tmp_path)},
                      store_url=str(tmp_path / "weights"))


def test_a_taken_cluster_gets_the_new_runs_thread_count(monkeypatch):
    """`rethread`: what a fresh cluster's nannies would have given the workers (the thread variables, read by what
    starts later, and torch's threads), the nannies' environment for a restart, the cluster's for a new worker."""
    import torch

    calls = []
    nanny = SimpleNamespace(pre_spawn_env={"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "6640"},
                            env={"OMP_NUM_THREADS": "1"})

    class Client:
        def run(self, fn, *args, **kw):
            calls.append(fn.__name__)
            assert kw.pop("callback_timeout") > 0  # every remote wait is bounded
            if kw.get("nanny"):
                fn(*args, dask_worker=nanny)
            else:
                fn(*args)

    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.setenv(k, "1")
    cluster = SimpleNamespace(_pre_spawn={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    before = torch.get_num_threads()
    try:
        warm.rethread(Client(), cluster, 3)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    assert all(os.environ[k] == "3" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"))
    assert nanny.pre_spawn_env == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "3",
                                   "PYTHONHASHSEED": "6640"}
    assert nanny.env["OMP_NUM_THREADS"] == "3"
    assert cluster._pre_spawn["OMP_NUM_THREADS"] == cluster._pre_spawn["OPENBLAS_NUM_THREADS"] == "3"
    assert len(calls) == 2
