"""The stability table: which policy losses stay stable when rollouts are off-policy (issue 16).

Asynchronous training samples with weights older than the ones it trains; the papers this toolkit implements make
claims about what that does to each loss (plain importance-sampled PG drifts and collapses, trust regions anchored on
the rollout policy hold, DRPO's smooth region is at least as good as DPPO's hard mask, naive PPO degrades with
staleness while the decoupled objective holds). This script measures them in miniature on this machine's CPU.

Grid: losses x regimes x seeds, each cell one real run (`astratk.runtime.run.Run`: the in-process trainer and a local
Dask cluster with one rollout worker), all from the quickstart's warm-started tiny model and task (arithmetic levels
1-2; `--env math_word` for word problems, with its own warm-started model).

Regimes (`REGIMES`):
- `sync`: `dataflow.synchronous: true`; step k trains on version k's rollouts (staleness 0).
- `async4`: asynchronous, `dataflow.max_staleness: 4` (the staleness this machine's pipeline produces by itself).
- `stale16`: asynchronous with `rollout.weight_lag: 16`: every sample is at least 16 versions old (bound 20).
- `bf16`: asynchronous, the engine samples in bfloat16 while the trainer computes log pi in float32: the training /
  inference precision mismatch on top of async staleness (weights published in bf16).

Every run makes `--updates` optimiser updates per batch (`trainer.updates_per_batch`, PPO's mini-batches; default 2):
with one update per batch and no staleness pi = mu in value and every loss is the same policy gradient. Runs are
step-based (`--steps` optimiser steps, capped at `--max-seconds`) so that regimes of different speed are compared at
equal updates. Every `--eval-every` versions (and the last) the weights are kept and, after the run, evaluated on
the env's first `--heldout` held-out tasks (greedy, the env's grader; the same function for every cell).

Per cell: the held-out accuracy curve, final and best accuracy, a collapse flag (accuracy falls by more than half of
its gain, or 10 points below the start, or the run had non-finite steps), mean and max |pi - mu| over the run, the
loss's mask / clip / truncation fractions, skipped steps, steps and wall time. Results append to
`--out/cells.jsonl` as each cell finishes (`--resume` skips cells already there), then `--out/stability.json`, the
markdown table, a heat-map (`heatmap.png/.html`: median accuracy gain per loss and regime) and curves
(`curves.png/.html`).

    python bench/stability.py                      # the full grid (~2 h on 2 cores)
    python bench/stability.py --quick              # smoke: 2 losses x 2 regimes x 1 seed, a few steps
    python bench/stability.py --resume             # continue an interrupted grid
    python bench/stability.py --report             # the table and figures of the cells run so far
    python bench/stability.py --cell drpo_d0.2:stale16:0   # rerun one cell (loss:regime:seed)
    python bench/stability.py --losses drpo_d0.2,pg_is --regimes async4,stale16 --seeds 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _run_metrics import collapsed, mismatch_figures

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "tutorials" / "quickstart.yaml"

# label -> (registry name, init args): every common choice, under its paper's defaults unless the label says
LOSSES: dict[str, tuple[str, dict[str, Any]]] = {
    "drpo_d0.05": ("drpo", {"delta": 0.05}),
    "drpo_d0.2": ("drpo", {"delta": 0.2}),
    "drpo_d1": ("drpo", {"delta": 1.0}),
    "drpo_d12.5": ("drpo", {"delta": 12.5}),
    "dppo_tv": ("dppo_tv", {}),
    "dppo_kl": ("dppo_kl", {}),
    "ppo_clip": ("ppo_clip", {}),
    "decoupled_ppo": ("decoupled_ppo", {}),
    "pg_is": ("pg_is", {}),
    "cispo": ("cispo", {}),
    "gspo": ("gspo", {}),
    "m2po": ("m2po", {}),
}
REGIMES = ("sync", "async4", "stale16", "bf16")
# seeds per regime in the full grid: the synchronous regime runs at half the speed, so it gets fewer (the budget)
SEEDS = {"sync": 2, "async4": 3, "stale16": 3, "bf16": 3}
ENVS = ("arithmetic", "math_word")
# one colour per loss, the same in every panel (tab20's strong half, then its light half)
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf", "#aec7e8", "#ffbb78")


# ---------------------------------------------------------------------------------------------------- one cell
def cell_spec(args: argparse.Namespace, loss: str, regime: str, seed: int, out_dir: Path):
    """The quickstart spec with the cell's loss, regime, seed and budget."""
    from astratk.config import load_spec
    from astratk.registry import resolve

    overrides = ["--output_dir", str(out_dir), "--name", f"stab-{loss}-{regime}-s{seed}", "--seed", str(seed),
                 "--eval.interval_s", "1000000000", "--eval.max_tasks", "16", "--progress", "false"]
    spec = load_spec(CONFIG, overrides)
    if args.env != "arithmetic":  # its own warm-started model: the model cache is keyed by the env too
        spec.env = resolve("env", args.env)()
    p = spec.policies[0]
    name, init = LOSSES[loss]
    p.loss = resolve("loss", name)(**init)
    p.trainer.lr = args.lr
    p.trainer.max_steps = args.steps
    p.trainer.max_time_s = float(args.max_seconds)
    p.trainer.updates_per_batch = args.updates
    spec.weights.keep_last = None  # every version stays until the cell is evaluated (then the run is deleted)
    if args.smoke:  # astratk.quick.smoke's tiny warm start and batch (the tutorial's short mode, the tests)
        from astratk.quick import smoke

        spec = smoke(spec, steps=args.steps)
        p = spec.policies[0]
        p.trainer.max_time_s = float(args.max_seconds)
    if regime == "sync":
        spec.dataflow.synchronous = True
    elif regime == "async4":
        spec.dataflow.max_staleness = 4
    elif regime == "stale16":
        spec.rollout.weight_lag, spec.dataflow.max_staleness = 16, 20
    elif regime == "bf16":
        spec.dataflow.max_staleness = 4
        spec.rollout.engine_args = {**spec.rollout.engine_args, "dtype": "bfloat16"}
        spec.weights.publish_dtype = "bfloat16"
    else:
        raise SystemExit(f"unknown regime {regime!r}; choose from {list(REGIMES)}")
    return spec.validate()


