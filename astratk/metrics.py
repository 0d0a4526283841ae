"""Run metrics as one `xarray.Dataset`: training steps, held-out evaluations, data-layer counters, drops
and rollout-service throughput.

Layout (per-policy variables have a `policy` dimension, so multi-policy runs share one dataset):
- dims `(policy, step)`: per-step trainer metrics, e.g. `train_reward_mean` (and `train_reward_mean_<role>` in a
  workflow), `train_loss`, `train_staleness_mean` / `_max` (versions between the trained weights and the tokens'
  behaviour weights), `train_time_s` (seconds since training started), `train_data_wait_s`, and the loss's
  diagnostics `loss_*` (DRPO: `loss_tv_mean` / `_max` = |pi - mu|, `loss_w_mean` / `_min` / `_max` = its gradient
  weight), corrections' `train_correction_<name>_*`;
- dims `(policy, evaluation)`: `eval_accuracy` (and `eval_accuracy_<role>`), `eval_version`, `eval_train_time_s`
  (training time at which the evaluated weights were published);
- dims `(policy,)`: final data-layer and acquisition counters, `data_groups_dropped_stale`, `data_groups_admitted`...;
- dims `(drop_record,)`: `dropped`, every counted drop with coordinates `drop_stage` (curation, rollout, admission, serving:
  the data path's order), `drop_reason` (`zero_variance`, `stale`, a curator's name...), `drop_unit` (tasks, results,
  groups, trajectories), `drop_policy` ("" for task-level drops, which precede any policy) and `drop_task_ids` (the
  first tasks dropped, comma-separated, for drops counted per task: `prompt_too_long`);
- dims `(service,)` (one per rollout service, i.e. per rollout worker that produced data), with coordinate
  `service_hardware` (its worker class / hardware label): `service_tasks`, `service_tasks_per_s`,
  `service_tokens_per_s`, `service_version_lag_mean`, ...; and dims `(hardware,)`: the same per class
  (`hardware_tasks_per_s` is the mean per-service speed of the class, `hardware_services` how many services it has);
- attrs: the run's summary and the run-level counters (`counter_data_leases_issued`, ...); `partial` = 1 in the copies
  a run writes while it trains (`metrics_every_s`), 0 in the final one.
Metric keys `"{component}/{policy_id}/{name}"` become variables `"{component}_{name}"`. Every variable carries
`description` and, where it has one, `units` attributes (`describe`). The dimension names avoid xarray's method
names (`ds.eval`, `ds.drop` are methods): files written before that used `eval` and `drop`, and `load` renames them.

`import astratk.viz` registers the `.astra` accessor (dashboards) on these datasets.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from astratk.records import DROP_STAGES, Drop

EVAL_DIM = "evaluation"  # held-out evaluations, in the order they were made
DROP_DIM = "drop_record"  # counted drops, along the data path
OLD_DIMS = {"eval": EVAL_DIM, "drop": DROP_DIM}  # files written before the rename

# exact names first, then (prefix or suffix, attributes) rules: the first that matches describes a variable
DESCRIPTIONS: dict[str, dict[str, str]] = {
    "policy": {"description": "policy id"},
    "step": {"description": "optimizer step of the policy's trainer (0-based)"},
    EVAL_DIM: {"description": "held-out evaluation, in the order made"},
    DROP_DIM: {"description": "one counted drop (stage, reason, unit, policy)"},
    "service": {"description": "rollout service (one per rollout worker that produced data)"},
    "hardware": {"description": "worker class / hardware label"},
    "train_reward_mean": {"description": "mean reward of the step's trained samples"},
    "train_loss": {"description": "the policy loss of the step"},
    "train_staleness_mean": {"description": "mean versions between the trained weights and the tokens' behaviour "
                                            "weights", "units": "versions"},
    "train_staleness_max": {"description": "most versions between the trained weights and a token's behaviour "
                                           "weights", "units": "versions"},
    "train_time_s": {"description": "seconds since training started", "units": "s"},
    "train_data_wait_s": {"description": "seconds the step waited for data", "units": "s"},
    "train_step_compute_s": {"description": "seconds the step computed", "units": "s"},
    "train_pi_mu_abs_mean": {"description": "mean |pi - mu| of the sampled tokens (trainer vs behaviour "
                                            "probability)", "units": "probability"},
    "train_pi_mu_abs_max": {"description": "largest |pi - mu| of a sampled token", "units": "probability"},
    "train_grad_norm": {"description": "gradient norm before clipping"},
    "eval_accuracy": {"description": "greedy held-out accuracy (mean score of the first role)", "units": "fraction"},
    "eval_version": {"description": "weight version evaluated", "units": "versions"},
    "eval_train_time_s": {"description": "training time at which the evaluated weights were published",
                          "units": "s"},
    "dropped": {"description": "count of one kind of drop (see the drop_* coordinates)"},
    "drop_stage": {"description": "where on the data path the drop happened"},
    "drop_reason": {"description": "why it was dropped"},
    "drop_unit": {"description": "what was counted: tasks, results, groups or trajectories"},
    "drop_policy": {"description": "the policy ('' for task-level drops)"},
    "drop_task_ids": {"description": "the first tasks dropped, comma-separated (per-task drops)"},
    "service_hardware": {"description": "the service's worker class / hardware label"},
}
RULES: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("suffix", "_per_s", {"units": "1/s"}),
    ("suffix", "_time_s", {"units": "s"}),
    ("suffix", "_wait_s", {"units": "s"}),
    ("suffix", "_s", {"units": "s"}),
    ("suffix", "_frac", {"units": "fraction"}),
    ("suffix", "_fraction", {"units": "fraction"}),
    ("prefix", "eval_accuracy", {"description": "greedy held-out accuracy of one role", "units": "fraction"}),
    ("prefix", "eval_balanced_accuracy_", {"description": "held-out balanced accuracy of a judging role (the mean "
                                           "over the classes of what it judged of the share it judged right)",
                                           "units": "fraction"}),
    ("prefix", "eval_verdict_accept_rate", {"description": "held-out share of a judging role's verdicts that "
                                            "accepted", "units": "fraction"}),
    ("prefix", "eval_pass_at_", {"description": "held-out pass@k (a task passes if any of k samples scores >= 1)",
                                 "units": "fraction"}),
    ("prefix", "eval_sampled_accuracy", {"description": "held-out mean@k: the mean score of k samples at the rollout "
                                                        "temperature (eval.pass_k)", "units": "fraction"}),
    ("prefix", "loss_", {"description": "a diagnostic of the policy loss, per step"}),
    ("prefix", "train_correction_", {"description": "a diagnostic of a mismatch correction, per step"}),
    ("prefix", "train_", {"description": "trainer metric, per optimizer step"}),
    ("prefix", "eval_", {"description": "held-out evaluation metric"}),
    ("prefix", "data_traj_", {"description": "env metric averaged over the policy's admitted trajectories"}),
    ("prefix", "data_", {"description": "data-layer counter at the end of the run"}),
    ("prefix", "acquisition_", {"description": "acquisition-loop counter at the end of the run"}),
    ("prefix", "service_", {"description": "per rollout service, over the run"}),
    ("prefix", "hardware_", {"description": "per worker class (speeds averaged over its services, counts summed)"}),
    ("prefix", "autoscale_", {"description": "what the pool's autoscaler saw, per step"}),
)


def describe(name: str) -> dict[str, str]:
    """`description` and (where known) `units` of a metrics variable or coordinate."""
    out = dict(DESCRIPTIONS.get(name, {}))
    for kind, pattern, attrs in RULES:
        if (name.endswith(pattern) if kind == "suffix" else name.startswith(pattern)):
            for k, v in attrs.items():
                out.setdefault(k, v)
    out.setdefault("description", name.replace("_", " "))
    return out


def _split(key: str, policies: Sequence[str]) -> tuple[str | None, str]:
    """'train/main/loss/ratio_mean' -> ('main', 'loss_ratio_mean'); 'data/leases_issued' -> (None, ...)."""
    parts = key.split("/")
    if len(parts) >= 3 and parts[1] in policies:
        rest = parts[2:]
        if rest[0] == "loss" and len(rest) > 1:  # loss diagnostics: loss_ratio_mean, not train_loss_ratio_mean
            return parts[1], "_".join(rest)
        return parts[1], "_".join([parts[0], *rest])
    return None, "_".join(parts)


def _table(rows_by_policy: Mapping[str, Sequence[Mapping[str, float]]], dim: str, prefix: str | None,
           policies: Sequence[str]) -> dict[str, Any]:
    length = max((len(r) for r in rows_by_policy.values()), default=0)
    data: dict[str, np.ndarray] = {}
    for i, pid in enumerate(policies):
        for j, row in enumerate(rows_by_policy.get(pid, ())):
            for key, value in row.items():
                owner, name = _split(key, policies)
                if prefix is not None:
                    owner, name = pid, f"{prefix}_{key}"
                if owner != pid:
                    continue
                arr = data.setdefault(name, np.full((len(policies), length), np.nan))
                arr[i, j] = float(value)
    return {name: (("policy", dim), arr) for name, arr in data.items()}


def build_dataset(policies: Sequence[str], steps: Mapping[str, Sequence[Mapping[str, float]]],
                  evals: Mapping[str, Sequence[Mapping[str, float]]], counters: Mapping[str, float],
                  attrs: Mapping[str, Any] | None = None,
                  services: Mapping[str, Mapping[str, Any]] | None = None,
                  drops: Sequence[Drop] = ()) -> xr.Dataset:
    """`services`: rollout service name -> its metrics plus "hardware" (`ServiceStats.by_service()`); `drops`: the
    data layer's counted drops (`DataLayer.drops()`)."""
    policies = list(policies)
    variables = _table(steps, "step", None, policies)
    variables.update(_table(evals, EVAL_DIM, "eval", policies))
    coords: dict[str, Any] = {}
    if services:
        variables.update(_services(services, coords))
    variables.update(_drops(drops, policies, coords))
    scalars: dict[str, np.ndarray] = {}
    run_level: dict[str, float] = {}
    for key, value in counters.items():
        owner, name = _split(key, policies)
        if owner is None:
            run_level[name] = float(value)
            continue
        scalars.setdefault(name, np.full(len(policies), np.nan))[policies.index(owner)] = float(value)
    variables.update({name: (("policy",), arr) for name, arr in scalars.items()})
    clean_attrs = {k: _attr(v) for k, v in (attrs or {}).items()}
    clean_attrs.update({f"counter_{k}": v for k, v in run_level.items()})
    n_steps = max((len(r) for r in steps.values()), default=0)
    n_evals = max((len(r) for r in evals.values()), default=0)
    ds = xr.Dataset(variables, coords={"policy": policies, "step": np.arange(n_steps),
                                       EVAL_DIM: np.arange(n_evals), **coords}, attrs=clean_attrs)
    for name in ds.variables:
        ds[name].attrs.update(describe(str(name)))
    return ds


