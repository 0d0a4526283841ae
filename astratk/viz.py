"""Dashboards with hvplot, through the `.astra` accessor on run-metrics datasets (opt in by importing this module).

Example:
    >>> import astratk.viz  # registers ds.astra
    >>> ds = astratk.metrics.load("runs/quickstart/metrics.nc")  # doctest: +SKIP
    >>> ds.astra.dashboard()  # doctest: +SKIP  (a HoloViews layout: reward per step, held-out accuracy over time)
    >>> ds.astra.save("runs/quickstart/dashboard")  # doctest: +SKIP  (writes .html and .png)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import xarray as xr


@xr.register_dataset_accessor("astra")
class AstraAccessor:
    def __init__(self, ds: xr.Dataset) -> None:
        self._ds = ds

    def _frame(self, dim: str, names: list[str]) -> Any:
        present = [n for n in names if n in self._ds]
        if not present:
            raise ValueError(f"the dataset has none of {names}; is it an astratk run's metrics?")
        return self._ds[present].to_dataframe().reset_index().dropna(subset=present, how="all")

    def reward(self) -> Any:
        """Training reward (mean over each step's batch) per step, one line per policy; in a workflow run one line
        per (policy, role) instead (`train_reward_mean_<role>`)."""
        import hvplot.pandas  # noqa: F401  (registers .hvplot)

        per_role = sorted(str(n) for n in self._ds.data_vars if str(n).startswith("train_reward_mean_"))
        if not per_role:
            df = self._frame("step", ["train_reward_mean"])
            return df.hvplot.line(x="step", y="train_reward_mean", by="policy", title="training reward",
                                  ylabel="mean reward", xlabel="optimizer step")
        df = self._frame("step", per_role).melt(id_vars=["policy", "step"], value_vars=per_role, var_name="role",
                                                value_name="reward").dropna(subset=["reward"])
        df["series"] = df["policy"].astype(str) + " / " + df["role"].str.removeprefix("train_reward_mean_")
        return df.hvplot.line(x="step", y="reward", by="series", title="training reward per role",
                              ylabel="mean reward", xlabel="optimizer step")

    def accuracy(self) -> Any:
        """Held-out accuracy against the training time at which the evaluated weights were published."""
        import hvplot.pandas  # noqa: F401

        df = self._frame("eval", ["eval_accuracy", "eval_train_time_s"]).dropna(subset=["eval_accuracy"])
        df = df.assign(eval_train_time_s=df["eval_train_time_s"].fillna(0.0).clip(lower=0.0))
        line = df.hvplot.line(x="eval_train_time_s", y="eval_accuracy", by="policy", title="held-out accuracy",
                              xlabel="training time (s)", ylabel="accuracy")
        return line * df.hvplot.scatter(x="eval_train_time_s", y="eval_accuracy", by="policy")

    def dashboard(self) -> Any:
        return (self.reward() + self.accuracy()).cols(2)

    def save(self, stem: str | Path) -> dict[str, Path]:
        """Write `<stem>.html` (interactive, bokeh) and `<stem>.png` (static, matplotlib backend)."""
        import holoviews as hv

        stem = Path(stem)
        stem.parent.mkdir(parents=True, exist_ok=True)
        html, png = stem.with_suffix(".html"), stem.with_suffix(".png")
        # resources="inline": the CDN default leaves an offline page blank ("Bokeh is not defined").
        # backend="bokeh": the matplotlib extension below becomes the current backend, so a second save() in one
        # process would otherwise write a PNG over <stem>.png and no HTML (tests/integration/test_dashboard_browser.py).
        hv.save(self.dashboard(), html, backend="bokeh", resources="inline")
        hv.extension("matplotlib", logo=False)
        hv.save(self.dashboard(), png, backend="matplotlib")
        return {"html": html, "png": png}
