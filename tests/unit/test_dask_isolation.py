"""Runs that share a process (a notebook's background runs) share nothing of Dask's: a run's client is not the
process's default, so it leaves Dask's process-wide scheduler setting alone (a default client sets it, and closing
one restores whatever it found: another run's client, since closed); the data-layer actor calls through its own
run's client; the metrics file is written whatever that setting says. Two real overlapping runs are
tests/integration/test_two_runs.py."""

from __future__ import annotations

import dask
import distributed
import numpy as np
import pytest
import xarray as xr

from astratk.dataflow.client import DataLayerClient
from astratk.metrics import load, save
from astratk.runtime.cluster import connect
from astratk.runtime.deploy import start_datalayer
from astratk.spec import ClusterSpec, RunSpec


def no_default_client() -> bool:
    try:
        distributed.default_client()
    except ValueError:
        return True
    return False


def test_metrics_are_written_while_dask_names_a_client_that_is_gone(tmp_path):
    """What a closed client can leave behind: Dask's scheduler setting naming the distributed scheduler with no
    client alive. xarray's `to_netcdf` asks Dask for the scheduler even for numpy data, and raised "Requested
    dask.distributed scheduler but no Client active"; the setting is as it was afterwards."""
    assert no_default_client()
    ds = xr.Dataset({"train_loss": (("policy", "step"), np.arange(6.0).reshape(1, 6))},
                    coords={"policy": ["main"], "step": np.arange(6)})
    with dask.config.set(scheduler="dask.distributed"):
        path = save(ds, tmp_path / "metrics.nc")
        assert dask.config.get("scheduler") == "dask.distributed"
    assert load(path)["train_loss"].values.tolist() == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]


@pytest.fixture
def cluster():
    with distributed.LocalCluster(n_workers=1, processes=False, threads_per_worker=2, dashboard_address=":0",
                                  resources={"control": 2}) as c:
        yield c


def test_run_clients_change_no_process_wide_state_and_outlive_each_other(cluster, tmp_path):
    """Two runs' clients of one scheduler, opened one after the other and closed in that order (the order that
    left Dask naming a closed client): neither is the default, Dask's scheduler setting never changes, each run's
    data layer answers through its own client, and the first one's goes on answering once the second's closed."""
    before = dask.config.get("scheduler", None)
    spec = RunSpec(cluster=ClusterSpec(scheduler_address=cluster.scheduler_address, startup_timeout_s=30))
    first = connect(spec)
    second = connect(spec)
    try:
        assert no_default_client() and dask.config.get("scheduler", None) == before
        handles = [DataLayerClient(start_datalayer(c, spec, timeout_s=30), call_timeout_s=30)
                   for c in (first, second)]
        assert [h.versions() for h in handles] == [{"main": 0}, {"main": 0}]
        second.close()
        assert handles[0].versions() == {"main": 0} and dask.config.get("scheduler", None) == before
    finally:
        second.close()
        first.close()
    assert no_default_client() and dask.config.get("scheduler", None) == before
    ds = xr.Dataset({"x": ("step", np.arange(3.0))})
    assert load(save(ds, tmp_path / "m.nc"))["x"].size == 3
