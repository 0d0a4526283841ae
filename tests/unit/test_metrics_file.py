"""metrics.nc: dimension names that do not shadow xarray methods, units and descriptions on every variable, atomic
writes, and older files (dims `eval`, `drop`) still loadable."""

from __future__ import annotations

import xarray as xr

from astratk.metrics import DROP_DIM, EVAL_DIM, describe, load, save
from tests.unit.test_dashboards import synthetic_metrics


def test_dims_do_not_shadow_xarray_methods():
    ds = synthetic_metrics()
    for dim in ds.dims:
        assert not callable(getattr(xr.Dataset, str(dim), None)), dim
    assert EVAL_DIM in ds.dims and DROP_DIM in ds.dims
    ds.isel({EVAL_DIM: 0})  # usable as keywords too: ds.isel(evaluation=0)


def test_every_variable_and_coordinate_is_described(tmp_path):
    ds = load(save(synthetic_metrics(), tmp_path / "metrics.nc"))
    for name in ds.variables:
        assert ds[name].attrs.get("description"), name
    assert ds["eval_accuracy"].attrs["units"] == "fraction"
    assert ds["train_time_s"].attrs["units"] == "s"
    assert ds["service_tokens_per_s"].attrs["units"] == "1/s"
    assert describe("loss_tv_mean")["description"].startswith("a diagnostic of the policy loss")
    assert describe("something_new") == {"description": "something new"}


def test_save_is_atomic_and_leaves_nothing_beside_the_file(tmp_path):
    path = tmp_path / "metrics.nc"
    save(synthetic_metrics(), path)
    save(synthetic_metrics(), path)  # overwrites in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.nc"]


def test_files_with_the_old_dimension_names_load_with_the_new_ones(tmp_path):
    old = synthetic_metrics().rename({EVAL_DIM: "eval", DROP_DIM: "drop"})
    old.to_netcdf(tmp_path / "old.nc", engine="h5netcdf")
    ds = load(tmp_path / "old.nc")
    assert EVAL_DIM in ds.dims and DROP_DIM in ds.dims and "eval" not in ds.dims
    assert ds["eval_accuracy"].dims == ("policy", EVAL_DIM)
