# %% [markdown]
# # 1. Laptop quickstart
#
# One call trains a tiny model on arithmetic with DRPO, on a local Dask cluster of worker processes: rollouts, a data
# layer and a Lightning trainer, all on this CPU. Open this file as a notebook (Jupyter with jupytext, or VS Code) or
# run it: `python tutorials/run.py 01`. The test suite runs it with `ASTRATK_TUTORIAL_SHORT=1` (a smoke
# budget); the full version trains for 2.5 minutes and gains +15 held-out points or more.

# %%
import astratk
import astratk.viz  # registers the .astra dashboards on metrics datasets
from astratk.quick import short_mode, smoke, tutorial_file

run = astratk.Run.from_config(tutorial_file("quickstart.yaml"), "--output_dir", "runs/tutorials")
if short_mode():
    run = astratk.Run(smoke(run.spec, steps=3))

# %% [markdown]
# `start(block=False)` returns at once and trains in the background. Shown as a cell's last value, the run is a live
# view that updates in place: progress against its step or time budget, the held-out accuracy so far with a small
# curve, and the run's own log lines. `run.pause()`, `run.resume()` and `run.stop()` control it.

# %%
run.start(block=False)
run  # noqa: B018 - the live view

# %% [markdown]
# `wait()` blocks until the run is done and returns its result: where the metrics, dashboard and summary are.

# %%
result = run.wait()
print(result)

# %% [markdown]
# The metrics are an `xarray.Dataset`: per-step training metrics on (policy, step), held-out evaluations on
# (policy, evaluation), per-worker throughput on (service), final counters. The `.astra` accessor draws dashboards.

# %%
ds = result.metrics()
print(ds["train_reward_mean"].sel(policy="main").values)
dashboard = ds.astra.dashboard()  # reward, accuracy, version lag, |pi - mu|, drops, throughput...
ds.astra.save(result.run_dir / "tutorial-dashboard")  # standalone HTML + PNG
print("tutorial done")
dashboard  # noqa: B018 - the notebook shows the dashboard here