def _services(services: Mapping[str, Mapping[str, Any]], coords: dict[str, Any]) -> dict[str, Any]:
    """Per-service variables (dim `service`) and per-hardware-class aggregates (dim `hardware`)."""
    names = sorted(services)
    hardware = [str(services[n].get("hardware", "default")) for n in names]
    classes = sorted(set(hardware))
    coords.update(service=names, service_hardware=("service", hardware), hardware=classes)
    keys = sorted({k for row in services.values() for k, v in row.items() if isinstance(v, (int, float))})
    out: dict[str, Any] = {"hardware_services": (("hardware",), np.array([float(hardware.count(c)) for c in classes]))}
    for k in keys:
        col = np.array([float(services[n].get(k, np.nan)) for n in names])
        out[f"service_{k}"] = (("service",), col)
        reduce = (np.nanmax if k.endswith("_max") else np.nanmin if k.startswith("first_") else
                  np.nanmean if k.endswith(("_per_s", "_mean")) else np.nansum)  # counts add up; speeds average
        per_class = [float(reduce(col[[h == c for h in hardware]])) for c in classes]
        out[f"hardware_{k}"] = (("hardware",), np.array(per_class))
    return out


def _drops(drops: Sequence[Drop], policies: Sequence[str], coords: dict[str, Any]) -> dict[str, Any]:
    """Every counted drop (`DataLayer.drops()`) as one long variable `dropped` (dim `drop`), along the data path.
    Task-level drops have policy ''."""
    rows = sorted((d for d in drops if not d.policy or d.policy in policies),
                  key=lambda d: (DROP_STAGES.index(d.stage), d.policy, d.reason))
    if not rows:
        return {}
    coords.update({DROP_DIM: np.arange(len(rows)), "drop_stage": (DROP_DIM, [d.stage for d in rows]),
                   "drop_reason": (DROP_DIM, [d.reason for d in rows]), "drop_unit": (DROP_DIM, [d.unit for d in rows]),
                   "drop_policy": (DROP_DIM, [d.policy for d in rows]),
                   "drop_task_ids": (DROP_DIM, [",".join(d.task_ids) for d in rows])})
    return {"dropped": ((DROP_DIM,), np.array([d.count for d in rows]))}


