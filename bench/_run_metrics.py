"""What the stability and precision benches read from a finished run's metrics (`metrics.nc`): a policy's series,
the training / inference mismatch |pi - mu| and the loss's mask / clip fractions, and the one collapse rule both
apply to a held-out accuracy curve."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

COLLAPSE_DROP = 0.10  # accuracy this far below its start is a collapse even without a gain to lose


def series(ds: Any, name: str) -> list[float]:
    """The first policy's values of one metric over the run's steps ([] where the run never logged it)."""
    if name not in ds:
        return []
    values = ds[name].sel(policy=ds.policy.values[0]).values.tolist() if "policy" in ds[name].dims else \
        ds[name].values.tolist()
    return [float(v) for v in values]


def finite_mean(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.nan


def mismatch_figures(metrics_file: str | Path) -> dict[str, Any]:
    """|pi - mu| (the sampled token's probability under the trainer against the engine's: mean and max over the run,
    and the first step's mean, before any staleness),
    staleness, skipped (non-finite) steps and the loss's `*_frac` metrics, from a run's metrics file."""
    from astratk.metrics import load

    ds = load(metrics_file)
    fracs = {var[len("loss_"):]: finite_mean(series(ds, var)) for var in ds.data_vars
             if var.startswith("loss_") and var.endswith("_frac")}
    mean, peak = series(ds, "train_pi_mu_abs_mean"), series(ds, "train_pi_mu_abs_max")
    skipped = series(ds, "train_skipped_steps")
    return {"pi_mu_abs_mean": finite_mean(mean), "pi_mu_abs_max": max(peak, default=math.nan),
            "pi_mu_abs_mean_last": mean[-1] if mean else math.nan,
            # the first step trains on the version that sampled its batch: there |pi - mu| is the precision part
            "pi_mu_abs_mean_first": mean[0] if mean else math.nan,
            "staleness_mean": finite_mean(series(ds, "train_staleness_mean")), "fractions": fracs,
            "skipped_steps": int(skipped[-1]) if skipped and math.isfinite(skipped[-1]) else 0}


def collapsed(initial: float, accuracies: list[float], nonfinite: bool = False) -> bool:
    """A run collapsed when it had non-finite steps, lost more than half of its best gain by its last evaluation, or
    ended more than `COLLAPSE_DROP` below where it started."""
    best, last = max([initial, *accuracies]), (accuracies or [initial])[-1]
    gain = best - initial
    return bool(nonfinite or (gain > 0 and last < initial + gain / 2) or last < initial - COLLAPSE_DROP)
