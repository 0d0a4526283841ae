"""The report of `bench/vs_trl.py`: each run's curve and headline figures, medians over seeds, the best lr per side,
the comparison table, the `--report` re-reading of a saved result, and the JSON, HTML and PNG files of a finished
bench."""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

SIDES = ("astratk", "trl")
TITLES = {"astratk": "astratk", "trl": "TRL GRPOTrainer"}
COLORS = {"astratk": "#1f77b4", "trl": "#d62728"}
GAINS = (0.15, 0.25)  # time-to-target rows: + 15 and + 25 points of held-out accuracy
HEADLINE_GAIN = 0.25


def _median(xs: list[float]) -> float:
    """Median; never-reached times are +inf, so a median among them is inf when half or more never reached."""
    return statistics.median(xs) if xs else math.nan


def _fmt_s(x: float | None) -> str:
    return "never" if x is None or math.isinf(x) else f"{x:.0f} s" if x >= 100 else f"{x:.1f} s"


# ------------------------------------------------------------------------------------------------------ the figures
def figures(run: dict[str, Any], initial: float, seconds: float) -> dict[str, Any]:
    """A run's curve (t = 0: the shared starting model) and headline numbers."""
    # a snapshot of step 0 (nothing trained by its mark) is the starting point itself
    curve = [{"time_s": 0.0, "step": 0, "accuracy": initial}] + [
        {k: s[k] for k in ("time_s", "step", "accuracy")} | {"marks": s["marks"]} for s in run["snapshots"]
        if s["step"] > 0]
    curve.sort(key=lambda p: (p["time_s"], p["step"]))
    time_to = {}
    for gain in GAINS:
        hit = next((p["time_s"] for p in curve if p["accuracy"] >= initial + gain - 1e-9), None)
        time_to[f"{round(100 * gain)}"] = hit
    at_end = [p for p in curve if p["time_s"] <= seconds + 1e-9]
    return {"curve": curve, "time_to": time_to, "accuracy_at_end": at_end[-1]["accuracy"],
            "accuracy_final": curve[-1]["accuracy"], "accuracy_best": max(p["accuracy"] for p in curve),
            "steps_per_s": run["steps"] / run["train_time_s"], "samples_per_s": run["samples"] / run["train_time_s"]}


def _t(x: float | None) -> float:
    return math.inf if x is None else x


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and per-seed values of one side's runs at one lr."""
    t = {g: [_t(r["time_to"][g]) for r in runs] for g in runs[0]["time_to"]}
    return {"lr": runs[0]["lr"], "seeds": [r["seed"] for r in runs],
            "time_to": {g: _median(v) for g, v in t.items()}, "time_to_per_seed": t,
            "accuracy_at_end": _median([r["accuracy_at_end"] for r in runs]),
            "accuracy_at_end_per_seed": [r["accuracy_at_end"] for r in runs],
            "accuracy_best": _median([r["accuracy_best"] for r in runs]),
            "accuracy_best_per_seed": [r["accuracy_best"] for r in runs],
            "steps": _median([r["steps"] for r in runs]),
            "steps_per_s": _median([r["steps_per_s"] for r in runs]),
            "steps_per_s_per_seed": [r["steps_per_s"] for r in runs],
            "samples_per_s": _median([r["samples_per_s"] for r in runs]),
            "samples_per_s_per_seed": [r["samples_per_s"] for r in runs],
            **{k: _median([r[k] for r in runs if r.get(k) is not None])  # real-model runs: rollout speed, memory
               for k in ("rollout_tokens_per_s", "peak_rss_process_gb", "peak_rss_sum_gb")
               if any(r.get(k) is not None for r in runs)}}


def time_to_level(curve: list[dict[str, Any]], level: float) -> float | None:
    """Training time of a curve's first point at or above `level` held-out accuracy (None: never)."""
    return next((p["time_s"] for p in curve if p["accuracy"] >= level - 1e-9), None)


