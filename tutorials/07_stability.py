# %% [markdown]
# # 7. Which losses stay stable when rollouts are off-policy
#
# Asynchronous training samples with weights older than the ones it trains (the behaviour policy μ lags the policy
# π), and some losses cope with that better than others. `bench/stability.py` measures it on this toolkit's tiny
# model: every common policy loss × four off-policy regimes × seeds, each cell a real run from the same warm start,
# every snapshot scored on the same held-out problems. This notebook reads the saved grid, shows the table and the
# curves, and reruns one cell so you can check a number yourself (or try a loss of your own).
#
# The regimes: `sync` (staleness 0), `async4` (asynchronous, staleness ≤ 4), `stale16` (every sample at least 16
# versions old: `rollout.weight_lag: 16`) and `bf16` (the engine samples in bfloat16 while the trainer computes in
# float32, on top of async staleness). The losses and their math are in `docs/algorithms.md`.

# %%
import importlib.util
import json
import os
from pathlib import Path

import hvplot.xarray  # noqa: F401 - registers .hvplot on xarray objects
import numpy as np
import xarray as xr

from astratk.quick import short_mode, tutorial_file

ROOT = tutorial_file("07_stability.py").parent.parent  # the clone, from its root or from tutorials/
saved = json.loads((ROOT / "docs" / "results" / "stability.json").read_text())
first = saved["cells"][0]
print(f"{len(saved['cells'])} runs; lr {first['lr']:g}, {first['updates']} updates per batch, {first['steps']} steps "
      f"per run; held-out accuracy at the start {100 * saved['initial']:.1f}%")
if not saved.get("complete", True):
    print(f"a partial grid: {len(saved['missing'])} cells not run yet (`python bench/stability.py --resume`)")

# %% [markdown]
# **The grid as an xarray Dataset**, one value per (loss, regime, seed): the final and best held-out accuracy, whether
# the run collapsed (its accuracy fell by more than half of its gain, or 10 points below the start, or it had
# non-finite steps), and the mean |π − μ| of the sampled tokens over the run.

# %%
cells = saved["cells"]
losses = list(dict.fromkeys(c["loss"] for c in cells))
regimes = list(dict.fromkeys(c["regime"] for c in cells))
seeds = sorted({c["seed"] for c in cells})
shape = (len(losses), len(regimes), len(seeds))
fields = {"final": "held-out accuracy at the end", "best": "best held-out accuracy",
          "collapsed": "1 when the run collapsed", "pi_mu_abs_mean": "mean |pi - mu| of sampled tokens"}
data = {name: np.full(shape, np.nan) for name in fields}
for c in cells:
    at = (losses.index(c["loss"]), regimes.index(c["regime"]), seeds.index(c["seed"]))
    for name in fields:
        data[name][at] = float(c[name])
grid = xr.Dataset({name: (("loss", "regime", "seed"), values, {"description": fields[name]})
                   for name, values in data.items()},
                  coords={"loss": losses, "regime": regimes, "seed": seeds})
grid["gain"] = 100 * (grid["final"] - saved["initial"])
grid["gain"].attrs = {"units": "points", "description": "final minus starting held-out accuracy"}
grid  # noqa: B018 - a notebook shows its last expression

# %% [markdown]
# Median gain in points (over seeds; a seed missing from a regime is skipped), and how many runs collapsed:

# %%
print(grid["gain"].median("seed").round(1).to_pandas().to_string())
print()
print(grid["collapsed"].sum("seed").astype(int).to_pandas().to_string())

# %%
heat = grid["gain"].median("seed").hvplot.heatmap(x="regime", y="loss", C="gain", cmap="RdYlGn", width=520,
                                                    height=460, title="median gain at the end (points)")
heat  # noqa: B018 - a notebook shows its last expression

# %% [markdown]
# **Rerun one cell.** `bench/stability.py --cell LOSS:REGIME:SEED` runs one (loss, regime, seed) from the same warm
# start and evaluation; its result lands in `--out`'s `cells.jsonl`. A full cell takes one to two minutes on two
# cores. Try a different loss label, regime or seed (the labels are in `stability.LOSSES` and `stability.REGIMES`).

# %%
loader = importlib.util.spec_from_file_location("stability", ROOT / "bench" / "stability.py")
stability = importlib.util.module_from_spec(loader)
loader.loader.exec_module(stability)

saved_cells = {f"{c['loss']}:{c['regime']}:{c['seed']}": c for c in cells}
cell = "drpo_d0.2:stale16:0" if "drpo_d0.2:stale16:0" in saved_cells else next(iter(saved_cells))
out = Path(os.environ.get("ASTRATK_TUTORIAL_OUTPUT", "runs/tutorials")) / "stability"
argv = ["--cell", cell, "--out", str(out)]
if short_mode():  # the test suite's budget: a tiny warm start and a few steps
    argv += ["--smoke", "--steps", "4", "--eval-every", "2", "--heldout", "16", "--updates", "1"]
rerun = stability.main(argv)
mine = next(c for c in rerun["cells"] if f"{c['loss']}:{c['regime']}:{c['seed']}" == cell)
theirs = saved_cells[cell]
print(f"{cell}: rerun {100 * mine['initial']:.1f}% -> {100 * mine['final']:.1f}% in {mine['steps']} steps; "
      f"saved grid {100 * theirs['initial']:.1f}% -> {100 * theirs['final']:.1f}% in {theirs['steps']} steps")
print("tutorial done")
