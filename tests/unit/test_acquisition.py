"""The acquisition loop's bookkeeping: per-service metrics, the lost-task identity, and a cancelled chain (Dask's
`wait` raises while any future is cancelled) being released for re-issue instead of wedging the loop."""

from __future__ import annotations

import threading
import time

import pytest

import astratk.runtime.acquisition as acquisition_module
from astratk.runtime.acquisition import Acquisition, ServiceStats, task_accounting


def chunk(hardware: str, leases: int, seconds: float, versions: list[int], lags: list[int], synced: int,
          tokens: float = 10.0) -> dict:
    return {"hardware": hardware, "leases": leases, "groups_admitted": leases, "duplicates": 0.0, "samples": 4.0 * leases,
            "tokens": tokens, "seconds": seconds, "versions": versions, "lags": lags,
            "synced_versions": {"main": synced}}


def test_service_stats_throughput_lag_and_first_version():
    stats = ServiceStats()
    stats.add({"w0": chunk("fast", 4, 0.5, [3, 3, 3, 3], [0, 0, 1, 1], synced=3)})
    stats.add({"w0": chunk("fast", 4, 0.5, [5, 5, 5, 5], [0, 0, 0, 2], synced=5),
               "w1": chunk("slow", 2, 2.0, [4, 4], [1, 1], synced=4, tokens=4.0)})
    rows = stats.by_service()
    w0, w1 = rows["w0"], rows["w1"]
    assert w0["tasks"] == 8 and w0["busy_s"] == 1.0 and w0["tasks_per_s"] == 8.0 and w0["tokens_per_s"] == 20.0
    assert w0["version_lag_mean"] == 0.5 and w0["version_lag_max"] == 2  # lags 0,0,1,1,0,0,0,2
    assert w0["first_version"] == 3 and w0["first_synced_version"] == 3  # from the first chunk only
    assert w1["tasks_per_s"] == 1.0 and w1["hardware"] == "slow"
    per_class = stats.by_hardware()
    assert per_class["fast"]["tasks"] == 8 and per_class["slow"]["tasks_per_s"] == 1.0


def test_task_accounting_identity():
    # 10 lease ids were created (12 issued, 2 of them re-issues): 7 admitted, 1 dropped after its attempts,
    # 1 outstanding and 1 waiting for re-issue when the run stopped -> nothing lost.
    data = {"data/leases_issued": 12, "data/leases_reissued": 2, "data/tasks_completed": 7,
            "data/tasks_dropped_failed": 1, "data/leases_outstanding": 1, "data/leases_waiting_reissue": 1,
            "data/duplicates_ignored": 3}
    acc = task_accounting(data)
    assert acc["tasks_leased"] == 10 and acc["tasks_open"] == 2 and acc["tasks_lost"] == 0
    data["data/tasks_completed"] = 6  # one lease id vanished
    assert task_accounting(data)["tasks_lost"] == 1


# ------------------------------------------------------------------------------------ a cancelled chain
_RELEASE = threading.Event()


def _stuck_rollout(ctx, leases):  # holds the chain in flight until the test releases it
    _RELEASE.wait(30)
    return []


@pytest.fixture
def client():
    from distributed import Client, LocalCluster

    cluster = LocalCluster(n_workers=1, processes=False, threads_per_worker=4,
                           dashboard_address="127.0.0.1:0", resources={"rollout_main": 4, "score": 4, "control": 1})
    with Client(cluster) as c:
        yield c
    cluster.close()


def test_a_cancelled_chain_is_released_and_the_loop_goes_on(client, monkeypatch):
    from astratk.dataflow.client import DataLayerClient
    from astratk.dataflow.datalayer import DataLayer
    from astratk.records import RunContext
    from astratk.spec import RolloutSpec, RunSpec

    spec = RunSpec(rollout=RolloutSpec(tasks_per_chunk=1, max_inflight_chunks=1))
    handle = DataLayerClient(client.submit(DataLayer, spec, actor=True, resources={"control": 1}).result(30))
    monkeypatch.setattr(acquisition_module, "rollout_task", _stuck_rollout)
    _RELEASE.clear()
    acq = Acquisition(client, handle, RunContext("t", spec, {}, "memory://t")).start()
    try:
        deadline = time.monotonic() + 60  # eventual behaviour; 20 s was once too short under the suite's load
        while not acq._inflight:
            assert time.monotonic() < deadline, "nothing was submitted"
            time.sleep(0.05)
        next(iter(acq._inflight)).cancel()
        while acq.counts["acquisition/chunks_failed"] < 1:
            assert time.monotonic() < deadline, f"the cancelled chain was never collected: {acq.errors}"
            time.sleep(0.05)
        while acq.counts["acquisition/chunks_submitted"] < 2:  # the loop goes on with a new chain
            assert time.monotonic() < deadline, "the loop stopped submitting"
            time.sleep(0.05)
        assert handle.metrics()["data/leases_released_error"] == 1
        assert acq.counts["acquisition/loop_errors"] == 0
    finally:
        _RELEASE.set()
        acq.stop()


def test_run_context_is_pickled_once_and_rebuilt_once_per_process():
    """The context travels with every rollout and score task: its bytes are made once, and a receiving process
    rebuilds the object once (bench/scaling.py: per-task pickling doubled a chunk's CPU cost)."""
    import pickle

    import cloudpickle

    from astratk.records import RunContext, ShippedContext, opened
    from astratk.spec import RunSpec

    ctx = RunContext("r1", RunSpec(), {"main": "/models/tiny"}, "memory://w")
    first, second = cloudpickle.dumps(ctx), cloudpickle.dumps(ctx)
    # what arrives is the shipped bytes (a scheduler that unpickles the task sees nothing else); a task opens them
    shipped_a, shipped_b = pickle.loads(first), pickle.loads(second)
    assert isinstance(shipped_a, ShippedContext) and shipped_a.blob is not None
    a, b = opened(shipped_a), opened(shipped_b)
    assert isinstance(a, RunContext) and a is b  # one rebuild per process
    assert shipped_a.run_id == "r1"  # attributes read through, for code handed the shipped form
    assert (a.run_id, a.model_paths, a.store_url, a.spec.env.name) == ("r1", {"main": "/models/tiny"}, "memory://w",
                                                                       ctx.spec.env.name)
    other = opened(pickle.loads(pickle.dumps(RunContext("r2", RunSpec(), {}, "memory://w"))))
    assert other.run_id == "r2" and other is not a