def matched(runs: list[dict[str, Any]], best: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Time for each side (its best-lr runs, median over seeds) to reach the accuracy TRL ends at (its median at the
    end of the budget): the comparison that still means something when a model plateaus before +25 points."""
    if "trl" not in best or "astratk" not in best:
        return None
    level = best["trl"]["accuracy_at_end"]
    times = {side: [_t(time_to_level(r["curve"], level)) for r in runs
                    if r["side"] == side and r["lr"] == best[side]["lr"]] for side in ("astratk", "trl")}
    med = {side: _median(ts) for side, ts in times.items()}
    ratio = med["trl"] / med["astratk"] if math.isfinite(med["astratk"]) and med["astratk"] > 0 else math.nan
    return {"level": level, "time_s": med, "time_s_per_seed": times, "trl_over_astratk": ratio}


def rank_key(summary: dict[str, Any]) -> tuple[float, float]:
    """Best lr: the lowest median time to + 25 points, then the highest median accuracy at the end."""
    return (summary["time_to"][f"{round(100 * HEADLINE_GAIN)}"], -summary["accuracy_at_end"])


def table(best: dict[str, dict[str, Any]], sweep: dict[str, list[dict[str, Any]]], args: argparse.Namespace,
          dropped: dict[str, Any]) -> str:
    sides = [s for s in SIDES if s in best]

    def per_seed(xs: list[float], fmt: Callable[[float], str]) -> str:
        return "; " + ", ".join(fmt(x) for x in xs) if len(xs) > 1 else ""

    pct = lambda x: f"{100 * x:.1f}%"
    rate = lambda x: f"{x:.2f}"
    rows = [("lr (best of the sweep)", lambda b: f"{b['lr']:g} ({len(b['seeds'])} seed{'s' * (len(b['seeds']) > 1)})")]
    for gain in GAINS:
        g = f"{round(100 * gain)}"
        rows.append((f"time to +{g} points (median; per seed)",
                     lambda b, g=g: _fmt_s(b["time_to"][g]) + per_seed(b["time_to_per_seed"][g], _fmt_s)))
    rows += [(f"accuracy at {args.seconds:g} s", lambda b: pct(b["accuracy_at_end"])
              + per_seed(b["accuracy_at_end_per_seed"], pct)),
             ("best accuracy", lambda b: pct(b["accuracy_best"]) + per_seed(b["accuracy_best_per_seed"], pct)),
             ("optimizer steps (median)", lambda b: f"{b['steps']:.0f}"),
             ("optimizer steps/s", lambda b: rate(b["steps_per_s"]) + per_seed(b["steps_per_s_per_seed"], rate)),
             ("samples/s", lambda b: f"{b['samples_per_s']:.0f}" + per_seed(b["samples_per_s_per_seed"],
                                                                           lambda x: f"{x:.0f}"))]
    if any("rollout_tokens_per_s" in best[s] for s in sides):
        rows += [("rollout tokens/s (median)", lambda b: f"{b.get('rollout_tokens_per_s', math.nan):.0f}"),
                 ("peak RSS, largest process (GB)", lambda b: f"{b.get('peak_rss_process_gb', math.nan):.2f}"),
                 ("peak RSS, all its processes (GB)", lambda b: f"{b.get('peak_rss_sum_gb', math.nan):.2f}")]
    lines = ["| | " + " | ".join(TITLES[s] for s in sides) + " |", "|---" * (len(sides) + 1) + "|"]
    for title, cell in rows:
        lines.append(f"| {title} | " + " | ".join(cell(best[s]) for s in sides) + " |")
    if "astratk" in best:
        cells = [", ".join(f"{k} {v}" for k, v in dropped.items()) or "none"] + ["-"] * (len(sides) - 1)
        lines.append("| groups dropped (astratk, all seeds) | " + " | ".join(cells) + " |")
    g = f"{round(100 * HEADLINE_GAIN)}"
    for lr in sorted({x["lr"] for side in sides for x in sweep.get(side, [])}):
        cells = []
        for side in sides:
            x = next((x for x in sweep.get(side, []) if x["lr"] == lr), None)
            cells.append("-" if x is None else f"+{g} at {_fmt_s(x['time_to'][g])}, {pct(x['accuracy_at_end'])} at "
                         f"end, {rate(x['steps_per_s'])} steps/s")
        lines.append(f"| sweep: lr {lr:g} ({args.sweep_seeds} seed{'s' * (args.sweep_seeds > 1)}) | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def _matched_line(match: dict[str, Any]) -> str:
    a, t = match["time_s"]["astratk"], match["time_s"]["trl"]
    per = "; ".join(f"{side} " + ", ".join(_fmt_s(x) for x in xs) for side, xs in match["time_s_per_seed"].items())
    ratio = f"{match['trl_over_astratk']:.2f}x" if math.isfinite(match["trl_over_astratk"]) else "-"
    return (f"\ntime to TRL's accuracy at the end ({100 * match['level']:.1f}%), medians: astratk {_fmt_s(a)}, TRL "
            f"{_fmt_s(t)}: TRL / astratk {ratio} ({per})")


def report(path: Path) -> None:
    """Re-read a finished (`<model>.json`) or partial (`<model>.runs.json`) result: each side's best lr by the bench's
    rule, and the time-to-TRL's-final-accuracy comparison (`matched`)."""
    data = json.loads(path.read_text())
    runs = data["runs"]
    best = data.get("best")
    if not best:
        best = {}
        for side in SIDES:
            by_lr: dict[float, list[dict[str, Any]]] = {}
            for r in runs:
                if r["side"] == side:
                    by_lr.setdefault(r["lr"], []).append(r)
            if by_lr:
                best[side] = min((summarise(rs) for rs in by_lr.values()), key=rank_key)
    for side, b in best.items():
        print(f"{side}: best lr {b['lr']:g} over {len(b['seeds'])} seed(s), accuracy at the end "
              f"{100 * b['accuracy_at_end']:.1f}%, {b['steps_per_s']:.2f} steps/s")
    match = matched(runs, best)
    if match is not None:
        print(_matched_line(match))


def plot(runs: list[dict[str, Any]], initial: float, stem: Path, title: str) -> dict[str, Path]:
    """Accuracy against training time, one line per run, coloured by side: `<stem>.html` (bokeh) and `.png`
    (matplotlib), each built with its own backend current (as astratk/viz.py saves its dashboards)."""
    import holoviews as hv
    import hvplot.pandas  # noqa: F401 - registers .hvplot
    import pandas as pd

    def build(backend: str) -> Any:
        overlay = None
        for r in runs:
            df = pd.DataFrame(r["curve"])[["time_s", "accuracy"]]
            label = f"{TITLES[r['side']]} lr {r['lr']:g} seed {r['seed']}"
            curve = df.hvplot.line(x="time_s", y="accuracy", label=label, color=COLORS[r["side"]],
                                   xlabel="training time (s)", ylabel="held-out accuracy (greedy)")
            overlay = curve if overlay is None else overlay * curve
        dash = {"line_dash": "dashed"} if backend == "bokeh" else {"linestyle": "dashed"}
        for gain in GAINS:  # the targets: start + 15 and + 25 points
            overlay = overlay * hv.HLine(initial + gain).opts(color="gray", **dash)
        opts = {"title": title}
        if backend == "bokeh":
            opts.update(width=900, height=500, legend_position="bottom_right")
        else:
            opts.update(fig_size=200, legend_position="right")
        return overlay.opts(**opts)

    previous = hv.Store.current_backend if hv.Store.current_backend in hv.Store.renderers else "bokeh"
    hv.extension("bokeh", "matplotlib", logo=False)
    html, png = stem.with_suffix(".html"), stem.with_suffix(".png")
    try:
        hv.save(build("bokeh"), html, backend="bokeh", resources="inline")
        hv.Store.set_current_backend("matplotlib")
        hv.save(build("matplotlib"), png, backend="matplotlib", dpi=90)
    finally:
        hv.Store.set_current_backend(previous)
    return {"html": html, "png": png}


# ------------------------------------------------------------------------------------------------ the end of a bench
def conclude(args: argparse.Namespace, runs: list[dict[str, Any]], best: dict[str, dict[str, Any]],
             sweep: dict[str, list[dict[str, Any]]], model: dict[str, Any], marks: list[float], eval_seconds: float,
             threads: int, stem: Path) -> None:
    """The end of a bench: the table, the ratios of the two sides' medians and TRL's set-up printed, then
    `<stem>.json` (every run, curve and figure; `model` is its model record) and the accuracy plot written."""
    import torch

    params, initial = model["params"], model["initial_accuracy"]
    dropped: dict[str, int] = {}
    for r in runs:
        if r["side"] == "astratk" and r["lr"] == best.get("astratk", {}).get("lr"):
            for k, v in r["groups_dropped"].items():
                dropped[k] = dropped.get(k, 0) + v
    text = table(best, sweep, args, dropped)
    g = f"{round(100 * HEADLINE_GAIN)}"
    ratios = {}
    if len(best) == 2:
        a, b = best["astratk"], best["trl"]
        ratios = {f"time_to_{g}_trl_over_astratk": (b["time_to"][g] / a["time_to"][g]
                                                    if math.isfinite(a["time_to"][g]) else math.nan),
                  "steps_per_s_astratk_over_trl": a["steps_per_s"] / b["steps_per_s"]}
    trl_run = next((r for r in runs if r["side"] == "trl"), None)
    print(f"\n{args.model} model ({params / 1e6:.2f}M parameters), {args.seconds:g} s of training per run, "
          f"{args.heldout} held-out tasks, start {100 * initial:.1f}%; {threads} CPU cores "
          f"({platform.processor() or platform.machine()})\n")
    print(text)
    match = matched(runs, best)
    if match is not None:
        ratios["time_to_trl_final_accuracy_trl_over_astratk"] = match["trl_over_astratk"]
        print(_matched_line(match))
    if ratios:
        r25, (ta, tt) = ratios[f"time_to_{g}_trl_over_astratk"], (best[s]["time_to"][g] for s in SIDES)
        said = (f"{r25:.2f}x" if math.isfinite(r25) else "astratk reached it, TRL did not" if math.isfinite(ta)
                else "neither side reached it" if math.isinf(tt) else "TRL reached it, astratk did not")
        print(f"\ntime to +{g} points, TRL / astratk (medians): {said}")
        print(f"optimizer steps/s, astratk / TRL (medians): {ratios['steps_per_s_astratk_over_trl']:.2f}x")
    if trl_run is not None:
        c = trl_run["check"]
        env = ", ".join(f"{k}={v}" for k, v in (trl_run.get("thread_env") or {}).items() if v is not None) or "none"
        print(f"\nTRL {trl_run['trl_version']} ({trl_run['threads']} torch threads; thread variables set: {env}): "
              f"prompt token ids{' (and whole tool episodes)' if 'example_episode' in c else ''} equal to "
              f"astratk's on {c['prompts_compared']} tasks: {c['prompt_ids_equal']}; "
              f"stop tokens {c['trl_eos_token_ids']} (astratk {c['astratk_stop_token_ids']})")
        print("GRPOConfig: " + ", ".join(f"{k}={v}" for k, v in trl_run["config"].items()))
    payload = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "machine": {"cores": threads, "platform": platform.platform(), "python": platform.python_version(),
                           "torch": torch.__version__},
               "model": model,
               "marks_s": marks, "runs": runs, "sweep": sweep, "best": best, "ratios": ratios, "table": text,
               "matched": match,
               "eval_seconds": eval_seconds}
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=1, default=float))
    files = {"json": stem.with_suffix(".json")}
    try:
        files |= plot(runs, initial, stem, f"{args.model} model: held-out accuracy against training time")
    except Exception as e:  # noqa: BLE001 - the numbers are written already
        print(f"plot not written: {type(e).__name__}: {e}")
    print("\n" + "\n".join(f"{k:>5}: {v}" for k, v in files.items()))