def _attr(v: Any) -> Any:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float, str)):
        return v if not (isinstance(v, float) and math.isnan(v)) else "nan"
    return str(v)


# Serialises `save`'s brief change of Dask's (process-wide) scheduler setting, so that runs finishing together in one
# process nest it properly and leave it as they found it.
_SAVE_LOCK = threading.Lock()


def save(ds: xr.Dataset, path: str | Path) -> Path:
    """Write `ds` as netCDF, whatever Dask's state in this process. xarray asks Dask for the current scheduler even
    for numpy-backed data (to pick its file lock), and Dask's setting can name a distributed client that no longer
    exists (`Client` sets it process-wide and a closing one restores an older value: another run's, or a failed
    client's), which makes `to_netcdf` raise. So the data is loaded into memory and written under Dask's synchronous
    scheduler: no cluster, no client, no other run is involved."""
    import dask

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:  # written aside and renamed into place: a reader (or a crash) never sees half a file
        with _SAVE_LOCK, dask.config.set(scheduler="synchronous"):
            ds.load().to_netcdf(tmp, engine="h5netcdf")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load(path: str | Path) -> xr.Dataset:
    """A metrics file, with the dimension names of this version (older files' `eval` and `drop` renamed)."""
    with xr.open_dataset(path, engine="h5netcdf") as ds:
        ds = ds.load()
    rename = {old: new for old, new in OLD_DIMS.items() if old in ds.dims and new not in ds.dims}
    return ds.rename(rename) if rename else ds