def run_cell(args: argparse.Namespace, loss: str, regime: str, seed: int, evaluate: Any, initial: float,
             tmp: Path) -> dict[str, Any]:
    from astratk.runtime.run import Run
    from astratk.weights.store import WeightStore

    spec = cell_spec(args, loss, regime, seed, tmp / "runs")
    pid = spec.policies[0].policy_id
    lines: list[str] = []
    wall = time.time()
    run = Run(spec, printer=print if args.verbose else lines.append)
    try:
        result = run.start()
    except BaseException:
        print("\n".join(lines[-40:]))
        raise
    s = result.summary
    store = WeightStore(spec.weights.url or str(result.run_dir / "weights"))  # where a run keeps its versions
    final = int(s.get("final_version", 0))
    published = sorted({v for v in [*range(args.eval_every, final + 1, args.eval_every), final] if v > 0})
    curve = [{"version": 0, "accuracy": initial}]
    for v in published:
        try:
            state, _ = store.pull(pid, None, v)
        except KeyError:  # a version the divergence guard skipped is never published
            continue
        curve.append({"version": v, "accuracy": evaluate(state)})
    figures = mismatch_figures(result.files["metrics"])
    shutil.rmtree(result.run_dir, ignore_errors=True)
    accs = [c["accuracy"] for c in curve]
    best, last = max(accs), accs[-1]
    nonfinite = figures["skipped_steps"] > 0 or bool(s.get("stopped_early") and "divergence" in str(
        s.get("stop_reason", "")))
    return {"loss": loss, "regime": regime, "seed": seed, "env": args.env, "lr": args.lr, "updates": args.updates,
            "steps": int(s.get("steps", 0)), "train_time_s": float(s.get("train_time_s", math.nan)),
            "wall_s": time.time() - wall, "curve": curve, "initial": initial, "final": last, "best": best,
            "collapsed": collapsed(initial, accs[1:], nonfinite), "nonfinite": nonfinite,
            **{k: figures[k] for k in ("skipped_steps", "pi_mu_abs_mean", "pi_mu_abs_max", "pi_mu_abs_mean_last",
                                       "staleness_mean", "fractions")},
            "stopped_early": bool(s.get("stopped_early")), "stop_reason": s.get("stop_reason")}


# ---------------------------------------------------------------------------------------------------- the grid
def grid(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    if args.cell:
        loss, regime, seed = args.cell.split(":")
        return [(loss, regime, int(seed))]
    # seed-major: an interrupted grid (--resume continues it) has every (loss, regime) at its first seeds
    n = {r: args.seeds if args.seeds is not None else (1 if args.quick else SEEDS[r]) for r in args.regime_list}
    return [(loss, regime, seed) for seed in range(max(n.values(), default=0)) for regime in args.regime_list
            if seed < n[regime] for loss in args.loss_list]


def summarise(cells: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    table: dict[tuple[str, str], dict[str, Any]] = {}
    for c in cells:
        table.setdefault((c["loss"], c["regime"]), {"runs": []})["runs"].append(c)
    for row in table.values():
        runs = row["runs"]
        row.update(final=statistics.median(r["final"] for r in runs), best=statistics.median(r["best"] for r in runs),
                   gain=statistics.median(r["final"] - r["initial"] for r in runs),
                   collapses=sum(r["collapsed"] for r in runs), n=len(runs),
                   pi_mu=statistics.median(r["pi_mu_abs_mean"] for r in runs),
                   pi_mu_max=max(r["pi_mu_abs_max"] for r in runs),
                   wall_s=statistics.median(r["wall_s"] for r in runs),
                   fractions={k: statistics.median(r["fractions"][k] for r in runs if k in r["fractions"])
                              for k in sorted({k for r in runs for k in r["fractions"]})})
    return table


def markdown(table: dict[tuple[str, str], dict[str, Any]], losses: list[str], regimes: list[str]) -> str:
    head = "| loss | " + " | ".join(regimes) + " |\n|---|" + "---|" * len(regimes) + "\n"
    rows = []
    for loss in losses:
        cells = []
        for regime in regimes:
            row = table.get((loss, regime))
            if row is None:
                cells.append("-")
                continue
            mark = f" **{row['collapses']}/{row['n']} collapsed**" if row["collapses"] else ""
            cells.append(f"{100 * row['final']:.1f}% (best {100 * row['best']:.1f}%, |π−μ| {row['pi_mu']:.3f})"
                         f"{mark}")
        rows.append(f"| {loss} | " + " | ".join(cells) + " |")
    return head + "\n".join(rows)


def clip_table(table: dict[tuple[str, str], dict[str, Any]], losses: list[str], regimes: list[str]) -> str:
    """The loss's own mask / clip / truncation fractions (medians over seeds of each run's mean)."""
    lines = ["| loss | regime | fractions (median over seeds of the run's mean) |", "|---|---|---|"]
    for loss in losses:
        for regime in regimes:
            row = table.get((loss, regime))
            if row and row["fractions"]:
                text = ", ".join(f"{k} {v:.3f}" for k, v in row["fractions"].items())
                lines.append(f"| {loss} | {regime} | {text} |")
    return "\n".join(lines)


def plot(cells: list[dict[str, Any]], table: dict, losses: list[str], regimes: list[str], out: Path
         ) -> dict[str, Path]:
    """`heatmap` (median gain per loss and regime, collapses in the hover) and `curves` (median accuracy against
    version, one panel per regime): `.html` (bokeh) and `.png` (matplotlib), each built with its own backend current
    (bokeh's PNG export would need a browser driver)."""
    import holoviews as hv
    import hvplot.pandas  # noqa: F401
    import pandas as pd

    heat = pd.DataFrame([{"loss": loss, "regime": regime, "gain (points)": 100 * row["gain"],
                          "collapsed": f"{row['collapses']}/{row['n']}"}
                         for (loss, regime), row in table.items()])
    # plain object columns in the grid's order (pandas' Arrow-backed strings and categoricals do not reshape for
    # the heat-map)
    heat = heat.astype({"loss": object, "regime": object, "collapsed": object})
    heat = heat.sort_values(["loss", "regime"], key=lambda col: col.map(
        {**{x: i for i, x in enumerate(losses)}, **{x: i for i, x in enumerate(regimes)}}))
    heat["text"] = [f"{g:+.1f}" + (f" ({c})" if not c.startswith("0/") else "")
                    for g, c in zip(heat["gain (points)"], heat["collapsed"], strict=True)]
    rows = [{"loss": c["loss"], "regime": c["regime"], "seed": c["seed"], "step": p["version"],
             "accuracy": 100 * p["accuracy"]} for c in cells for p in c["curve"]]
    frame = pd.DataFrame(rows).astype({"loss": object, "regime": object})
    medians = frame.groupby(["loss", "regime", "step"], as_index=False)["accuracy"].median()
    span = max(abs(heat["gain (points)"]).max(), 1.0)
    # numeric cell positions (the first loss on top) with the names as ticks: both backends draw the same grid, and
    # matplotlib can label cells, which it cannot on categorical axes
    heat["x"] = heat["regime"].map({r: i for i, r in enumerate(regimes)})
    heat["y"] = heat["loss"].map({name: len(losses) - 1 - i for i, name in enumerate(losses)})
    ticks = {"xticks": list(enumerate(regimes)), "yticks": [(len(losses) - 1 - i, n) for i, n in enumerate(losses)]}
    colors = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(losses)}

    def build(backend: str) -> dict[str, Any]:
        bokeh = backend == "bokeh"
        size = ({"width": 620, "height": 36 * len(losses) + 140, "tools": ["hover"]} if bokeh
                else {"fig_size": 170, "aspect": 1.1, "show_values": False})
        hm = hv.HeatMap(heat, kdims=["x", "y"], vdims=["gain (points)", "loss", "regime", "collapsed"]).opts(
            cmap="RdYlGn", clim=(-span, span), colorbar=True, xlabel="regime", ylabel="loss",
            title="median held-out accuracy gain at the end (points; collapsed runs)", **ticks, **size)
        labels = hv.Labels(heat, kdims=["x", "y"], vdims=["text"]).opts(
            **({"text_font_size": "9pt", "text_color": "black"} if bokeh else {"size": 8, "color": "black"}))
        panels = []
        for regime in regimes:
            sub = medians[medians["regime"] == regime]
            curves = [hv.Curve(sub[sub["loss"] == loss], "step", "accuracy", label=loss).opts(color=colors[loss])
                      for loss in losses if not sub[sub["loss"] == loss].empty]
            overlay = hv.Overlay(curves) if curves else None  # an Overlay even for one curve: it has the legend
            if overlay is not None:
                opts = ({"width": 460, "height": 320, "legend_position": "right"} if bokeh
                        else {"fig_size": 110, "legend_position": "right"})
                panels.append(overlay.opts(title=regime, xlabel="version (optimiser step)",
                                           ylabel="held-out accuracy (%)", **opts))
        layout = hv.Layout(panels).cols(2)
        if not bokeh:  # room for each panel's legend beside it
            layout = layout.opts(hspace=1.1, vspace=0.5, sublabel_format="")
        return {"heatmap": hm * labels, "curves": layout}

    previous = hv.Store.current_backend if hv.Store.current_backend in hv.Store.renderers else "bokeh"
    hv.extension("bokeh", "matplotlib", logo=False)
    files = {}
    try:
        for name, obj in build("bokeh").items():
            hv.save(obj, out / f"{name}.html", backend="bokeh", resources="inline")
            files[f"{name}_html"] = out / f"{name}.html"
        hv.Store.set_current_backend("matplotlib")
        for name, obj in build("matplotlib").items():
            hv.save(obj, out / f"{name}.png", backend="matplotlib", dpi=90)
            files[f"{name}_png"] = out / f"{name}.png"
    finally:
        hv.Store.set_current_backend(previous)
    return files


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--losses", default=",".join(LOSSES), help=f"comma-separated labels from {list(LOSSES)}")
    ap.add_argument("--regimes", default=",".join(REGIMES), help=f"comma-separated from {list(REGIMES)}")
    ap.add_argument("--seeds", type=int, default=None, help=f"seeds per cell (default per regime: {SEEDS})")
    ap.add_argument("--env", choices=ENVS, default="arithmetic")
    ap.add_argument("--steps", type=int, default=60, help="optimiser steps (data-layer batches) per run")
    ap.add_argument("--max-seconds", type=float, default=150.0, help="training time cap per run")
    ap.add_argument("--updates", type=int, default=2, help="trainer.updates_per_batch")
    ap.add_argument("--lr", type=float, default=2e-4, help="learning rate of every run")
    ap.add_argument("--eval-every", type=int, default=10, help="versions between evaluated snapshots")
    ap.add_argument("--heldout", type=int, default=256, help="held-out tasks each snapshot is evaluated on")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "stability")
    ap.add_argument("--resume", action="store_true", help="skip cells already in --out/cells.jsonl")
    ap.add_argument("--report", action="store_true",
                    help="run nothing: the table, JSON and figures of the cells already in --out/cells.jsonl")
    ap.add_argument("--cell", default=None, help="run one cell, LOSS:REGIME:SEED (appended to cells.jsonl)")
    ap.add_argument("--quick", action="store_true", help="smoke: 2 losses x 2 regimes x 1 seed, 6 steps, 32 tasks")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny warm start (30 steps) and 4 groups of 4 per step: for trying the script in a minute")
    ap.add_argument("--verbose", action="store_true", help="show each run's own output")
    args = ap.parse_args(argv)
    if args.quick:
        args.losses = "drpo_d0.2,pg_is" if args.losses == ",".join(LOSSES) else args.losses
        args.regimes = "sync,stale16" if args.regimes == ",".join(REGIMES) else args.regimes
        args.steps, args.heldout, args.eval_every, args.max_seconds = 6, 32, 3, 60.0
    args.loss_list = [x.strip() for x in args.losses.split(",") if x.strip()]
    args.regime_list = [x.strip() for x in args.regimes.split(",") if x.strip()]
    for x in args.loss_list:
        if x not in LOSSES:
            ap.error(f"--losses: unknown {x!r}; choose from {list(LOSSES)}")
    for x in args.regime_list:
        if x not in REGIMES:
            ap.error(f"--regimes: unknown {x!r}; choose from {list(REGIMES)}")
    if args.cell:
        parts = args.cell.split(":")
        if len(parts) != 3 or parts[0] not in LOSSES or parts[1] not in REGIMES or not parts[2].isdigit():
            ap.error(f"--cell {args.cell!r}: give LOSS:REGIME:SEED, e.g. drpo_d0.2:stale16:0 (losses {list(LOSSES)}, "
                     f"regimes {list(REGIMES)})")
    if args.steps < 1 or args.updates < 1 or args.eval_every < 1 or args.heldout < 1:
        ap.error("--steps, --updates, --eval-every and --heldout must be >= 1")
    if not args.lr > 0:
        ap.error(f"--lr must be > 0, got {args.lr}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "cells.jsonl"
    done: list[dict[str, Any]] = []
    if args.report and not log.exists():
        raise SystemExit(f"--report: no {log}; run the grid first")
    key = lambda c: (c["loss"], c["regime"], c["seed"], c["env"])
    if (args.resume or args.cell or args.report) and log.exists():
        latest = {}  # a cell run again (--cell) is appended: its last line is the one that counts
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        for i, line in enumerate(lines):
            try:
                cell = json.loads(line)
            except json.JSONDecodeError:
                if i == len(lines) - 1:  # a grid killed while writing its last cell: that cell runs again
                    print(f"{log}: the last line is incomplete (the grid was stopped while writing it); its cell "
                          "runs again")
                    if not args.report:  # new cells are appended after whole lines only
                        log.write_text("".join(x + "\n" for x in lines[:-1]))
                    continue
                raise SystemExit(f"{log}, line {i + 1}: not a cell record; fix or remove the line") from None
            latest[key(cell)] = cell
        done = list(latest.values())
    elif log.exists():
        log.unlink()  # a fresh grid
    finished = {key(c) for c in done}
    missing = [c for c in grid(args) if (c[0], c[1], c[2], args.env) not in finished]
    todo = [] if args.report else [c for c in grid(args) if (c[0], c[1], c[2], args.env) not in finished or args.cell]
    initial = next((c["initial"] for c in done if c["env"] == args.env), math.nan)
    with tempfile.TemporaryDirectory(prefix="stability-") as tmp_name:
        if not todo:
            print(f"{len(done)} cells in {log}; {len(missing)} of the grid not run yet")
        tmp = Path(tmp_name)
        if todo:  # only now the model, the trainer and their imports: --report and a finished --resume need none
            from vs_trl import HeldOut, torch_threads

            from astratk.models.cache import ensure_model

            spec = cell_spec(args, args.loss_list[0] if not args.cell else args.cell.split(":")[0],
                             "async4", 0, tmp / "runs")
            with torch_threads(1):
                model_dir = ensure_model(spec.policies[0].model, spec.env, log=lambda s: print(f"  {s}"))
            evaluate = HeldOut(model_dir, spec.env, args.heldout, os.cpu_count() or 1)
            initial = evaluate(evaluate.initial_state)
            print(f"model {model_dir}: held-out accuracy {100 * initial:.1f}% on {args.heldout} tasks; {len(todo)} "
                  f"cells to run ({len(done)} already in {log})", flush=True)
        for i, (loss, regime, seed) in enumerate(todo, 1):
            t = time.time()
            cell = run_cell(args, loss, regime, seed, evaluate, initial, tmp)
            with log.open("a") as f:
                f.write(json.dumps(cell, default=float) + "\n")
            done = [c for c in done if key(c) != key(cell)] + [cell]
            flag = " COLLAPSED" if cell["collapsed"] else ""
            print(f"[{i}/{len(todo)}] {loss} {regime} seed {seed}: {cell['steps']} steps, accuracy "
                  f"{100 * initial:.1f}% -> {100 * cell['final']:.1f}% (best {100 * cell['best']:.1f}%), |pi - mu| "
                  f"{cell['pi_mu_abs_mean']:.3f}{flag}; {time.time() - t:.0f} s", flush=True)
    cells = [c for c in done if c["env"] == args.env]
    losses = [x for x in LOSSES if any(c["loss"] == x for c in cells)]
    regimes = [x for x in REGIMES if any(c["regime"] == x for c in cells)]
    table = summarise(cells)
    text = markdown(table, losses, regimes)
    fractions = clip_table(table, losses, regimes)
    print(f"\n{args.env}: {len(cells)} runs, lr {args.lr:g}, {args.updates} updates per batch, {args.steps} steps per "
          f"run; start {100 * initial:.1f}% on {args.heldout} held-out tasks\n\n{text}\n\n{fractions}")
    payload = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "machine": {"cores": os.cpu_count(), "platform": platform.platform()},
               "initial": initial, "cells": cells, "table": text, "fractions": fractions,
               "complete": not missing, "missing": [":".join(map(str, c)) for c in missing],
               "summary": [{"loss": lo, "regime": re, **{k: v for k, v in row.items() if k != "runs"}}
                           for (lo, re), row in table.items()]}
    (args.out / "stability.json").write_text(json.dumps(payload, indent=1, default=float))
    files = {"json": args.out / "stability.json", "cells": log}
    try:
        files |= plot(cells, table, losses, regimes, args.out)
    except Exception as e:  # noqa: BLE001 - the table and JSON are the results; a plotting failure is reported
        print(f"plots failed: {type(e).__name__}: {e}")
    print("\n" + "\n".join(f" {k}: {v}" for k, v in files.items()))
    return payload


if __name__ == "__main__":
    main()
